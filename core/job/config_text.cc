// Reading a config file and parse errors that name the field: core/job/config_detail.h.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include "core/base/error.h"
#include "core/job/config_detail.h"

namespace pipesgd::job::config_detail {
namespace {

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

}  // namespace

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

void ParseText(const std::string& text, const std::string& path, config::Job* job,
               TextFormat::ParseInfoTree* tree) {
  FileErrorCollector errors(path, text);
  TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  parser.WriteLocationsTo(tree);
  // Unknown fields stay errors (the parser's default): a misspelt field would otherwise
  // silently run with the default.
  if (!parser.ParseFromString(text, job)) {
    Throw(ErrorCode::kInvalidArgument, "{}", errors.Joined());
  }
}

}  // namespace pipesgd::job::config_detail
