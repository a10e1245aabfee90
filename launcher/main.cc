// pipesgd: pipelined data-parallel SGD over a ring AllReduce.
//   pipesgd run -np 4 configs/fashion_mnist_mlp.pbtxt [--set key=value]... [--out DIR]
//   pipesgd run -H lab0:1,lab1:1 -np 2 CONFIG   (ranks over ssh; or --hostfile FILE)
//   pipesgd run -np 4 -- PROGRAM ARGS...         (any program, torchrun-style environment)
//   pipesgd worker CONFIG      (one rank; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from env)
//   pipesgd bench allreduce --np 4 [--transport tcp|ucx|ibverbs|auto] ...
//   pipesgd info               (transports, RDMA devices, GPUDirect, BLAS, convolution kernels)
#include <algorithm>
#include <cstdio>
#include <new>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/base/error.h"
#include "core/job/worker.h"
#include "launcher/commands.h"
#include "transport/launch_env.h"

namespace {

// What CLI11 cannot take as given: `-np`, `run ... -- PROGRAM`, and `bench allreduce -c`
// without a count. Returns the arguments to parse, or an exit status for a usage error.
std::variant<std::vector<std::string>, int> RewriteArgv(std::vector<std::string> args,
                                                        std::vector<std::string>* program) {
  // `pipesgd run [options] -- PROGRAM ARGS...`: what follows "--" is the program's, untouched.
  if (args.size() > 1 && args[1] == "run") {
    if (auto dashes = std::find(args.begin() + 2, args.end(), "--"); dashes != args.end()) {
      program->assign(dashes + 1, args.end());
      args.erase(dashes, args.end());
      if (program->empty()) {
        std::fprintf(stderr, "error: run: nothing after --; expected a program to run on every "
                             "rank (pipesgd run -np 4 -- ./my_program ARGS...)\n");
        return 2;
      }
    }
  }
  // mpirun and horovodrun spell it -np; CLI11 only takes single-letter short options.
  for (auto& a : args) {
    if (a == "-np") a = "--np";
  }
  // `bench allreduce -c` alone, as pipesgd once took it: -c 1 (all_reduce_perf's -c takes a
  // count). A count is joined to the flag, so that "-c -1" reaches the range check as a value.
  if (args.size() > 1 && args[1] == "bench") {
    for (size_t i = 2; i < args.size(); ++i) {
      if (args[i] != "-c" && args[i] != "--check") continue;
      const std::string next = i + 1 < args.size() ? args[i + 1] : "";
      const std::string digits = !next.empty() && next[0] == '-' ? next.substr(1) : next;
      if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos) {
        args[i] = "--check=" + next;
        args.erase(args.begin() + static_cast<long>(i) + 1);
      } else {
        args[i] = "--check=1";
      }
    }
  }
  return args;
}

// The exit status of an error: 1, or kExitBecauseOfAnotherRank for a worker whose error names
// another rank (so that `pipesgd run` reports that rank).
int ExitStatusOf(const pipesgd::Error& e, bool worker) {
  if (!worker || e.culprit() < 0) return 1;
  int rank = -1;  // from the same environment the worker read (RANK, SLURM_PROCID, ...)
  try {
    const auto launch = pipesgd::transport::ReadLaunchEnv();
    if (launch.launcher != pipesgd::transport::Launcher::kNone) rank = launch.rank;
  } catch (const pipesgd::Error&) {
  }
  return rank >= 0 && e.culprit() != rank ? pipesgd::job::kExitBecauseOfAnotherRank : 1;
}

}  // namespace

int main(int argc, char** argv) {
  namespace cli = pipesgd::launcher;
  cli::CommandLine line{{argv, argv + argc}, {}};
  auto rewritten = RewriteArgv(line.argv, &line.program);
  if (const int* status = std::get_if<int>(&rewritten)) return *status;
  std::vector<std::string>& args = std::get<std::vector<std::string>>(rewritten);
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());

  CLI::App app{
      "pipesgd: data-parallel training with pipelined SGD (Pipe-SGD) over a ring AllReduce.\n"
      "Quick start: pipesgd run -np 4 configs/fashion_mnist_mlp.pbtxt"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "pipesgd " PIPESGD_VERSION);

  std::vector<cli::Command> commands = {
      cli::AddRunCommand(app, line),  cli::AddWorkerCommand(app), cli::AddBenchCommand(app),
      cli::AddProbeCommand(app),      cli::AddReportCommand(app), cli::AddModelCommand(app),
      cli::AddInfoCommand(app)};
  for (cli::Command& c : cli::AddRemoteCommands(app)) commands.push_back(std::move(c));
  const CLI::App* worker_cmd = commands[1].cli;  // AddWorkerCommand's

  app.footer("Exit status: 0 on success, 1 on an error (printed as 'error: ...'), 2 on a usage "
             "error; `run` exits with the failing worker's status.");
  // CLI11 reports an unknown subcommand as "a subcommand is required"; say what was wrong.
  const auto known = [&](const std::string& name) {
    try {
      return app.get_subcommand(name) != nullptr;
    } catch (const CLI::OptionNotFound&) {
      return false;
    }
  };
  if (args.size() > 1 && args[1][0] != '-' && !known(args[1])) {
    std::fprintf(stderr, "error: unknown subcommand '%s' (expected run, worker, bench, probe, model, report or info; "
                         "see pipesgd --help)\n", args[1].c_str());
    return 2;
  }
  try {
    app.parse(static_cast<int>(cargs.size()), cargs.data());
  } catch (const CLI::ParseError& e) {
    for (const cli::Command& c : commands) {
      if (!c.explain) continue;
      if (const std::optional<int> status = c.explain(e)) return *status;
    }
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;  // --help and --version exit 0; usage errors 2
  }

  try {
    for (const cli::Command& c : commands) {
      if (c.cli->parsed()) return c.run();
    }
    return 2;  // unreachable: a subcommand is required
  } catch (const pipesgd::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return ExitStatusOf(e, worker_cmd->parsed());
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: unexpected failure: %s\n", e.what());
    return 1;
  }
}
