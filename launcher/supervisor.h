// `pipesgd run -np N`: starts N local worker processes (this same binary, `worker`
// subcommand) with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, prefixes each
// output line with "[rank R] ", and supervises them: if any worker fails, the others are stopped
// (SIGTERM, then SIGKILL after a grace period) and the run exits non-zero naming the rank and its
// exit status. SIGINT/SIGTERM to the launcher stop every worker the same way.
#pragma once

#include <string>
#include <vector>

namespace pipesgd::launcher {

struct RunArgs {
  int num_processes = 1;
  std::string config_path;
  std::vector<std::string> overrides;
  std::string out_dir;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: pick a free port
  bool verbose = false;
  bool resume = false;  // workers continue from the newest checkpoint (--resume)
  double kill_grace_s = 5;  // between SIGTERM and SIGKILL when stopping workers
  // What each worker runs (arguments after the program name). Empty: `worker CONFIG --set ...
  // --out ...` from the fields above, with the config checked once before starting.
  std::vector<std::string> worker_command;
};

// Runs the job; returns the process exit code (0 when every worker succeeded). Throws
// pipesgd::Error for failures before any worker starts (bad config, cannot fork).
int RunLocal(const RunArgs& args);

}  // namespace pipesgd::launcher
