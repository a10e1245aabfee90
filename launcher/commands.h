// The `pipesgd` subcommands, one function each: it adds the subcommand's options to the CLI and
// returns what runs once the command line parsed. main.cc only rewrites argv, parses, and maps
// errors to exit statuses.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace pipesgd::launcher {

struct Command {
  CLI::App* cli = nullptr;    // the subcommand
  std::function<int()> run;   // after a successful parse; returns the exit status
  // A usage error this command explains better than CLI11 (nullopt: CLI11's message).
  std::function<std::optional<int>(const CLI::ParseError&)> explain;
};

// What main took out of argv before CLI11 sees it.
struct CommandLine {
  std::vector<std::string> argv;     // as given, for summaries and messages
  std::vector<std::string> program;  // `pipesgd run ... -- PROGRAM ARGS...`: after the "--"
};

Command AddRunCommand(CLI::App& app, const CommandLine& line);  // cli_run.cc
Command AddWorkerCommand(CLI::App& app);                        // cli_run.cc
Command AddBenchCommand(CLI::App& app);                         // cli_bench.cc
Command AddProbeCommand(CLI::App& app);                         // cli_bench.cc
Command AddReportCommand(CLI::App& app);                        // cli_tools.cc
Command AddModelCommand(CLI::App& app);                         // cli_tools.cc
Command AddInfoCommand(CLI::App& app);                          // cli_tools.cc
// remote-rank and remote-probe: what `pipesgd run` starts over ssh (hidden from --help).
std::vector<Command> AddRemoteCommands(CLI::App& app);          // cli_tools.cc

// Shared by the commands (cli_run.cc).
extern const char* const kSetHelp;
// A finite number >= 0 (> 0 if `positive`). CLI11's own number checks let NaN through, which
// the model then took for "not given", and print their range with DBL_MAX written out in full.
CLI::Validator FiniteNumber(bool positive);
// --timeline-first-step: "auto" (the run's first steady step, resolved in the worker where the
// config is known: past train.sync_warmup_steps) or a step number >= 0.
CLI::Validator FirstStep();
int64_t FirstStepValue(const std::string& text);

}  // namespace pipesgd::launcher
