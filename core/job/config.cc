#include "core/job/config.h"

#include <cctype>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <google/protobuf/text_format.h>

#include "core/base/error.h"
#include "core/job/config_detail.h"

namespace pipesgd::job::config_detail {

std::string PathString(const std::vector<Step>& steps) {
  std::string out;
  for (const Step& step : steps) {
    if (!out.empty()) out += '.';
    out += step.field->name();
    if (step.index >= 0) out += fmt::format("[{}]", step.index);
  }
  return out;
}

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

}  // namespace pipesgd::job::config_detail

namespace pipesgd::job {

using namespace config_detail;  // NOLINT(google-build-using-namespace): this file's own parts

config::Job LoadJobConfig(const std::string& path, const std::vector<std::string>& overrides) {
  return ParseJobConfig(ReadFile(path), path, overrides);
}

config::Job ParseJobConfig(const std::string& text, const std::string& path,
                           const std::vector<std::string>& overrides) {
  config::Job job;
  TextFormat::ParseInfoTree tree;
  ParseText(text, path, &job, &tree);

  std::vector<AppliedOverride> applied;
  for (const std::string& spec : overrides) applied.push_back(ApplyOverride(&job, spec));

  // The staleness compensation's default depends on the device: the weight prediction runs on
  // host parameters only, so a GPU job that does not ask for one runs the plain recurrence.
  if (!job.train().has_staleness_compensation() && job.model().device() == config::Model::CUDA) {
    job.mutable_train()->set_staleness_compensation(config::NONE);
  }
  const std::set<std::string> filled = FillDefaults(&job);
  Validate(job, path, &tree, applied, filled);
  return job;
}

config::Job CollectiveJobConfig(const std::vector<std::string>& overrides) {
  for (const std::string& spec : overrides) {
    if (!spec.starts_with("comm.")) {
      Throw(ErrorCode::kInvalidArgument,
            "--set {}: only comm.* fields apply here (the collectives run with no model, data "
            "or training)",
            spec);
    }
  }
  // Placeholders that satisfy the job's rules; nothing reads them.
  static constexpr const char* kPlaceholder =
      "data { train_images: \"-\" train_labels: \"-\" test_images: \"-\" test_labels: \"-\" }\n"
      "model { layers { linear { out_features: 1 } } }\n";
  return ParseJobConfig(kPlaceholder, "(collectives)", overrides);
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

}  // namespace pipesgd::job
