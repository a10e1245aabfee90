// The parts of core/job/config.cc's job (text -> validated config::Job), one file each:
//   config_text.cc       reading the file, parse errors that name the field and the line
//   config_overrides.cc  --set PATH=VALUE
//   config_defaults.cc   every unset value filled with its declared default
//   config_validate.cc   the ranges and cross-field rules of configs/pipesgd.proto
// and what they share: paths of fields, spelt as the user spells an override.
#pragma once

#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>

#include "configs/pipesgd.pb.h"

namespace pipesgd::job::config_detail {

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
std::string PathString(const std::vector<Step>& steps);

// True when one path lies inside the other ("train" and "train.batch_size", "model.layers[1]"
// and "model.layers[1].relu"), but not for siblings that merely share a prefix ("layers[1]" and
// "layers[10]").
bool PathsOverlap(std::string_view a, std::string_view b);

// "a, b, c": the field names of a message type, for "expected one of" messages.
std::string FieldNames(const Descriptor* type);

// config_text.cc: the file's bytes (Error kNotFound naming the path and errno's text).
std::string ReadFile(const std::string& path);
// config_text.cc: parses `text` into *job, with every field's location in *tree. Throws
// Error(kInvalidArgument) with one line per error: file:line:column, the field and what was
// expected.
void ParseText(const std::string& text, const std::string& path, config::Job* job,
               TextFormat::ParseInfoTree* tree);

// config_overrides.cc: what a value of `field` may be ("an integer", "one of A, B", ...).
std::string ExpectedValue(const FieldDescriptor* field);
// An applied override: the canonical path it set and its text as the user wrote it.
struct AppliedOverride {
  std::string path;
  std::string text;  // "--set train.pipeline_width=1"
};
// Applies "PATH=VALUE" to *job. Throws Error(kInvalidArgument) naming the path or the value.
AppliedOverride ApplyOverride(config::Job* job, const std::string& spec);

// config_defaults.cc: sets every unset singular scalar to its declared default and creates the
// singular sub-messages; returns the paths it filled.
std::set<std::string> FillDefaults(Message* message);

// config_validate.cc: checks every range and cross-field rule; throws Error(kInvalidArgument)
// with one line per problem, each naming where the value came from (file:line, an override,
// or the default).
void Validate(const config::Job& job, const std::string& file,
              const TextFormat::ParseInfoTree* tree,
              const std::vector<AppliedOverride>& overrides, const std::set<std::string>& filled);

}  // namespace pipesgd::job::config_detail
