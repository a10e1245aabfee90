#include "launcher/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/message.h>
#include <google/protobuf/reflection.h>
#include <google/protobuf/stubs/strutil.h>
#include <google/protobuf/text_format.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "layers/layer.h"
#include "transport/ifname.h"

namespace pipesgd::launcher {
namespace {

// Whether model.kernels = CUDNN can run in this build (whether libcudnn loads is the worker's
// question, on its machine).
constexpr bool CudnnBuilt() {
#ifdef PIPESGD_HAVE_CUDNN
  return true;
#else
  return false;
#endif
}

// Whether model.device = CUDA can run in this build.
constexpr bool CudaBackendBuilt() {
#ifdef PIPESGD_HAVE_CUDA_BACKEND
  return true;
#else
  return false;
#endif
}

namespace pb = google::protobuf;
using pb::Descriptor;
using pb::FieldDescriptor;
using pb::Message;
using pb::Reflection;
using pb::TextFormat;

// One field on the way from the Job root to a value; index is -1 for a singular field, as
// ParseInfoTree expects.
struct Step {
  const FieldDescriptor* field;
  int index;
};

// "model.layers[1].linear.out_features": the same spelling as an override path, so that a
// range error can be matched to the override that set the value.
std::string PathString(const std::vector<Step>& steps) {
  std::string out;
  for (const Step& step : steps) {
    if (!out.empty()) out += '.';
    out += step.field->name();
    if (step.index >= 0) out += fmt::format("[{}]", step.index);
  }
  return out;
}

// True when one path lies inside the other ("train" and "train.batch_size", "model.layers[1]"
// and "model.layers[1].relu"), but not for siblings that merely share a prefix ("layers[1]" and
// "layers[10]").
bool PathsOverlap(std::string_view a, std::string_view b) {
  if (a.size() > b.size()) std::swap(a, b);
  if (b.substr(0, a.size()) != a) return false;
  return b.size() == a.size() || b[a.size()] == '.' || b[a.size()] == '[';
}

std::string FieldNames(const Descriptor* type) {
  std::string out;
  for (int i = 0; i < type->field_count(); ++i) {
    if (i > 0) out += ", ";
    out += type->field(i)->name();
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Parse errors.

// Protobuf's own messages say what was expected but, for a bad value, not of which field; the
// field is recovered by re-tokenizing the text up to the error, tracking the enclosing blocks.
class TextContext {
 public:
  explicit TextContext(const std::string& text) : text_(text) {}

  struct At {
    // The path of the field whose value starts at the position ("model.layers[2].linear.
    // out_features"), or "" if the position is not at a value (a misspelt name, a brace).
    std::string field;
    // That field's descriptor (null where `field` is "" or names no field of the schema).
    const FieldDescriptor* descriptor = nullptr;
    // The token just before the position (line -1 if none).
    std::string previous;
    bool previous_is_identifier = false;
    int previous_line = -1;
    int previous_column = -1;
  };

  At operator()(int line, int column) const {
    std::vector<Frame> frames;
    frames.push_back({config::Job::descriptor(), "", {}});

    Discard discard;
    pb::io::ArrayInputStream input(text_.data(), static_cast<int>(text_.size()));
    pb::io::Tokenizer tokenizer(&input, &discard);
    // As TextFormat configures its own tokenizer, so that both see the same tokens.
    tokenizer.set_comment_style(pb::io::Tokenizer::SH_COMMENT_STYLE);
    tokenizer.set_allow_f_after_float(true);
    tokenizer.set_require_space_after_number(false);
    tokenizer.set_allow_multiline_strings(true);

    At at;
    std::string name;          // the identifier before the current ':' or '{'
    bool after_colon = false;  // the previous token was "name :"
    while (tokenizer.Next()) {
      const pb::io::Tokenizer::Token& token = tokenizer.current();
      if (token.line > line || (token.line == line && token.column >= column)) {
        if (after_colon && token.text != "{" && token.text != "<") {
          at.field = Child(frames.back(), name, /*count=*/false);
          const Descriptor* type = frames.back().type;
          at.descriptor = type != nullptr ? type->FindFieldByName(name) : nullptr;
        }
        return at;
      }
      at.previous = token.text;
      at.previous_is_identifier = token.type == pb::io::Tokenizer::TYPE_IDENTIFIER;
      at.previous_line = token.line;
      at.previous_column = token.column;
      const std::string& text = token.text;
      if (token.type == pb::io::Tokenizer::TYPE_IDENTIFIER && !after_colon) {
        name = text;
      } else if (text == ":" && !name.empty()) {
        after_colon = true;
        continue;
      } else if (text == "{" || text == "<") {
        Frame& parent = frames.back();
        const FieldDescriptor* field =
            parent.type != nullptr ? parent.type->FindFieldByName(name) : nullptr;
        std::string path = Child(parent, name, /*count=*/true);
        frames.push_back({field != nullptr ? field->message_type() : nullptr, path, {}});
        name.clear();
      } else if ((text == "}" || text == ">") && frames.size() > 1) {
        frames.pop_back();
        name.clear();
      } else if (after_colon) {
        // A scalar value: counts as one occurrence of a repeated field.
        Child(frames.back(), name, /*count=*/true);
        name.clear();
      }
      after_colon = false;
    }
    return at;
  }

 private:
  struct Frame {
    const Descriptor* type;  // null below an unknown field
    std::string path;
    std::unordered_map<std::string, int> seen;  // occurrences so far, to index repeated fields
  };

  // Syntax errors are the parser's to report; this pass only looks for field names.
  class Discard : public pb::io::ErrorCollector {
   public:
    void AddError(int, pb::io::ColumnNumber, const std::string&) override {}
  };

  static std::string Child(Frame& parent, const std::string& name, bool count) {
    const FieldDescriptor* field =
        parent.type != nullptr ? parent.type->FindFieldByName(name) : nullptr;
    std::string path = parent.path.empty() ? name : parent.path + "." + name;
    if (field != nullptr && field->is_repeated()) {
      int& seen = parent.seen[name];
      path += fmt::format("[{}]", seen);
      if (count) ++seen;
    }
    return path;
  }

  const std::string& text_;
};

std::string ExpectedValue(const FieldDescriptor* field);  // below

class FileErrorCollector : public pb::io::ErrorCollector {
 public:
  FileErrorCollector(const std::string& path, const std::string& text)
      : path_(path), context_(text) {}

  void AddError(int line, pb::io::ColumnNumber column, const std::string& message) override {
    if (line < 0) {
      errors_.push_back(fmt::format("{}: {}", path_, message));
      return;
    }
    TextContext::At at = context_(line, column);
    if (at.previous_is_identifier &&
        message.find('"' + at.previous + '"') != std::string::npos) {
      // Protobuf reports an unknown field or enum value, or a field given twice, at the token
      // after the offending name; point at the name itself.
      line = at.previous_line;
      column = at.previous_column;
      at = context_(line, column);
    }
    std::string what = message;
    if (std::optional<std::string> type = UnknownFieldOf(message)) {
      if (const Descriptor* d = pb::DescriptorPool::generated_pool()->FindMessageTypeByName(*type)) {
        what += fmt::format(" (fields: {})", FieldNames(d));
      }
    } else if (!at.field.empty()) {
      what = at.field + ": " + message;
      // A bad enum value: say what the field takes, as a bad --set value does.
      if (at.descriptor != nullptr &&
          at.descriptor->cpp_type() == FieldDescriptor::CPPTYPE_ENUM &&
          message.rfind("Unknown enumeration value", 0) == 0) {
        what += fmt::format(" Expected {} (upper case in a file; any case with --set).",
                            ExpectedValue(at.descriptor));
      }
    }
    errors_.push_back(fmt::format("{}:{}:{}: {}", path_, line + 1, column + 1, what));
  }

  std::string Joined() const { return fmt::format("{}", fmt::join(errors_, "\n")); }

 private:
  // The message type of 'Message type "T" has no field named "f".', protobuf's wording.
  static std::optional<std::string> UnknownFieldOf(const std::string& message) {
    static constexpr std::string_view kPrefix = "Message type \"";
    if (message.rfind(kPrefix, 0) != 0 || message.find("has no field named") == std::string::npos)
      return std::nullopt;
    size_t end = message.find('"', kPrefix.size());
    if (end == std::string::npos) return std::nullopt;
    return message.substr(kPrefix.size(), end - kPrefix.size());
  }

  const std::string& path_;
  TextContext context_;
  std::vector<std::string> errors_;
};

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

std::string ReadFile(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"),
                                                       &std::fclose);
  if (!file) {
    Throw(ErrorCode::kNotFound, "cannot open config file {}: {}", path, std::strerror(errno));
  }
  std::string text;
  char buffer[1 << 16];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), file.get())) > 0) text.append(buffer, n);
  if (std::ferror(file.get())) {
    // e.g. EISDIR: fopen succeeds on a directory and only the read fails.
    Throw(ErrorCode::kNotFound, "cannot read config file {}: {}", path, std::strerror(errno));
  }
  return text;
}

// ---------------------------------------------------------------------------------------------
// Overrides.

// An applied override: the canonical path it set and its text as the user wrote it.
struct AppliedOverride {
  std::string path;
  std::string text;  // "--set train.pipeline_width=1"
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

  if (value == "auto" && field->containing_type() == config::Comm::descriptor() &&
      field->number() == config::Comm::kChunkBytesFieldNumber) {
    reflection->SetInt64(message, field, 0);  // the schema's spelling of auto
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

// ---------------------------------------------------------------------------------------------
// Defaults.

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

// ---------------------------------------------------------------------------------------------
// Validation: the ranges written next to each field in configs/pipesgd.proto.

struct IntRange {
  int64_t lo;
  std::optional<int64_t> hi;  // inclusive
  int64_t multiple_of = 1;
  const char* zero_means = nullptr;  // when set, 0 is also accepted and means this
};
struct RealRange {
  double lo;
  bool lo_inclusive;
  std::optional<double> hi_exclusive;  // the value must also be finite
  std::optional<double> hi_inclusive = std::nullopt;  // instead of hi_exclusive
};
struct NonEmpty {};
using Rule = std::variant<IntRange, RealRange, NonEmpty>;

template <typename M>
const FieldDescriptor* Field(int number) {
  const FieldDescriptor* field = M::descriptor()->FindFieldByNumber(number);
  PSGD_CHECK(field != nullptr);
  return field;
}

// Keyed by descriptor via the generated field numbers, so that renaming a field in the schema
// breaks this table at compile time instead of silently dropping its check.
const std::unordered_map<const FieldDescriptor*, Rule>& Rules() {
  using config::Comm;
  using config::Conv2d;
  using config::Data;
  using config::Dropout;
  using config::Linear;
  using config::MaxPool2d;
  using config::Model;
  using config::Train;
  static const std::unordered_map<const FieldDescriptor*, Rule> rules{
      {Field<Linear>(Linear::kOutFeaturesFieldNumber), IntRange{1, std::nullopt}},
      {Field<config::Model>(config::Model::kGpuIndexFieldNumber), IntRange{-1, 1023}},
      {Field<Conv2d>(Conv2d::kOutChannelsFieldNumber), IntRange{1, std::nullopt}},
      {Field<Conv2d>(Conv2d::kKernelSizeFieldNumber), IntRange{1, std::nullopt}},
      {Field<Conv2d>(Conv2d::kStrideFieldNumber), IntRange{1, std::nullopt}},
      {Field<Conv2d>(Conv2d::kPaddingFieldNumber), IntRange{0, std::nullopt}},
      {Field<MaxPool2d>(MaxPool2d::kKernelSizeFieldNumber), IntRange{1, std::nullopt}},
      {Field<MaxPool2d>(MaxPool2d::kStrideFieldNumber), IntRange{0, std::nullopt}},
      {Field<Dropout>(Dropout::kPFieldNumber), RealRange{0, true, 1.0}},
      {Field<Model>(Model::kInputChannelsFieldNumber), IntRange{1, std::nullopt}},
      {Field<Model>(Model::kInputHeightFieldNumber), IntRange{1, std::nullopt}},
      {Field<Model>(Model::kInputWidthFieldNumber), IntRange{1, std::nullopt}},
      {Field<Data>(Data::kTrainImagesFieldNumber), NonEmpty{}},
      {Field<Data>(Data::kTrainLabelsFieldNumber), NonEmpty{}},
      {Field<Data>(Data::kTestImagesFieldNumber), NonEmpty{}},
      {Field<Data>(Data::kTestLabelsFieldNumber), NonEmpty{}},
      {Field<Data>(Data::kTrainLimitFieldNumber), IntRange{0, std::nullopt}},
      {Field<Data>(Data::kTestLimitFieldNumber), IntRange{0, std::nullopt}},
      {Field<Data>(Data::kInputMeanFieldNumber), RealRange{-1000, true, 1000.0}},
      {Field<Data>(Data::kInputStdFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<Train>(Train::kBatchSizeFieldNumber), IntRange{1, std::nullopt}},
      {Field<Train>(Train::kLearningRateFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<Train>(Train::kMomentumFieldNumber), RealRange{0, true, 1.0}},
      {Field<Train>(Train::kWeightDecayFieldNumber), RealRange{0, true, std::nullopt}},
      {Field<Train>(Train::kEpochsFieldNumber), IntRange{1, std::nullopt}},
      {Field<Train>(Train::kPipelineWidthFieldNumber), IntRange{1, 16}},
      {Field<Train>(Train::kMaxStepsFieldNumber), IntRange{0, std::nullopt}},
      {Field<Train>(Train::kProgressPerEpochFieldNumber), IntRange{0, 1000}},
      {Field<Train>(Train::kSyncWarmupStepsFieldNumber), IntRange{0, std::nullopt}},
      {Field<Train>(Train::kEvalEveryStepsFieldNumber), IntRange{0, std::nullopt}},
      {Field<Train>(Train::kTargetAccuracyFieldNumber), RealRange{0, true, std::nullopt, 1.0}},
      {Field<Comm>(Comm::kChunkBytesFieldNumber), IntRange{1024, int64_t{1} << 30, 4, "auto"}},
      {Field<Comm>(Comm::kStartTimeoutSFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<Comm>(Comm::kTimeoutSFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<Comm>(Comm::kStreamsFieldNumber), IntRange{1, 16}},
      {Field<Comm>(Comm::kWarmupStepsFieldNumber), IntRange{0, std::nullopt}},
      {Field<Comm>(Comm::kMinBytesFieldNumber), IntRange{0, std::nullopt}},
      {Field<Comm>(Comm::kPowersgdRankFieldNumber), IntRange{0, 64}},
      {Field<Comm>(Comm::kIbPortFieldNumber), IntRange{0, 255}},
      {Field<Comm>(Comm::kGidIndexFieldNumber), IntRange{-1, 255}},
      {Field<Comm>(Comm::kIbTimeoutFieldNumber), IntRange{1, 31}},
      {Field<Comm>(Comm::kIbRetryCountFieldNumber), IntRange{0, 7}},
      {Field<config::Checkpoint>(config::Checkpoint::kEveryStepsFieldNumber), IntRange{0, std::nullopt}},
      {Field<config::Checkpoint>(config::Checkpoint::kEveryEpochsFieldNumber), IntRange{0, std::nullopt}},
      {Field<config::Checkpoint>(config::Checkpoint::kKeepFieldNumber), IntRange{1, 1000}},
      {Field<config::Sdpipe>(config::Sdpipe::kPeriodFieldNumber), IntRange{1, 1000000}},
      {Field<config::Sdpipe>(config::Sdpipe::kWindowMinSFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<config::Sdpipe>(config::Sdpipe::kWindowMaxSFieldNumber), RealRange{0, false, 3600.0}},
      {Field<config::Sdpipe>(config::Sdpipe::kWindowInitSFieldNumber), RealRange{0, false, 3600.0}},
      {Field<config::Sdpipe>(config::Sdpipe::kWindowGrowFieldNumber), RealRange{1, true, std::nullopt}},
      {Field<config::Sdpipe>(config::Sdpipe::kWindowShrinkFieldNumber), RealRange{0, false, std::nullopt}},
      {Field<config::Sdpipe>(config::Sdpipe::kMinGroupFieldNumber), IntRange{1, std::nullopt}},
      {Field<config::Pipeline>(config::Pipeline::kStagesFieldNumber), IntRange{1, 64}},
      {Field<config::Pipeline>(config::Pipeline::kBoundariesFieldNumber), IntRange{1, std::nullopt}},
      {Field<config::Pipeline>(config::Pipeline::kMicroBatchesFieldNumber), IntRange{1, 1024}},
      {Field<config::Straggler>(config::Straggler::kRanksFieldNumber), IntRange{0, std::nullopt}},
      {Field<config::Straggler>(config::Straggler::kSleepSFieldNumber), RealRange{0, true, 60.0}},
      {Field<config::Straggler>(config::Straggler::kProbabilityFieldNumber), RealRange{0, true, std::nullopt}},
      // seed: any uint64; transport: the parser admits only declared enum values.
  };
  return rules;
}

std::string Describe(const IntRange& rule) {
  if (rule.multiple_of != 1) {
    return fmt::format("expected {}a multiple of {} in [{}, {}]",
                       rule.zero_means ? fmt::format("0 ({}) or ", rule.zero_means) : "",
                       rule.multiple_of, rule.lo,
                       rule.hi.value_or(std::numeric_limits<int64_t>::max()));
  }
  if (rule.hi) return fmt::format("expected an integer in [{}, {}]", rule.lo, *rule.hi);
  return fmt::format("expected an integer >= {}", rule.lo);
}

std::string Describe(const RealRange& rule) {
  if (rule.hi_inclusive) {
    return fmt::format("expected a number in {}{}, {}]", rule.lo_inclusive ? '[' : '(', rule.lo,
                       *rule.hi_inclusive);
  }
  if (rule.hi_exclusive) {
    return fmt::format("expected a number in {}{}, {})", rule.lo_inclusive ? '[' : '(', rule.lo,
                       *rule.hi_exclusive);
  }
  return fmt::format("expected a finite number {} {}", rule.lo_inclusive ? ">=" : ">", rule.lo);
}

class Validator {
 public:
  Validator(const std::string& file, const TextFormat::ParseInfoTree* tree,
            const std::vector<AppliedOverride>& overrides, const std::set<std::string>& filled)
      : file_(file), tree_(tree), overrides_(overrides), filled_(filled) {}

  void Run(const config::Job& job) {
    std::vector<Step> steps;
    Visit(job, &steps);
    CheckPipeline(job);
    CheckCompensation(job);
    CheckPowerSgd(job);
    if (!errors_.empty()) {
      Throw(ErrorCode::kInvalidArgument, "{}", fmt::join(errors_, "\n"));
    }
  }

 private:
  void Visit(const Message& message, std::vector<Step>* steps) {
    const Descriptor* type = message.GetDescriptor();
    if (type == config::Model::descriptor()) {
      CheckModel(static_cast<const config::Model&>(message), steps);
    } else if (type == config::Layer::descriptor()) {
      CheckLayer(static_cast<const config::Layer&>(message), steps);
    } else if (type == config::Comm::descriptor()) {
      CheckComm(static_cast<const config::Comm&>(message), steps);
    } else if (type == config::Sdpipe::descriptor()) {
      CheckSdpipe(static_cast<const config::Sdpipe&>(message), steps);
    } else if (type == config::Straggler::descriptor()) {
      const auto& st = static_cast<const config::Straggler&>(message);
      if (st.probability() > 1) {
        steps->push_back({Field<config::Straggler>(config::Straggler::kProbabilityFieldNumber), -1});
        Report(*steps, fmt::format("{} = {}: expected a probability in [0, 1]",
                                   PathString(*steps), st.probability()));
        steps->pop_back();
      }
    }

    const Reflection* reflection = message.GetReflection();
    for (int i = 0; i < type->field_count(); ++i) {
      const FieldDescriptor* field = type->field(i);
      if (field->is_repeated()) {
        for (int j = 0; j < reflection->FieldSize(message, field); ++j) {
          steps->push_back({field, j});
          if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
            Visit(reflection->GetRepeatedMessage(message, field, j), steps);
          } else {
            CheckScalar(message, field, j, *steps);
          }
          steps->pop_back();
        }
        continue;
      }
      if (field->real_containing_oneof() != nullptr && !reflection->HasField(message, field)) {
        continue;
      }
      steps->push_back({field, -1});
      if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        Visit(reflection->GetMessage(message, field), steps);
      } else {
        CheckScalar(message, field, -1, *steps);
      }
      steps->pop_back();
    }
  }

  // model.kernels: a library of the model's device that this build has.
  void CheckKernels(const config::Model& model, std::vector<Step>* steps) {
    const config::Model::Kernels k = model.kernels();
    if (k == config::Model::AUTO) return;
    const bool cpu_library = k == config::Model::ONEDNN || k == config::Model::OPENBLAS;
    const bool on_cpu = model.device() == config::Model::CPU;
    std::string problem;
    if (cpu_library != on_cpu) {
      problem = fmt::format("a {} library, but model.device is {}; expected {} or AUTO",
                            cpu_library ? "CPU" : "GPU", config::Model::Device_Name(model.device()),
                            on_cpu ? "ONEDNN, OPENBLAS" : "CUDNN, CUBLAS");
    } else if (k == config::Model::ONEDNN && !layers::HaveOneDnn()) {
      problem = "this pipesgd was built without oneDNN (no libdnnl-dev at build time, or "
                "-DPIPESGD_WITH_ONEDNN=OFF); use AUTO or OPENBLAS, or rebuild with libdnnl-dev";
    } else if (k == config::Model::CUDNN && !CudnnBuilt()) {
      problem = "this pipesgd was built without cuDNN (no cudnn.h in the CUDA toolkit at build "
                "time); use AUTO or CUBLAS";
    }
    if (problem.empty()) return;
    steps->push_back({Field<config::Model>(config::Model::kKernelsFieldNumber), -1});
    Report(*steps, fmt::format("{} = {}: {}", PathString(*steps), config::Model::Kernels_Name(k),
                               problem));
    steps->pop_back();
  }

  void CheckModel(const config::Model& model, std::vector<Step>* steps) {
    if (model.layers_size() == 0) {
      steps->push_back({Field<config::Model>(config::Model::kLayersFieldNumber), -1});
      // A repeated field has no location of its own; the model block is the nearest.
      Report(*steps, fmt::format("{} = []: expected at least one layer, the last one linear",
                                 PathString(*steps)));
      steps->pop_back();
      return;
    }
    if (model.device() == config::Model::CUDA && !CudaBackendBuilt()) {
      steps->push_back({Field<config::Model>(config::Model::kDeviceFieldNumber), -1});
      Report(*steps, fmt::format("{} = CUDA: this pipesgd was built without the CUDA backend (no "
                                 "CUDA toolkit at build time, or -DPIPESGD_CUDA=OFF); use CPU or "
                                 "rebuild with the CUDA toolkit (docs/gpu.md)",
                                 PathString(*steps)));
      steps->pop_back();
    }
    CheckKernels(model, steps);
    if (model.gpu_index() != -1 && model.device() != config::Model::CUDA) {
      steps->push_back({Field<config::Model>(config::Model::kGpuIndexFieldNumber), -1});
      Report(*steps, fmt::format("{} = {}: applies only to model.device: CUDA (device is {})",
                                 PathString(*steps), model.gpu_index(),
                                 config::Model::Device_Name(model.device())));
      steps->pop_back();
    }
    const int last = model.layers_size() - 1;
    const config::Layer& layer = model.layers(last);
    if (layer.kind_case() != config::Layer::KIND_NOT_SET && !layer.has_linear()) {
      steps->push_back({Field<config::Model>(config::Model::kLayersFieldNumber), last});
      Report(*steps, fmt::format("{} = {{ {} }}: expected the last layer to be linear (its "
                                 "out_features is the number of classes)",
                                 PathString(*steps), layer.ShortDebugString()));
      steps->pop_back();
    }
    CheckShapes(model, steps);
  }

  // Follows the activation shape (channels x height x width) through the layers, as
  // layers::Model will, and reports the first layer that cannot take its input. Stops quietly at
  // a layer whose own values are out of range (CheckScalar reports those).
  void CheckShapes(const config::Model& model, std::vector<Step>* steps) {
    struct Shape {
      int64_t c, h, w;
    };
    auto text = [](const Shape& s) { return fmt::format("{}x{}x{}", s.c, s.h, s.w); };
    if (model.input_channels() < 1 || model.input_height() < 1 || model.input_width() < 1) return;
    Shape shape{model.input_channels(), model.input_height(), model.input_width()};
    // Per-sample activations stay within int32 (BLAS dimensions, argmax indices); that also
    // keeps every product below from overflowing.
    constexpr int64_t kMaxFloats = INT32_MAX;
    auto too_big = [&](const Shape& s) {
      return s.c > kMaxFloats || s.h > kMaxFloats || s.w > kMaxFloats ||
             s.c * s.h > kMaxFloats || s.c * s.h * s.w > kMaxFloats;
    };
    if (too_big(shape)) {
      steps->push_back({Field<config::Model>(config::Model::kInputChannelsFieldNumber), -1});
      Report(*steps, fmt::format("model input {} is {} floats per sample: expected at most {}",
                                 text(shape), static_cast<double>(shape.c) * shape.h * shape.w,
                                 kMaxFloats));
      steps->pop_back();
      return;
    }
    const FieldDescriptor* layers_field = Field<config::Model>(config::Model::kLayersFieldNumber);
    for (int i = 0; i < model.layers_size(); i++) {
      const config::Layer& layer = model.layers(i);
      const std::string from =
          i == 0 ? fmt::format("the model input {}", text(shape))
                 : fmt::format("{} from model.layers[{}]", text(shape), i - 1);
      // Reports `what` at field `number` of the layer's `kind` message.
      auto report = [&](int kind, const FieldDescriptor* field, const std::string& what) {
        steps->push_back({layers_field, i});
        steps->push_back({Field<config::Layer>(kind), -1});
        steps->push_back({field, -1});
        Report(*steps, fmt::format("{} = {}", PathString(*steps), what));
        steps->pop_back();
        steps->pop_back();
        steps->pop_back();
      };
      Shape next = shape;
      switch (layer.kind_case()) {
        case config::Layer::kLinear: {
          if (layer.linear().out_features() < 1) return;
          next = {layer.linear().out_features(), 1, 1};
          break;
        }
        case config::Layer::kConv2D: {
          const config::Conv2d& conv = layer.conv2d();
          if (conv.out_channels() < 1 || conv.kernel_size() < 1 || conv.stride() < 1 ||
              conv.padding() < 0) {
            return;
          }
          const int64_t k = conv.kernel_size(), p = conv.padding();
          if (k > shape.h + 2 * p || k > shape.w + 2 * p) {
            report(config::Layer::kConv2DFieldNumber,
                   Field<config::Conv2d>(config::Conv2d::kKernelSizeFieldNumber),
                   fmt::format("{}: expected at most {}, the padded height and width of its "
                               "input ({} with padding {} on each side)",
                               k, std::min(shape.h, shape.w) + 2 * p, from, p));
            return;
          }
          next = {conv.out_channels(), (shape.h + 2 * p - k) / conv.stride() + 1,
                  (shape.w + 2 * p - k) / conv.stride() + 1};
          break;
        }
        case config::Layer::kMaxPool2D: {
          const config::MaxPool2d& pool = layer.max_pool2d();
          if (pool.kernel_size() < 1 || pool.stride() < 0) return;
          const int64_t k = pool.kernel_size();
          const int64_t stride = pool.stride() == 0 ? k : pool.stride();
          if (k > shape.h || k > shape.w) {
            report(config::Layer::kMaxPool2DFieldNumber,
                   Field<config::MaxPool2d>(config::MaxPool2d::kKernelSizeFieldNumber),
                   fmt::format("{}: expected at most {}, the height and width of its input ({})",
                               k, std::min(shape.h, shape.w), from));
            return;
          }
          next = {shape.c, (shape.h - k) / stride + 1, (shape.w - k) / stride + 1};
          break;
        }
        case config::Layer::kFlatten:
          next = {shape.c * shape.h * shape.w, 1, 1};
          break;
        case config::Layer::kRelu:
        case config::Layer::kDropout:
          break;
        default:
          return;  // no kind: CheckLayer reports it
      }
      if (too_big(next)) {
        steps->push_back({layers_field, i});
        Report(*steps, fmt::format("{} = {{ {} }} outputs {}, {} floats per sample: expected at "
                                   "most {}",
                                   PathString(*steps), layer.ShortDebugString(), text(next),
                                   static_cast<double>(next.c) * next.h * next.w, kMaxFloats));
        steps->pop_back();
        return;
      }
      shape = next;
    }
  }

  // A rounding option that the chosen codec does not use is a mistake, not a no-op.
  void CheckComm(const config::Comm& comm, std::vector<Step>* steps) {
    auto check = [&](int number, bool set, std::initializer_list<config::Comm::Compression> needs) {
      if (!set || std::find(needs.begin(), needs.end(), comm.compression()) != needs.end()) return;
      std::vector<std::string> names;
      for (auto n : needs) names.push_back(config::Comm::Compression_Name(n));
      steps->push_back({Field<config::Comm>(number), -1});
      Report(*steps, fmt::format("{} = true: applies only to compression: {} (compression is {})",
                                 PathString(*steps), fmt::join(names, " or "),
                                 config::Comm::Compression_Name(comm.compression())));
      steps->pop_back();
    };
    check(config::Comm::kRoundToNearestEvenFieldNumber, comm.round_to_nearest_even(),
          {config::Comm::trunc16});
    check(config::Comm::kStochasticRoundingFieldNumber, comm.stochastic_rounding(),
          {config::Comm::q8, config::Comm::q4});
    if (!comm.network_interface().empty()) {
      steps->push_back({Field<config::Comm>(config::Comm::kNetworkInterfaceFieldNumber), -1});
      try {
        transport::ParseIfnameFilter(comm.network_interface(), PathString(*steps));
      } catch (const Error& e) {
        Report(*steps, e.what());
      }
      steps->pop_back();
    }
  }

  // The pipeline's fields against the model, the batch and the mode (each alone is checked by
  // its rule). The world size is checked when the job starts (it must be a multiple of stages).
  void CheckCompensation(const config::Job& job) {
    const config::Train& train = job.train();
    if (train.staleness_compensation() == config::NONE || train.pipeline_width() < 2 ||
        job.model().device() != config::Model::CUDA) {
      return;
    }
    std::vector<Step> steps{{Field<config::Job>(config::Job::kTrainFieldNumber), -1},
                            {Field<config::Train>(config::Train::kStalenessCompensationFieldNumber), -1}};
    Report(steps, fmt::format("{} = {}: not implemented with model.device = CUDA (the weight "
                              "prediction runs on host parameters); use NONE",
                              PathString(steps),
                              config::StalenessCompensation_Name(train.staleness_compensation())));
  }

  // PowerSGD replaces the ring's codec and needs what only the RING trainer on the CPU has.
  void CheckPowerSgd(const config::Job& job) {
    const int rank = job.comm().powersgd_rank();
    if (rank <= 0) return;
    std::vector<Step> steps{{Field<config::Job>(config::Job::kCommFieldNumber), -1},
                            {Field<config::Comm>(config::Comm::kPowersgdRankFieldNumber), -1}};
    const std::string path = PathString(steps);
    auto refuse = [&](const std::string& why) {
      Report(steps, fmt::format("{} = {}: {}", path, rank, why));
    };
    if (job.comm().compression() != config::Comm::none) {
      refuse(fmt::format("PowerSGD replaces the codec; set comm.compression = none (it is {})",
                         config::Comm::Compression_Name(job.comm().compression())));
    }
    if (job.train().mode() != config::RING) {
      refuse(fmt::format("implemented for train.mode = RING only (it is {})",
                         config::TrainMode_Name(job.train().mode())));
    }
    if (job.pipeline().stages() > 1) refuse("not implemented with pipeline stages");
    if (job.model().device() == config::Model::CUDA) {
      refuse("not implemented with model.device = CUDA");
    }
    if (!job.checkpoint().dir().empty()) {
      refuse("not implemented with checkpoints (checkpoint.dir is set): the residual and the "
             "warm-start factors are not saved");
    }
  }

  void CheckPipeline(const config::Job& job) {
    if (!job.has_pipeline()) return;
    const config::Pipeline& pl = job.pipeline();
    std::vector<Step> steps{{Field<config::Job>(config::Job::kPipelineFieldNumber), -1}};
    auto report = [&](int number, int index, std::string what) {
      steps.push_back({Field<config::Pipeline>(number), index});
      Report(steps, fmt::format("{} {}", PathString(steps), what));
      steps.pop_back();
    };
    const int layers = job.model().layers_size();
    if (pl.stages() > 1 && job.train().mode() != config::SDPIPE) {
      report(config::Pipeline::kStagesFieldNumber, -1,
             fmt::format("= {}: pipeline stages need train.mode: SDPIPE (train.mode is {})",
                         pl.stages(), config::TrainMode_Name(job.train().mode())));
    }
    if (pl.stages() > layers && layers > 0) {
      report(config::Pipeline::kStagesFieldNumber, -1,
             fmt::format("= {}: expected at most the model's {} layers (each stage needs one)",
                         pl.stages(), layers));
    }
    if (pl.boundaries_size() > 0 && pl.boundaries_size() != pl.stages() - 1) {
      report(config::Pipeline::kBoundariesFieldNumber, -1,
             fmt::format("has {} values: expected stages - 1 = {} (or none: balanced by "
                         "parameter count)",
                         pl.boundaries_size(), pl.stages() - 1));
    } else {
      for (int i = 0; i < pl.boundaries_size(); ++i) {
        const int b = pl.boundaries(i);
        const int lo = i == 0 ? 1 : pl.boundaries(i - 1) + 1;
        if (b < lo || b >= layers) {
          report(config::Pipeline::kBoundariesFieldNumber, i,
                 fmt::format("= {}: expected a layer index in [{}, {}) (strictly ascending; the "
                             "model has {} layers)",
                             b, lo, layers, layers));
        }
      }
    }
    if (pl.micro_batches() >= 1 && job.train().batch_size() % pl.micro_batches() != 0) {
      report(config::Pipeline::kMicroBatchesFieldNumber, -1,
             fmt::format("= {}: train.batch_size = {} must be a multiple of it",
                         pl.micro_batches(), job.train().batch_size()));
    }
  }

  // The window's bounds must hold together (each alone is checked by its rule).
  void CheckSdpipe(const config::Sdpipe& sd, std::vector<Step>* steps) {
    auto report = [&](int number, std::string what) {
      steps->push_back({Field<config::Sdpipe>(number), -1});
      Report(*steps, fmt::format("{} {}", PathString(*steps), what));
      steps->pop_back();
    };
    if (sd.window_shrink() > 1) {
      report(config::Sdpipe::kWindowShrinkFieldNumber,
             fmt::format("= {}: expected a factor in (0, 1]", sd.window_shrink()));
    }
    if (sd.window_max_s() < sd.window_min_s()) {
      report(config::Sdpipe::kWindowMaxSFieldNumber,
             fmt::format("= {}: expected >= sdpipe.window_min_s = {}", sd.window_max_s(),
                         sd.window_min_s()));
    } else if (sd.window_init_s() < sd.window_min_s() || sd.window_init_s() > sd.window_max_s()) {
      report(config::Sdpipe::kWindowInitSFieldNumber,
             fmt::format("= {}: expected seconds in [window_min_s, window_max_s] = [{}, {}]",
                         sd.window_init_s(), sd.window_min_s(), sd.window_max_s()));
    }
  }

  void CheckLayer(const config::Layer& layer, std::vector<Step>* steps) {
    if (layer.kind_case() != config::Layer::KIND_NOT_SET) return;
    const pb::OneofDescriptor* kind = config::Layer::descriptor()->FindOneofByName("kind");
    std::string kinds;
    for (int i = 0; kind != nullptr && i < kind->field_count(); ++i) {
      const char* sep = i == 0 ? "" : i + 1 == kind->field_count() ? " or " : ", ";
      kinds += fmt::format("{}{}", sep, kind->field(i)->name());
    }
    Report(*steps, fmt::format("{} = {{}}: expected a layer kind ({})", PathString(*steps), kinds));
  }

  void CheckScalar(const Message& message, const FieldDescriptor* field, int index,
                   const std::vector<Step>& steps) {
    auto rule = Rules().find(field);
    if (rule == Rules().end()) return;
    const Reflection* r = message.GetReflection();
    std::string value;
    bool ok = true;
    std::string expected;
    if (const auto* range = std::get_if<IntRange>(&rule->second)) {
      int64_t v = 0;
      switch (field->cpp_type()) {
        case FieldDescriptor::CPPTYPE_INT32:
          v = index < 0 ? r->GetInt32(message, field) : r->GetRepeatedInt32(message, field, index);
          break;
        case FieldDescriptor::CPPTYPE_INT64:
          v = index < 0 ? r->GetInt64(message, field) : r->GetRepeatedInt64(message, field, index);
          break;
        default:
          PSGD_CHECK(!"integer rule on a non-integer field");
      }
      value = fmt::format("{}", v);
      ok = (v == 0 && range->zero_means != nullptr) ||
           (v >= range->lo && (!range->hi || v <= *range->hi) && v % range->multiple_of == 0);
      expected = Describe(*range);
    } else if (const auto* real_range = std::get_if<RealRange>(&rule->second)) {
      double v = 0;
      switch (field->cpp_type()) {
        case FieldDescriptor::CPPTYPE_FLOAT: {
          float f = index < 0 ? r->GetFloat(message, field) : r->GetRepeatedFloat(message, field, index);
          value = fmt::format("{}", f);  // shortest float text: 0.05, not 0.0500000007
          v = f;
          break;
        }
        case FieldDescriptor::CPPTYPE_DOUBLE:
          v = index < 0 ? r->GetDouble(message, field) : r->GetRepeatedDouble(message, field, index);
          value = fmt::format("{}", v);
          break;
        default:
          PSGD_CHECK(!"real rule on a non-real field");
      }
      ok = std::isfinite(v) && (real_range->lo_inclusive ? v >= real_range->lo : v > real_range->lo) &&
           (!real_range->hi_exclusive || v < *real_range->hi_exclusive) &&
           (!real_range->hi_inclusive || v <= *real_range->hi_inclusive);
      expected = Describe(*real_range);
    } else {
      std::string scratch;
      const std::string& v = index < 0 ? r->GetStringReference(message, field, &scratch)
                                       : r->GetRepeatedStringReference(message, field, index, &scratch);
      value = fmt::format("\"{}\"", pb::CEscape(v));
      ok = !v.empty();
      expected = "expected a non-empty path";
    }
    if (ok) return;
    const std::string path = PathString(steps);
    if (filled_.count(path) != 0) {
      Report(steps, fmt::format("{} is not set: {}", path, expected));
    } else {
      Report(steps, fmt::format("{} = {}: {}", path, value, expected));
    }
  }

  // Prefixes `what` with where the value came from: the last override that set it or a
  // message around it, else its line in the file (or that of the nearest enclosing block, for
  // a value filled from a default), else just the file.
  void Report(const std::vector<Step>& steps, const std::string& what) {
    const std::string path = PathString(steps);
    for (auto it = overrides_.rbegin(); it != overrides_.rend(); ++it) {
      if (PathsOverlap(it->path, path)) {
        errors_.push_back(fmt::format("{}: {}", it->text, what));
        return;
      }
    }
    TextFormat::ParseLocation found;
    const TextFormat::ParseInfoTree* tree = tree_;
    for (const Step& step : steps) {
      // An unindexed repeated field (model.layers when empty) has no location of its own.
      if (tree == nullptr || (step.field->is_repeated() && step.index < 0)) break;
      TextFormat::ParseLocation here = tree->GetLocation(step.field, step.index);
      if (here.line >= 0) found = here;
      tree = step.field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE
                 ? tree->GetTreeForNested(step.field, step.index)
                 : nullptr;
    }
    if (found.line < 0) {
      errors_.push_back(fmt::format("{}: {}", file_, what));
    } else {
      errors_.push_back(
          fmt::format("{}:{}:{}: {}", file_, found.line + 1, found.column + 1, what));
    }
  }

  const std::string& file_;
  const TextFormat::ParseInfoTree* tree_;
  const std::vector<AppliedOverride>& overrides_;
  const std::set<std::string>& filled_;
  std::vector<std::string> errors_;
};

std::set<std::string> FillDefaults(Message* message) {
  std::vector<Step> steps;
  std::set<std::string> filled;
  std::vector<const Descriptor*> open;
  FillDefaults(message, &steps, &filled, &open);
  return filled;
}

}  // namespace

config::Job LoadJobConfig(const std::string& path, const std::vector<std::string>& overrides) {
  return ParseJobConfig(ReadFile(path), path, overrides);
}

config::Job ParseJobConfig(const std::string& text, const std::string& path,
                           const std::vector<std::string>& overrides) {
  config::Job job;
  TextFormat::ParseInfoTree tree;
  FileErrorCollector errors(path, text);
  TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  parser.WriteLocationsTo(&tree);
  // Unknown fields stay errors (the parser's default): a misspelt field would otherwise
  // silently run with the default.
  if (!parser.ParseFromString(text, &job)) {
    Throw(ErrorCode::kInvalidArgument, "{}", errors.Joined());
  }

  std::vector<AppliedOverride> applied;
  for (const std::string& spec : overrides) applied.push_back(ApplyOverride(&job, spec));

  // The staleness compensation's default depends on the device: the weight prediction runs on
  // host parameters only, so a GPU job that does not ask for one runs the plain recurrence.
  if (!job.train().has_staleness_compensation() && job.model().device() == config::Model::CUDA) {
    job.mutable_train()->set_staleness_compensation(config::NONE);
  }
  const std::set<std::string> filled = FillDefaults(&job);
  Validator(path, &tree, applied, filled).Run(job);
  return job;
}

std::string TransportEnumName(const std::string& name) {
  auto lower = [](std::string text) {
    for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return text;
  };
  const pb::EnumDescriptor* type = config::Transport_descriptor();
  for (int i = 0; i < type->value_count(); ++i) {
    if (lower(type->value(i)->name()) == lower(name)) return type->value(i)->name();
  }
  return name;
}

std::string FormatConfig(const config::Job& job, bool single_line) {
  // Fill a copy so that any Job prints every value it would run with.
  config::Job filled = job;
  FillDefaults(&filled);
  std::string out;
  TextFormat::Printer printer;
  printer.SetSingleLineMode(single_line);
  if (!printer.PrintToString(filled, &out)) {
    Throw(ErrorCode::kInternal, "cannot print the job configuration as text");
  }
  return out;
}

}  // namespace pipesgd::launcher
