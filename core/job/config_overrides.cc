// --set PATH=VALUE: core/job/config_detail.h.
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/reflection.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/job/config_detail.h"

namespace pipesgd::job::config_detail {

std::string ExpectedValue(const FieldDescriptor* field) {
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_ENUM: {
      const pb::EnumDescriptor* type = field->enum_type();
      std::string names;
      for (int i = 0; i < type->value_count(); ++i) {
        if (i > 0) names += ", ";
        names += type->value(i)->name();
      }
      return fmt::format("one of {}", names);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return fmt::format("a {} message in braces: {{...}}", field->message_type()->full_name());
    case FieldDescriptor::CPPTYPE_STRING:
      return "a string (bare, or quoted with escapes)";
    default:
      return field->type_name();
  }
}

namespace {

class StringErrorCollector : public pb::io::ErrorCollector {
 public:
  void AddError(int, pb::io::ColumnNumber, const std::string& message) override {
    if (!errors_.empty()) errors_ += "; ";
    errors_ += message;
  }
  const std::string& errors() const { return errors_; }

 private:
  std::string errors_;
};

struct PathSegment {
  std::string name;
  std::optional<int> index;
};

std::vector<PathSegment> SplitOverridePath(const std::string& where, std::string_view path) {
  std::vector<PathSegment> segments;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string_view part = path.substr(start, dot == std::string_view::npos ? dot : dot - start);
    PathSegment segment;
    size_t bracket = part.find('[');
    segment.name = std::string(part.substr(0, bracket));
    if (segment.name.empty()) Throw(ErrorCode::kInvalidArgument, "{}: empty field name", where);
    if (bracket != std::string_view::npos) {
      std::string_view index = part.substr(bracket + 1);
      int value = -1;
      auto [end, ec] = std::from_chars(index.data(), index.data() + index.size(), value);
      if (ec != std::errc() || value < 0 || end == index.data() || end != &index.back() ||
          index.back() != ']') {
        Throw(ErrorCode::kInvalidArgument, "{}: bad index in '{}': expected NAME[N], N >= 0",
              where, part);
      }
      segment.index = value;
    }
    segments.push_back(std::move(segment));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return segments;
}


// Sets the leaf of an override. VALUE replaces the field's value (a message too: it is not
// merged into the old one); for a repeated field `index` is < size to replace that element or
// == size to append one.
void SetLeaf(const std::string& where, Message* message, const FieldDescriptor* field,
             int index, const std::string& value) {
  const Reflection* reflection = message->GetReflection();
  const bool replace_element = field->is_repeated() && index < reflection->FieldSize(*message, field);
  const bool quoted = !value.empty() && (value.front() == '"' || value.front() == '\'');
  if (field->cpp_type() == FieldDescriptor::CPPTYPE_STRING && !quoted) {
    // Paths on a command line are rarely quoted twice over; take them verbatim.
    if (!field->is_repeated()) {
      reflection->SetString(message, field, value);
    } else if (replace_element) {
      reflection->SetRepeatedString(message, field, index, value);
    } else {
      reflection->AddString(message, field, value);
    }
    return;
  }

  // The schema spells auto 0 in these fields.
  const bool auto_field =
      (field->containing_type() == config::Comm::descriptor() &&
       (field->number() == config::Comm::kChunkBytesFieldNumber ||
        field->number() == config::Comm::kStreamsFieldNumber)) ||
      (field->containing_type() == config::Train::descriptor() &&
       field->number() == config::Train::kPipelineWidthFieldNumber);
  if (value == "auto" && auto_field) {
    if (field->cpp_type() == FieldDescriptor::CPPTYPE_INT64) {
      reflection->SetInt64(message, field, 0);
    } else {
      reflection->SetInt32(message, field, 0);
    }
    return;
  }

  std::string text = value;
  if (field->cpp_type() == FieldDescriptor::CPPTYPE_ENUM && !quoted &&
      field->enum_type()->FindValueByName(value) == nullptr) {
    // Enum names in any case on the command line: --set comm.transport=ucx.
    const pb::EnumDescriptor* type = field->enum_type();
    for (int i = 0; i < type->value_count(); ++i) {
      const std::string& name = type->value(i)->name();
      if (name.size() == value.size() &&
          std::equal(name.begin(), name.end(), value.begin(), [](char a, char b) {
            return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
          })) {
        text = name;
        break;
      }
    }
  }
  TextFormat::Parser parser;
  StringErrorCollector errors;
  parser.RecordErrorsTo(&errors);
  // Parse into a scratch message first so that a bad value leaves no half-added element.
  std::unique_ptr<Message> scratch(message->New());
  if (!parser.ParseFieldValueFromString(text, field, scratch.get())) {
    Throw(ErrorCode::kInvalidArgument, "{}: expected {}{}", where, ExpectedValue(field),
          errors.errors().empty() ? "" : fmt::format(" ({})", errors.errors()));
  }
  if (!field->is_repeated()) reflection->ClearField(message, field);
  // The same text into the same field cannot fail the second time.
  const bool reparsed = parser.ParseFieldValueFromString(text, field, message);
  PSGD_CHECK(reparsed);
  if (replace_element) {
    // The value was appended; move it into place and drop the element it replaces.
    int last = reflection->FieldSize(*message, field) - 1;
    reflection->SwapElements(message, field, index, last);
    reflection->RemoveLast(message, field);
  }
}

}  // namespace

AppliedOverride ApplyOverride(config::Job* job, const std::string& spec) {
  const std::string where = "--set " + spec;
  size_t eq = spec.find('=');
  if (eq == std::string::npos) {
    Throw(ErrorCode::kInvalidArgument,
          "{}: expected PATH=VALUE (e.g. train.pipeline_width=1 or "
          "model.layers[0].linear.out_features=64)",
          where);
  }
  const std::string value = spec.substr(eq + 1);
  const std::vector<PathSegment> segments =
      SplitOverridePath(where, std::string_view(spec).substr(0, eq));

  Message* message = job;
  std::string path;
  for (size_t i = 0; i < segments.size(); ++i) {
    const PathSegment& segment = segments[i];
    const Descriptor* type = message->GetDescriptor();
    const Reflection* reflection = message->GetReflection();
    const FieldDescriptor* field = type->FindFieldByName(segment.name);
    if (field == nullptr) {
      Throw(ErrorCode::kInvalidArgument, "{}: no field '{}' in {} (fields: {})", where,
            segment.name, type->full_name(), FieldNames(type));
    }
    path += (path.empty() ? "" : ".") + segment.name;

    int index = -1;
    if (field->is_repeated()) {
      const int size = reflection->FieldSize(*message, field);
      if (!segment.index) {
        Throw(ErrorCode::kInvalidArgument,
              "{}: {} is repeated: index it, {}[i] (i < {} replaces, i == {} appends)", where,
              path, path, size, size);
      }
      if (*segment.index > size) {
        Throw(ErrorCode::kInvalidArgument,
              "{}: index {} out of range: {} has {} element(s) (i < {} replaces, i == {} "
              "appends)",
              where, *segment.index, path, size, size, size);
      }
      index = *segment.index;
      path += fmt::format("[{}]", index);
    } else if (segment.index) {
      Throw(ErrorCode::kInvalidArgument, "{}: {} is not repeated: it cannot be indexed", where,
            path);
    }

    if (i + 1 == segments.size()) {
      SetLeaf(where, message, field, index, value);
      break;
    }
    if (field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) {
      Throw(ErrorCode::kInvalidArgument, "{}: {} is {}, not a message: it has no field '{}'",
            where, path, field->type_name(), segments[i + 1].name);
    }
    if (index < 0) {
      // Selecting a member of a oneof (layers[i].linear) switches the layer's kind.
      message = reflection->MutableMessage(message, field);
    } else if (index < reflection->FieldSize(*message, field)) {
      message = reflection->MutableRepeatedMessage(message, field, index);
    } else {
      message = reflection->AddMessage(message, field);
    }
  }
  return {path, where};
}

}  // namespace pipesgd::job::config_detail
