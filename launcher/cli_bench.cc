// `pipesgd bench allreduce` and `pipesgd probe`: the measuring commands.
#include <memory>
#include <string>

#include "core/base/log.h"
#include "launcher/bench.h"
#include "launcher/commands.h"
#include "launcher/process.h"
#include "launcher/supervisor.h"
#include "launcher/timing.h"

namespace pipesgd::launcher {

Command AddBenchCommand(CLI::App& app) {
  struct State {
    AllReduceBenchArgs args;
    RunArgs run;
    std::string min_bytes = "4K", max_bytes = "64M", chunk_bytes = "1M", step_bytes;
    int np = 0;
  };
  auto s = std::make_shared<State>();
  auto* bench_cmd = app.add_subcommand("bench", "Benchmarks");
  bench_cmd->require_subcommand(1);
  auto* bench_ar = bench_cmd->add_subcommand(
      "allreduce",
      "AllReduce bandwidth in the nccl-tests convention (size, count, type, redop, root, time, "
      "algbw, busbw, #wrong; out-of-place and in-place). With -np N starts N local ranks; without, "
      "runs one rank placed by its launcher (RANK/WORLD_SIZE/MASTER_*, srun, mpirun)");
  bench_ar->add_option("--np", s->np, "Start this many local ranks (also -np)")->check(CLI::Range(1, 1024));
  bench_ar->add_option("-b,--minbytes", s->min_bytes, "Smallest size in bytes (K, M, G suffixes)")
      ->capture_default_str();
  bench_ar->add_option("-e,--maxbytes", s->max_bytes, "Largest size in bytes")->capture_default_str();
  auto* factor_opt = bench_ar->add_option("-f,--stepfactor", s->args.factor,
                                          "Size multiplier between rows")
                         ->capture_default_str();
  bench_ar->add_option("-i,--stepbytes", s->step_bytes,
                       "Fixed increment between sizes instead of -f (K, M, G suffixes)")
      ->excludes(factor_opt);
  bench_ar->add_option("-n,--iters", s->args.iters, "Timed iterations per size")->capture_default_str();
  bench_ar->add_option("-w,--warmup_iters,--warmup", s->args.warmup, "Untimed iterations per size")
      ->capture_default_str();
  bench_ar->add_option("-c,--check", s->args.check,
                       "Checked iterations per size: exact sums (within the codec's bound with "
                       "--compression), wrong elements counted; 0 = no check")
      ->capture_default_str();
  bench_ar->add_option("-g,--ngpus", s->args.gpus, "Devices per rank (1: one rank drives one)")
      ->capture_default_str();
  bench_ar->add_option("-d,--datatype", s->args.datatype, "Element type (float)")
      ->capture_default_str();
  bench_ar->add_option("-o,--op", s->args.op, "Reduction: sum or avg")->capture_default_str();
  bench_ar->add_option("-a,--average", s->args.average,
                       "Time reported over the ranks: 0 rank 0, 1 mean, 2 min, 3 max")
      ->capture_default_str();
  // all_reduce_perf's other flags, at the values that describe what runs here.
  bench_ar->add_option("-t,--nthreads", s->args.threads, "Threads per rank (1)")->capture_default_str();
  bench_ar->add_option("-m,--agg_iters", s->args.agg_iters, "Operations per iteration (1)")
      ->capture_default_str();
  bench_ar->add_option("-G,--cudagraph", s->args.graph, "CUDA graph launches (0: none)")
      ->capture_default_str();
  bench_ar->add_option("-z,--blocking", s->args.blocking,
                       "0 or 1; every AllReduce here returns when done either way")
      ->capture_default_str();
  bench_ar->add_option("-p,--parallel_init", s->args.parallel_init, "0 or 1 (one rank per process)")
      ->capture_default_str();
  bench_ar->add_option("--link-gbps", s->args.link_gbps,
                       "Link rate in Gbit/s: also print busbw as a share of it");
  bench_ar->add_option("--json", s->args.json_path, "Write the rows as JSON to this file");
  bench_ar->add_option("--chunk-bytes", s->chunk_bytes,
                       "Ring chunk size in bytes (K, M suffixes), or auto")
      ->capture_default_str();
  bench_ar->add_option("--compression", s->args.compression,
                       "Codec on the wire: none, trunc16, fp16, q8, q4 or sign1 (sizes stay "
                       "float32)")
      ->check(CLI::IsMember({"none", "trunc16", "fp16", "q8", "q4", "sign1"}))
      ->capture_default_str();
  bench_ar->add_option("--streams", s->args.streams, "Connections per ring neighbour")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  bench_ar->add_option("--transport", s->args.transport,
                       "tcp, ucx, ibverbs or auto (ibverbs if an RDMA port is active, else tcp); UCX "
                       "reads UCX_TLS, UCX_NET_DEVICES")
      ->transform(CLI::IsMember({"tcp", "ucx", "ibverbs", "auto"}, CLI::ignore_case))
      ->capture_default_str();
  bench_ar->add_option("--network-interface", s->args.network_interface,
                       "Interfaces for TCP in NCCL_SOCKET_IFNAME's grammar (eth0, ^docker,lo, "
                       "=eth1); default PIPESGD_SOCKET_IFNAME, else the rendezvous subnet's");
  bench_ar->add_option("--ib-device", s->args.ib_device,
                       "ibverbs: RDMA device (default: the first with an active port)");
  bench_ar->add_option("--ib-port", s->args.ib_port, "ibverbs: port (0: the first active one)")
      ->check(CLI::Range(0, 255))
      ->capture_default_str();
  bench_ar->add_option("--gid-index", s->args.gid_index, "ibverbs: GID index (-1: auto)")
      ->check(CLI::Range(-1, 255))
      ->capture_default_str();
  bench_ar->add_option("--set", s->args.overrides,
                       "Override a comm field by its path, as pipesgd run takes it, e.g. --set "
                       "comm.error_feedback=true or --set comm.timeout_s=30 (repeatable; after "
                       "the flags above, which stand for comm.chunk_bytes, comm.streams, ...)")
      ->allow_extra_args(false);
  bench_ar->add_option("--master-addr", s->run.master_addr, "With --np: rendezvous address")
      ->capture_default_str();
  bench_ar->add_option("--master-port", s->run.master_port,
                       "With --np: rendezvous port (default: a free port)");

  Command c;
  c.cli = bench_ar;
  c.run = [s] {
    InitLogging(false);
    // Log lines are comments among the table, as nccl-tests prints its own.
    SetLogLinePrefix("# ");
    s->args.min_bytes = ParseBytes(s->min_bytes);
    s->args.max_bytes = ParseBytes(s->max_bytes);
    if (!s->step_bytes.empty()) s->args.step_bytes = ParseBytes(s->step_bytes);
    s->args.chunk_bytes = s->chunk_bytes == "auto" ? 0 : ParseBytes(s->chunk_bytes);
    CheckAllReduceBenchArgs(s->args);  // before any rank starts
    if (!s->args.json_path.empty()) {
      CheckWritableFile(s->args.json_path, "--json");
    }
    if (s->np > 0) {
      s->run.num_processes = s->np;
      s->run.worker_command = AllReduceBenchWorkerCommand(s->args);
      s->run.prefix_stdout = false;  // the table as all_reduce_perf prints it
      return RunLocal(s->run);
    }
    // As all_reduce_perf: a wrong element fails the run.
    return RunAllReduceBench(s->args) == 0 ? 0 : 1;
  };
  return c;
}

Command AddProbeCommand(CLI::App& app) {
  struct State {
    ProbeArgs args;
    RunArgs run;
    int np = 0;
  };
  auto s = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "probe",
      "Measure the links between ring neighbours (ping-pong latency, bandwidth, per-message "
      "cost) and the compute time of one step of the configured model, for `pipesgd model`. "
      "One rank per node (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or -np N local ranks");
  cmd->add_option("config", s->args.config_path, "Job config (protobuf text format)")
      ->required()->check(CLI::ExistingFile);
  cmd->add_option("--set", s->args.overrides, kSetHelp)->allow_extra_args(false);
  cmd->add_option("--json", s->args.json_path, "Rank 0 writes the results here (for pipesgd model --probe)");
  cmd->add_option("--np", s->np, "Start this many local ranks (also -np)")->check(CLI::Range(1, 1024));
  cmd->add_option("--pings", s->args.pings, "Ping-pong round trips timed")
      ->capture_default_str()->check(CLI::Range(1, 1000000));
  cmd->add_option("--compute-steps", s->args.compute_steps, "Forward + backward steps timed")
      ->capture_default_str()->check(CLI::Range(1, 100000));
  cmd->add_option("--master-addr", s->run.master_addr, "With -np: rendezvous address");

  Command c;
  c.cli = cmd;
  c.run = [s] {
    InitLogging(false);
    if (!s->args.json_path.empty()) {
      CheckWritableFile(s->args.json_path, "probe --json");
    }
    if (s->np > 0) {
      s->run.num_processes = s->np;
      s->run.worker_command = ProbeWorkerCommand(s->args);
      return RunLocal(s->run);
    }
    RunProbe(s->args);
    return 0;
  };
  return c;
}

}  // namespace pipesgd::launcher
