// `pipesgd report`, `model` and `info`, and the two commands `pipesgd run` starts over ssh.
#include <cstdio>
#include <memory>
#include <vector>

#include "core/base/log.h"
#include "launcher/commands.h"
#include "launcher/info.h"
#include "launcher/remote_rank.h"
#include "launcher/report.h"
#include "launcher/timing.h"

namespace pipesgd::launcher {

Command AddReportCommand(CLI::App& app) {
  auto s = std::make_shared<ReportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "report",
      "Compare runs side by side: a table (mode, width, codec, transport, samples/s, time to each "
      "target accuracy, final accuracy, speedup over the first run) and a PNG of test accuracy "
      "against training time (gnuplot)");
  cmd->add_option("runs", s->runs,
                         "--out directories (metrics.jsonl, summary.json) or metrics.jsonl files")
      ->required()
      ->check(CLI::ExistingPath);
  cmd->add_option("--target", s->targets,
                         "Test accuracy to report the time to (repeatable; default: the runs' "
                         "train.target_accuracy, else 0.85)")
      ->allow_extra_args(false);
  cmd->add_option("--png", s->png, "Where to draw the plot ('' = none)")
      ->capture_default_str();
  return {cmd, [s] {
            RunReport(*s);
            return 0;
          },
          nullptr};
}

Command AddModelCommand(CLI::App& app) {
  auto s = std::make_shared<ModelArgs>();
  CLI::App* cmd = app.add_subcommand(
      "model",
      "Predict the time per iteration of every scheme (PS sync, PS async, ring sync, Pipe-SGD "
      "width 2; each codec) from latency, bandwidth, world size, model size and compute time, "
      "and print the best choice (docs/timing_models.md)");
  cmd->add_option("--probe", s->probe_json, "Inputs from pipesgd probe --json FILE")
      ->check(CLI::ExistingFile);
  // -np, as everywhere ranks are counted; not -w, which is bench's warm-up.
  cmd->add_option("--np,--workers", s->workers, "W: workers (ring: world size; PS: world size - 1)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--model-bytes", s->model_bytes, "M: gradient bytes (4 x parameters)")
      ->check(FiniteNumber(true));
  cmd->add_option("--latency-s", s->latency_s, "alpha: one-way latency, seconds")
      ->check(FiniteNumber(false));
  cmd->add_option("--bandwidth-Bps", s->bandwidth_Bps, "B: link bandwidth, bytes/s")
      ->check(FiniteNumber(true));
  cmd->add_option("--link-rate-bps", s->link_rate_bps, "B = RATE / 8 (e.g. 1e9 for 1gbit)")
      ->check(FiniteNumber(true));
  cmd->add_option("--compute-s", s->compute_s, "C: forward + backward per step, seconds")
      ->check(FiniteNumber(false));
  cmd->add_option("--update-s", s->update_s, "U: optimizer update, seconds")
      ->check(FiniteNumber(false));
  cmd->add_option("--pipelined-update-s", s->pipelined_update_s,
                        "U_K: the update at width >= 2 with its staleness compensation, seconds "
                        "(default: U)")
      ->check(FiniteNumber(false));
  cmd->add_option("--reduce-s-per-byte", s->reduce_s_per_byte, "rho: float32 add, seconds per byte")
      ->check(FiniteNumber(false));
  cmd->add_option("--chunk-overhead-s", s->chunk_overhead_s, "o: cost of one chunk message, seconds")
      ->check(FiniteNumber(false));
  cmd->add_option("--contention", s->contention,
                        "gamma: share of the shorter of link and CPU time that does not overlap "
                        "the longer (0: a NIC; 1: the cores copy the bytes, as on loopback)")
      ->check(FiniteNumber(false) & CLI::Range(0.0, 1.0));
  cmd->add_option("--chunk-bytes", s->chunk_bytes, "Evaluate only this chunk size (default: search 4 KiB..16 MiB)")
      ->check(FiniteNumber(true));
  cmd->add_option("--local-steps", s->local_steps,
                  "The outer loop's H values to list (train.local_steps; default 4,16,64)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--batch-size", s->batch_size,
                  "Per-worker batch, for samples per second (default: the probe's)")
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--json", s->json_path, "Write the predictions as JSON");
  return {cmd, [s] {
            RunModel(*s);
            return 0;
          },
          nullptr};
}

Command AddInfoCommand(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "info", "Print what this build and host support: transports, RDMA devices, GPUDirect, BLAS, "
              "convolution kernels");
  return {cmd, [] {
            InitLogging(false);
            std::fputs(InfoReport().c_str(), stdout);
            return 0;
          },
          nullptr};
}

std::vector<Command> AddRemoteCommands(CLI::App& app) {
  CLI::App* rank = app.add_subcommand(
      "remote-rank", "One rank started over ssh by pipesgd run (reads the job on stdin)");
  rank->group("");
  CLI::App* probe = app.add_subcommand("remote-probe", "Preflight of pipesgd run over ssh");
  probe->group("");
  return {{rank, [] {
             InitLogging(false);
             return RunRemoteRank();
           },
           nullptr},
          {probe, [] { return RunRemoteProbe(); }, nullptr}};
}

}  // namespace pipesgd::launcher
