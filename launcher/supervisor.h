// `pipesgd run`: starts the ranks of a job and supervises them. One supervisor serves both
// launchers; they differ only in how a rank is started (RankCommand):
//  - local (`-np N`): this same binary's `worker` subcommand, with RANK, WORLD_SIZE, LOCAL_RANK,
//    MASTER_ADDR, MASTER_PORT and PIPESGD_JOB_TOKEN in its environment;
//  - over ssh (`-H` / `--hostfile`, launcher/ssh_launcher.h): an `ssh HOST pipesgd remote-rank`
//    per rank, whose stdin carries the job (config, environment, token) and whose end stops it.
// The supervisor prefixes each output line with "[rank R] " (or "[rank R HOST] "), optionally
// keeps per-rank files, and if any rank fails stops all the others and exits with the failing
// rank's status, naming it. SIGINT/SIGTERM/SIGHUP to the launcher stop every rank the same way.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "launcher/process.h"

namespace pipesgd::launcher {

struct RunArgs {
  int num_processes = 1;
  std::string config_path;
  std::vector<std::string> overrides;
  std::string out_dir;
  std::string master_addr = "127.0.0.1";
  // False: the launcher picks MASTER_ADDR (over ssh: the address rank 0's host was reached at).
  bool master_addr_given = false;
  int master_port = 0;  // 0: pick a free port
  bool verbose = false;
  bool resume = false;  // workers continue from the newest checkpoint (--resume)
  bool overwrite = false;  // --out may replace a finished run (--overwrite)
  // The launcher's own command line, recorded in summary.json (PIPESGD_COMMAND_LINE).
  std::string command_line;
  double kill_grace_s = 5;  // between SIGTERM and SIGKILL when stopping workers
  // Directory for per-rank output files (rank.R/stdout, rank.R/stderr, lines as the rank wrote
  // them, without prefix); empty: none.
  std::string output_dir;
  // Extra environment for every rank: "NAME" (the launcher's value) or "NAME=VALUE" (-x).
  std::vector<std::string> forward_env;
  // What each worker runs (arguments after the program name). Empty: `worker CONFIG --set ...
  // --out ...` from the fields above, with the config checked once before starting.
  std::vector<std::string> worker_command;
  bool prefix_stdout = true;  // as SuperviseOptions::prefix_stdout
  // Appended to every `worker` command line built from config_path (e.g. --timeline FILE).
  std::vector<std::string> extra_worker_args;
  // Non-empty: every rank runs this program (argv; argv[0] a path or a name on PATH) instead of
  // a pipesgd worker, with the same environment, supervision and teardown (`run -- PROGRAM`).
  std::vector<std::string> program;
};

// How one rank is started and stopped.
struct RankCommand {
  int rank = 0;
  std::string host;  // where it runs, for messages; empty: this machine
  ChildSpec spec;
  // Written to the child's stdin once it has started (spec.stdin_pipe must be set).
  std::string stdin_data;
};

struct SuperviseOptions {
  // Stop a rank by closing its stdin first (an ssh rank: the remote wrapper stops the worker's
  // process group and exits), SIGTERM after close_grace_s, SIGKILL after kill_grace_s more.
  // False: SIGTERM, then SIGKILL after kill_grace_s.
  bool stop_by_closing_stdin = false;
  double close_grace_s = 3;
  double kill_grace_s = 5;
  // Exit statuses come through ssh: 255 is ssh's own failure, 128+N a remote death by signal N.
  bool remote = false;
  bool host_in_prefix = false;  // "[rank R HOST] " instead of "[rank R] "
  // False: stdout lines pass unprefixed (a benchmark's table, read by nccl-tests parsers);
  // stderr lines keep the prefix.
  bool prefix_stdout = true;
  std::string output_dir;       // as RunArgs::output_dir
  // After the first rank fails on its own, how long to keep listening before stopping the
  // others, so that a rank killed by a signal is named rather than a neighbour that failed
  // because of it.
  double settle_s = 0.5;
};

// Starts every rank and supervises them to the end. Returns the process exit code: 0 when every
// rank succeeded, else the failing rank's status (128+N for a signal), 128+N when the launcher
// was stopped by signal N, 141 when its own stdout closed. Throws pipesgd::Error only before any
// rank is running (cannot create the output directory, cannot fork); ranks already started are
// stopped first.
int Supervise(std::vector<RankCommand> ranks, const SuperviseOptions& options);

// `pipesgd run -np N`: N local workers. Throws pipesgd::Error for failures before any worker
// starts (bad config, bad -x, cannot fork).
int RunLocal(const RunArgs& args);

// Resolves -x entries: "NAME" takes the launcher's value, "NAME=VALUE" the value given. Throws
// Error kInvalidArgument naming the entry: a bad name, an unset NAME, or a variable the launcher
// sets itself (RANK, WORLD_SIZE, ..., PIPESGD_JOB_TOKEN).
std::vector<std::pair<std::string, std::string>> ResolveForwardedEnv(
    const std::vector<std::string>& entries);

}  // namespace pipesgd::launcher
