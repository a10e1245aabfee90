// Logging through spdlog. Info lines print bare (they are the user-facing progress and metrics);
// warnings and errors carry "warning: " / "error: ". `pipesgd run` prefixes every worker line
// with "[rank R] ", so workers do not print their rank themselves.
#pragma once

#include <string>

#include <spdlog/spdlog.h>

namespace pipesgd {

// Installs the pipesgd logger as spdlog's default: info/debug to stdout, warnings/errors to
// stderr, flushed at every line so the launcher sees progress live. Safe to call more than once. `verbose` enables debug lines.
void InitLogging(bool verbose = false);

// Starts every later log line with `prefix` (before "warning: "): "# " makes a benchmark's log
// lines comments among its table, as nccl-tests prints them. Default: none.
void SetLogLinePrefix(std::string prefix);

}  // namespace pipesgd

#define PSGD_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define PSGD_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define PSGD_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define PSGD_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
