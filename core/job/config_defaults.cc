// Every unset value filled with its declared default: core/job/config_detail.h.
#include <set>
#include <string>
#include <vector>

#include <google/protobuf/reflection.h>

#include "core/job/config_detail.h"

namespace pipesgd::job::config_detail {
namespace {

// Sets every unset singular scalar to its declared default and creates the singular
// sub-messages, so that the printed configuration shows every value the job runs with. Members
// of a oneof are left alone: setting one would choose the kind. Records the paths it filled so
// that a field with no usable default (linear.out_features) is reported as "not set".
void FillDefaults(Message* message, std::vector<Step>* steps, std::set<std::string>* filled,
                  std::vector<const Descriptor*>* open) {
  const Descriptor* type = message->GetDescriptor();
  const Reflection* reflection = message->GetReflection();
  open->push_back(type);
  for (int i = 0; i < type->field_count(); ++i) {
    const FieldDescriptor* field = type->field(i);
    const bool in_oneof = field->real_containing_oneof() != nullptr;
    if (field->is_repeated()) {
      if (field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) continue;
      for (int j = 0; j < reflection->FieldSize(*message, field); ++j) {
        steps->push_back({field, j});
        FillDefaults(reflection->MutableRepeatedMessage(message, field, j), steps, filled, open);
        steps->pop_back();
      }
      continue;
    }
    const bool has = reflection->HasField(*message, field);
    if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      // A recursive type would otherwise be created forever.
      bool recursive = false;
      for (const Descriptor* t : *open) recursive |= t == field->message_type();
      if (!has && (in_oneof || recursive)) continue;
      steps->push_back({field, -1});
      FillDefaults(reflection->MutableMessage(message, field), steps, filled, open);
      steps->pop_back();
      continue;
    }
    if (has || in_oneof) continue;
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        reflection->SetInt32(message, field, field->default_value_int32());
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        reflection->SetInt64(message, field, field->default_value_int64());
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        reflection->SetUInt32(message, field, field->default_value_uint32());
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        reflection->SetUInt64(message, field, field->default_value_uint64());
        break;
      case FieldDescriptor::CPPTYPE_FLOAT:
        reflection->SetFloat(message, field, field->default_value_float());
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        reflection->SetDouble(message, field, field->default_value_double());
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        reflection->SetBool(message, field, field->default_value_bool());
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        reflection->SetEnum(message, field, field->default_value_enum());
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        reflection->SetString(message, field, field->default_value_string());
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        break;
    }
    if (!field->has_default_value()) {
      steps->push_back({field, -1});
      filled->insert(PathString(*steps));
      steps->pop_back();
    }
  }
  open->pop_back();
}

}  // namespace

std::set<std::string> FillDefaults(Message* message) {
  std::vector<Step> steps;
  std::set<std::string> filled;
  std::vector<const Descriptor*> open;
  FillDefaults(message, &steps, &filled, &open);
  return filled;
}

}  // namespace pipesgd::job::config_detail
