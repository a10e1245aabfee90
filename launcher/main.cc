// pipesgd: pipelined data-parallel SGD over a ring AllReduce.
//   pipesgd run -np 4 configs/fashion_mnist_mlp.pbtxt [--set key=value]... [--out DIR]
//   pipesgd worker CONFIG      (one rank; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from env)
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/base/error.h"
#include "core/base/log.h"
#include "launcher/bench.h"
#include "launcher/supervisor.h"
#include "launcher/worker.h"

namespace {

constexpr const char* kSetHelp =
    "Override a config field by its path, e.g. --set train.pipeline_width=1 or "
    "--set model.layers[0].linear.out_features=512 (repeatable; applied in order)";

}  // namespace

int main(int argc, char** argv) {
  // mpirun and horovodrun spell it -np; CLI11 only takes single-letter short options.
  std::vector<std::string> args(argv, argv + argc);
  for (auto& a : args) {
    if (a == "-np") a = "--np";
  }
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());

  CLI::App app{
      "pipesgd: data-parallel training with pipelined SGD (Pipe-SGD) over a ring AllReduce.\n"
      "Quick start: pipesgd run -np 4 configs/fashion_mnist_mlp.pbtxt"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "pipesgd " PIPESGD_VERSION);

  pipesgd::launcher::RunArgs run;
  auto* run_cmd = app.add_subcommand(
      "run", "Start N local worker processes on this machine and supervise them");
  run_cmd->add_option("-n,--np", run.num_processes, "Number of worker processes (ranks)")
      ->required()
      ->check(CLI::Range(1, 1024));
  run_cmd->add_option("config", run.config_path, "Job config (protobuf text format)")
      ->required()
      ->check(CLI::ExistingFile);
  run_cmd->add_option("--set", run.overrides, kSetHelp)->allow_extra_args(false);
  run_cmd->add_option("--out", run.out_dir,
                      "Directory for metrics.jsonl (one line per epoch) and summary.json")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  run_cmd->add_option("--master-addr", run.master_addr,
                      "Address rank 0 listens on for the rendezvous")
      ->capture_default_str();
  run_cmd->add_option("--master-port", run.master_port,
                      "Rendezvous port (default: a free port)")
      ->check(CLI::Range(0, 65535));
  run_cmd->add_flag("-v,--verbose", run.verbose, "Debug logging in every worker");
  run_cmd->add_flag("--resume", run.resume,
                    "Continue from the newest checkpoint every rank has in checkpoint.dir");
  run_cmd->footer(
      "Each worker's output is prefixed with [rank R]. If any worker fails, the others are "
      "stopped and the run exits non-zero naming the rank.");

  pipesgd::launcher::WorkerArgs worker;
  auto* worker_cmd = app.add_subcommand(
      "worker",
      "Run one rank. Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment "
      "(as torchrun and Horovod set them); with neither RANK nor WORLD_SIZE set it runs alone");
  worker_cmd->add_option("config", worker.config_path, "Job config (protobuf text format)")
      ->required();
  worker_cmd->add_option("--set", worker.overrides, kSetHelp)->allow_extra_args(false);
  worker_cmd->add_option("--out", worker.out_dir,
                         "Directory for metrics.jsonl and summary.json (written by rank 0)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  worker_cmd->add_flag("-v,--verbose", worker.verbose, "Debug logging");
  worker_cmd->add_flag("--resume", worker.resume,
                       "Continue from the newest checkpoint every rank has in checkpoint.dir");

  pipesgd::launcher::AllReduceBenchArgs bench;
  pipesgd::launcher::RunArgs bench_run;
  std::string min_bytes = "4K", max_bytes = "64M", chunk_bytes = "1M";
  int bench_np = 0;
  auto* bench_cmd = app.add_subcommand("bench", "Benchmarks");
  bench_cmd->require_subcommand(1);
  auto* bench_ar = bench_cmd->add_subcommand(
      "allreduce",
      "AllReduce bandwidth in the nccl-tests convention (size, count, type, redop, time, algbw, "
      "busbw, #wrong; out-of-place and in-place). With --np N starts N local ranks; without, "
      "runs one rank from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT");
  bench_ar->add_option("--np", bench_np, "Start this many local ranks")->check(CLI::Range(1, 1024));
  bench_ar->add_option("-b,--minbytes", min_bytes, "Smallest size in bytes (K, M, G suffixes)")
      ->capture_default_str();
  bench_ar->add_option("-e,--maxbytes", max_bytes, "Largest size in bytes")->capture_default_str();
  bench_ar->add_option("-f,--stepfactor", bench.factor, "Size multiplier between rows")
      ->capture_default_str();
  bench_ar->add_option("-n,--iters", bench.iters, "Timed iterations per size")->capture_default_str();
  bench_ar->add_option("-w,--warmup_iters", bench.warmup, "Untimed iterations per size")
      ->capture_default_str();
  bench_ar->add_flag("-c,--check", bench.check, "Verify exact sums; count wrong elements");
  bench_ar->add_option("--link-gbps", bench.link_gbps,
                       "Link rate in Gbit/s: also print busbw as a share of it");
  bench_ar->add_option("--json", bench.json_path, "Write the rows as JSON to this file");
  bench_ar->add_option("--chunk-bytes", chunk_bytes,
                       "Ring chunk size in bytes (K, M suffixes), or auto")
      ->capture_default_str();
  bench_ar->add_option("--compression", bench.compression,
                       "Codec on the wire: none, trunc16, fp16 or q8 (sizes stay float32)")
      ->check(CLI::IsMember({"none", "trunc16", "fp16", "q8"}))
      ->capture_default_str();
  bench_ar->add_option("--streams", bench.streams, "TCP connections per ring neighbour")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  bench_ar->add_option("--master-addr", bench_run.master_addr, "With --np: rendezvous address")
      ->capture_default_str();
  bench_ar->add_option("--master-port", bench_run.master_port,
                       "With --np: rendezvous port (default: a free port)");

  app.footer("Exit status: 0 on success, 1 on an error (printed as 'error: ...'), 2 on a usage "
             "error; `run` exits with the failing worker's status.");
  // CLI11 reports an unknown subcommand as "a subcommand is required"; say what was wrong.
  if (args.size() > 1 && args[1][0] != '-' && args[1] != "run" && args[1] != "worker" &&
      args[1] != "bench") {
    std::fprintf(stderr, "error: unknown subcommand '%s' (expected run, worker or bench; see "
                         "pipesgd --help)\n", args[1].c_str());
    return 2;
  }
  try {
    app.parse(static_cast<int>(cargs.size()), cargs.data());
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;  // --help and --version exit 0; usage errors 2
  }

  try {
    if (*run_cmd) {
      pipesgd::InitLogging(run.verbose);
      return pipesgd::launcher::RunLocal(run);
    }
    if (*bench_cmd) {
      pipesgd::InitLogging(false);
      bench.min_bytes = pipesgd::launcher::ParseBytes(min_bytes);
      bench.max_bytes = pipesgd::launcher::ParseBytes(max_bytes);
      bench.chunk_bytes = chunk_bytes == "auto" ? 0 : pipesgd::launcher::ParseBytes(chunk_bytes);
      if (bench_np > 0) {
        bench_run.num_processes = bench_np;
        bench_run.worker_command = pipesgd::launcher::AllReduceBenchWorkerCommand(bench);
        return pipesgd::launcher::RunLocal(bench_run);
      }
      pipesgd::launcher::RunAllReduceBench(bench);
      return 0;
    }
    pipesgd::InitLogging(worker.verbose);
    pipesgd::launcher::RunWorker(worker);
    return 0;
  } catch (const pipesgd::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
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
