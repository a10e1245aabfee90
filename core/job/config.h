// Loading a job configuration: protobuf text format (configs/pipesgd.proto), command-line
// overrides, defaults and range checks. The only place that reads a config file.
#pragma once

#include <string>
#include <vector>

#include "configs/pipesgd.pb.h"

namespace pipesgd::job {

// Parses the text-format file at `path`, applies `overrides` in order, fills every unset scalar
// field with its schema default, and validates every value against the ranges documented in
// configs/pipesgd.proto.
//
// Each override is "PATH=VALUE", PATH a dotted field path from the Job root, with [i] to index a
// repeated field (e.g. "train.pipeline_width=1", "model.layers[0].linear.out_features=64"); VALUE
// is parsed as protobuf text for that field (numbers, enum names, quoted or bare strings).
//
// Throws pipesgd::Error:
//  - kNotFound: the file cannot be read (naming the path and the OS error).
//  - kInvalidArgument: a syntax error, unknown field or type error ("PATH:LINE:COLUMN: ...");
//    a value out of range ("PATH:LINE:COLUMN: train.pipeline_width = 0: expected an integer in
//    [1, 16]"); a bad override ("--set train.pipeline_widht=1: no field 'pipeline_widht' in
//    pipesgd.config.Train (fields: batch_size, ...)"); an out-of-range override value names the
//    override instead of a line.
config::Job LoadJobConfig(const std::string& path, const std::vector<std::string>& overrides);
// The same for config text already in memory; `path` only names it in messages.
config::Job ParseJobConfig(const std::string& text, const std::string& path,
                           const std::vector<std::string>& overrides);

// The job of a command that runs only collectives (`pipesgd bench allreduce`): the schema's
// defaults, a placeholder model and data that nothing loads, and `overrides` ("comm.PATH=VALUE",
// as --set takes them), checked by the same rules as a job's. Throws Error(kInvalidArgument)
// naming the override: one outside comm, or any error ParseJobConfig would name.
config::Job CollectiveJobConfig(const std::vector<std::string>& overrides);

// The schema's spelling of a comm.transport value, matched without regard to case ("tcp" ->
// "TCP"), for `pipesgd run --transport`; `name` unchanged when no value matches (loading the
// config then fails listing the valid values).
std::string TransportEnumName(const std::string& name);

// The effective configuration as protobuf text, every field present (defaults included), for
// printing at start and for comparing ranks. `single_line` prints it on one line.
std::string FormatConfig(const config::Job& job, bool single_line = false);

}  // namespace pipesgd::job
