// pipesgd: pipelined data-parallel SGD over a ring AllReduce.
//   pipesgd run -np 4 configs/fashion_mnist_mlp.pbtxt [--set key=value]... [--out DIR]
//   pipesgd run -H lab0:1,lab1:1 -np 2 CONFIG   (ranks over ssh; or --hostfile FILE)
//   pipesgd run -np 4 -- PROGRAM ARGS...         (any program, torchrun-style environment)
//   pipesgd worker CONFIG      (one rank; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from env)
//   pipesgd bench allreduce --np 4 [--transport tcp|ucx|ibverbs|auto] ...
//   pipesgd info               (transports, RDMA devices, GPUDirect, BLAS, convolution kernels)
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/base/error.h"
#include "core/base/log.h"
#include "launcher/bench.h"
#include "launcher/timing.h"
#include "core/base/timeline.h"
#include "launcher/info.h"
#include "core/job/config.h"
#include "launcher/hostfile.h"
#include "launcher/process.h"
#include "launcher/remote_rank.h"
#include "launcher/report.h"
#include "launcher/ssh_launcher.h"
#include "launcher/supervisor.h"
#include "core/job/worker.h"

namespace {

constexpr const char* kSetHelp =
    "Override a config field by its path, e.g. --set train.pipeline_width=1 or "
    "--set model.layers[0].linear.out_features=512 (repeatable; applied in order)";

// A finite number >= 0 (> 0 if `positive`). CLI11's own number checks let NaN through, which
// the model then took for "not given", and print their range with DBL_MAX written out in full.
CLI::Validator FiniteNumber(bool positive) {
  const std::string rule = positive ? "> 0" : ">= 0";
  return CLI::Validator(
      [positive, rule](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0') return text + ": not a number";
        if (!std::isfinite(v) || (positive ? !(v > 0) : !(v >= 0))) {
          return text + ": expected a finite number " + rule;
        }
        return "";
      },
      "NUMBER " + rule);
}

// --timeline-first-step: "auto" (the run's first steady step, resolved in the worker where the
// config is known: past train.sync_warmup_steps) or a step number >= 0.
CLI::Validator FirstStep() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text == "auto") return "";
        char* end = nullptr;
        const long long v = std::strtoll(text.c_str(), &end, 10);
        if (end == text.c_str() || *end != '\0' || v < 0) {
          return text + ": expected auto or a step number >= 0";
        }
        return "";
      },
      "auto|STEP");
}

int64_t FirstStepValue(const std::string& text) {
  return text == "auto" ? pipesgd::job::kTimelineFirstStepAuto : std::stoll(text);
}

}  // namespace

int main(int argc, char** argv) {
  // mpirun and horovodrun spell it -np; CLI11 only takes single-letter short options.
  std::vector<std::string> args(argv, argv + argc);
  // `pipesgd run [options] -- PROGRAM ARGS...`: what follows "--" is the program's, untouched.
  std::vector<std::string> program;
  if (args.size() > 1 && args[1] == "run") {
    if (auto dashes = std::find(args.begin() + 2, args.end(), "--"); dashes != args.end()) {
      program.assign(dashes + 1, args.end());
      args.erase(dashes, args.end());
      if (program.empty()) {
        std::fprintf(stderr, "error: run: nothing after --; expected a program to run on every "
                             "rank (pipesgd run -np 4 -- ./my_program ARGS...)\n");
        return 2;
      }
    }
  }
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
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());

  CLI::App app{
      "pipesgd: data-parallel training with pipelined SGD (Pipe-SGD) over a ring AllReduce.\n"
      "Quick start: pipesgd run -np 4 configs/fashion_mnist_mlp.pbtxt"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "pipesgd " PIPESGD_VERSION);

  pipesgd::launcher::RunArgs run;
  pipesgd::launcher::SshOptions ssh;
  std::vector<std::string> host_lists;
  std::string hostfile, transport_name, network_interface;
  auto* run_cmd = app.add_subcommand(
      "run",
      "Start the ranks of a job and supervise them: N local workers (-np N), or ranks on other "
      "machines over ssh (-H host:slots,... or --hostfile FILE)");
  // -np (or --np) counts ranks in every subcommand; -n is bench's iterations, as in nccl-tests.
  run_cmd->add_option("--np", run.num_processes,
                      "Number of ranks, also -np (with -H/--hostfile: default all slots; at most that)")
      ->check(CLI::Range(1, 1024));
  run_cmd->add_option("config", run.config_path,
                      "Job config (protobuf text format), or a program to start on every rank "
                      "(a path, or a name on PATH; with arguments: -- PROGRAM ARGS...), with "
                      "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and "
                      "PIPESGD_JOB_TOKEN set");
  run_cmd->add_option("--set", run.overrides, kSetHelp)->allow_extra_args(false);
  run_cmd->add_option("--out", run.out_dir,
                      "Directory for metrics.jsonl (one line per epoch) and summary.json "
                      "(written by rank 0, on its host)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // --log-dir: not to be confused with --out (metrics); --output-dir is its earlier name.
  run_cmd->add_option("--log-dir,--output-dir", run.output_dir,
                      "Keep each rank's stdout and stderr in DIR/rank.R/{stdout,stderr} (on this "
                      "machine), besides printing them")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  run_cmd->add_option("--master-addr", run.master_addr,
                      "Address rank 0 listens on for the rendezvous (default: 127.0.0.1; over "
                      "ssh: the address rank 0's host was reached at, or its address on "
                      "--network-interface)");
  run_cmd->add_option("--master-port", run.master_port,
                      "Rendezvous port (default: a free port; over ssh, one free on rank 0's "
                      "host)")
      ->check(CLI::Range(0, 65535));
  run_cmd->add_option("-x", run.forward_env,
                      "Set an environment variable on every rank: NAME (this shell's value) or "
                      "NAME=VALUE (repeatable, as mpirun -x)")
      ->allow_extra_args(false);
  run_cmd->add_option("--transport", transport_name,
                      "Transport between ranks, for every rank: tcp, ucx, ibverbs or auto (= --set "
                      "comm.transport=NAME)");
  run_cmd->add_option("--network-interface", network_interface,
                      "Network interface(s) every rank uses, NCCL_SOCKET_IFNAME grammar: eth,ib "
                      "(prefixes) ^docker,lo (exclude) =eth0 (exact) (= --set "
                      "comm.network_interface=...)");
  run_cmd->add_flag("-v,--verbose", run.verbose,
                    "Debug logging in every worker; over ssh also the host in each line's prefix");
  run_cmd->add_flag("--overwrite", run.overwrite,
                    "Let --out replace a finished run there (otherwise refused)");
  run_cmd->add_flag("--resume", run.resume,
                    "Continue from the newest checkpoint every rank has in checkpoint.dir");
  std::string run_timeline;
  std::string run_timeline_first = "auto";
  int64_t run_timeline_steps = 20;
  run_cmd->add_option("--timeline", run_timeline,
                      "Write a Chrome trace-event JSON timeline (open in Perfetto) of every rank's "
                      "compute and communication spans: FILE.rankR.json per rank, merged into "
                      "FILE at the end of a local run");
  run_cmd->add_option("--timeline-first-step", run_timeline_first,
                      "First step the timeline records; auto: the first steady step, after "
                      "train.sync_warmup_steps (the last steps of a shorter run)")
      ->capture_default_str()
      ->check(FirstStep());
  run_cmd->add_option("--timeline-steps", run_timeline_steps,
                      "Steps the timeline records")->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  auto* hosts_opt = run_cmd->add_option(
      "-H,--host", host_lists,
      "Run over ssh on these hosts: host[:slots],... (slots default 1; repeatable). Ranks fill "
      "the hosts in order, slot by slot");
  auto* hostfile_opt = run_cmd->add_option(
      "--hostfile,--machinefile", hostfile,
      "Run over ssh on the hosts of an Open MPI hostfile: 'host [slots=N]' per line, # comments");
  hosts_opt->excludes(hostfile_opt);
  std::vector<CLI::Option*> ssh_only = {
      run_cmd->add_option("--ssh-port", ssh.port, "ssh port on every host (ssh -p)")
          ->check(CLI::Range(1, 65535)),
      run_cmd->add_option("--ssh-identity", ssh.identity, "ssh private key file (ssh -i)")
          ->check(CLI::ExistingFile),
      run_cmd->add_option("-F,--ssh-config", ssh.config_file,
                          "ssh client config file (ssh -F), e.g. $(scripts/lab ssh-config)")
          ->check(CLI::ExistingFile),
      run_cmd->add_option("--ssh-option", ssh.options,
                          "Extra ssh option, passed as -o OPTION ahead of pipesgd's defaults "
                          "(repeatable), e.g. --ssh-option StrictHostKeyChecking=accept-new")
          ->allow_extra_args(false),
      run_cmd->add_option("--ssh-connect-timeout", ssh.connect_timeout_s,
                          "Seconds for ssh to connect to a host (ssh -o ConnectTimeout)")
          ->capture_default_str()
          ->check(CLI::Range(1.0, 3600.0)),
      run_cmd->add_option("--ssh-program", ssh.program,
                          "The ssh client to run (same options as OpenSSH's)")
          ->capture_default_str(),
      run_cmd->add_option("--remote-binary", ssh.remote_binary,
                          "Absolute path of pipesgd on the hosts (default: this binary's path)"),
  };
  run_cmd->footer(
      "Each rank's output is prefixed with [rank R]. If any rank fails, the others are stopped "
      "(over ssh: on every host, with everything they started) and the run exits with that "
      "rank's status, naming it. Ctrl-C stops every rank.\n"
      "Over ssh: ssh runs with BatchMode=yes (never a prompt); every host is checked first "
      "(reachable, same pipesgd binary), the config is shipped to each rank, and the job token "
      "travels on the ssh session's stdin.");

  pipesgd::job::WorkerArgs worker;
  auto* worker_cmd = app.add_subcommand(
      "worker",
      "Run one rank. Takes its place from the environment: RANK, WORLD_SIZE, MASTER_ADDR, "
      "MASTER_PORT (as torchrun and pipesgd run set them), or srun's (SLURM_PROCID, ...) or "
      "mpirun's (OMPI_COMM_WORLD_RANK, ...); with none of them it runs alone "
      "(docs/launchers.md)");
  worker_cmd->add_option("config", worker.config_path, "Job config (protobuf text format)")
      ->required();
  worker_cmd->add_option("--set", worker.overrides, kSetHelp)->allow_extra_args(false);
  worker_cmd->add_option("--out", worker.out_dir,
                         "Directory for metrics.jsonl and summary.json (written by rank 0)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  worker_cmd->add_flag("-v,--verbose", worker.verbose, "Debug logging");
  worker_cmd->add_option("--timeline", worker.timeline,
                         "Write this rank's Chrome trace-event JSON timeline (one rank: FILE; "
                         "else FILE.rankR.json)");
  std::string worker_timeline_first = "auto";
  worker_cmd->add_option("--timeline-first-step", worker_timeline_first,
                         "First step the timeline records; auto: the first steady step, after "
                         "train.sync_warmup_steps (the last steps of a shorter run)")
      ->capture_default_str()
      ->check(FirstStep());
  worker_cmd->add_option("--timeline-steps", worker.timeline_steps, "Steps the timeline records")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  worker_cmd->add_flag("--overwrite", worker.overwrite,
                       "Let --out replace a finished run there (otherwise refused)");
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
      "AllReduce bandwidth in the nccl-tests convention (size, count, type, redop, root, time, "
      "algbw, busbw, #wrong; out-of-place and in-place). With -np N starts N local ranks; without, "
      "runs one rank placed by its launcher (RANK/WORLD_SIZE/MASTER_*, srun, mpirun)");
  bench_ar->add_option("--np", bench_np, "Start this many local ranks (also -np)")->check(CLI::Range(1, 1024));
  bench_ar->add_option("-b,--minbytes", min_bytes, "Smallest size in bytes (K, M, G suffixes)")
      ->capture_default_str();
  bench_ar->add_option("-e,--maxbytes", max_bytes, "Largest size in bytes")->capture_default_str();
  auto* factor_opt = bench_ar->add_option("-f,--stepfactor", bench.factor,
                                          "Size multiplier between rows")
                         ->capture_default_str();
  std::string step_bytes;
  bench_ar->add_option("-i,--stepbytes", step_bytes,
                       "Fixed increment between sizes instead of -f (K, M, G suffixes)")
      ->excludes(factor_opt);
  bench_ar->add_option("-n,--iters", bench.iters, "Timed iterations per size")->capture_default_str();
  bench_ar->add_option("-w,--warmup_iters,--warmup", bench.warmup, "Untimed iterations per size")
      ->capture_default_str();
  bench_ar->add_option("-c,--check", bench.check,
                       "Checked iterations per size: exact sums (within the codec's bound with "
                       "--compression), wrong elements counted; 0 = no check")
      ->capture_default_str();
  bench_ar->add_option("-g,--ngpus", bench.gpus, "Devices per rank (1: one rank drives one)")
      ->capture_default_str();
  bench_ar->add_option("-d,--datatype", bench.datatype, "Element type (float)")
      ->capture_default_str();
  bench_ar->add_option("-o,--op", bench.op, "Reduction: sum or avg")->capture_default_str();
  bench_ar->add_option("-a,--average", bench.average,
                       "Time reported over the ranks: 0 rank 0, 1 mean, 2 min, 3 max")
      ->capture_default_str();
  // all_reduce_perf's other flags, at the values that describe what runs here.
  bench_ar->add_option("-t,--nthreads", bench.threads, "Threads per rank (1)")->capture_default_str();
  bench_ar->add_option("-m,--agg_iters", bench.agg_iters, "Operations per iteration (1)")
      ->capture_default_str();
  bench_ar->add_option("-G,--cudagraph", bench.graph, "CUDA graph launches (0: none)")
      ->capture_default_str();
  bench_ar->add_option("-z,--blocking", bench.blocking,
                       "0 or 1; every AllReduce here returns when done either way")
      ->capture_default_str();
  bench_ar->add_option("-p,--parallel_init", bench.parallel_init, "0 or 1 (one rank per process)")
      ->capture_default_str();
  bench_ar->add_option("--link-gbps", bench.link_gbps,
                       "Link rate in Gbit/s: also print busbw as a share of it");
  bench_ar->add_option("--json", bench.json_path, "Write the rows as JSON to this file");
  bench_ar->add_option("--chunk-bytes", chunk_bytes,
                       "Ring chunk size in bytes (K, M suffixes), or auto")
      ->capture_default_str();
  bench_ar->add_option("--compression", bench.compression,
                       "Codec on the wire: none, trunc16, fp16, q8, q4 or sign1 (sizes stay "
                       "float32)")
      ->check(CLI::IsMember({"none", "trunc16", "fp16", "q8", "q4", "sign1"}))
      ->capture_default_str();
  bench_ar->add_option("--streams", bench.streams, "Connections per ring neighbour")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  bench_ar->add_option("--transport", bench.transport,
                       "tcp, ucx, ibverbs or auto (ibverbs if an RDMA port is active, else tcp); UCX "
                       "reads UCX_TLS, UCX_NET_DEVICES")
      ->transform(CLI::IsMember({"tcp", "ucx", "ibverbs", "auto"}, CLI::ignore_case))
      ->capture_default_str();
  bench_ar->add_option("--network-interface", bench.network_interface,
                       "Interfaces for TCP in NCCL_SOCKET_IFNAME's grammar (eth0, ^docker,lo, "
                       "=eth1); default PIPESGD_SOCKET_IFNAME, else the rendezvous subnet's");
  bench_ar->add_option("--ib-device", bench.ib_device,
                       "ibverbs: RDMA device (default: the first with an active port)");
  bench_ar->add_option("--ib-port", bench.ib_port, "ibverbs: port (0: the first active one)")
      ->check(CLI::Range(0, 255))
      ->capture_default_str();
  bench_ar->add_option("--gid-index", bench.gid_index, "ibverbs: GID index (-1: auto)")
      ->check(CLI::Range(-1, 255))
      ->capture_default_str();
  bench_ar->add_option("--set", bench.overrides,
                       "Override a comm field by its path, as pipesgd run takes it, e.g. --set "
                       "comm.error_feedback=true or --set comm.timeout_s=30 (repeatable; after "
                       "the flags above, which stand for comm.chunk_bytes, comm.streams, ...)")
      ->allow_extra_args(false);
  bench_ar->add_option("--master-addr", bench_run.master_addr, "With --np: rendezvous address")
      ->capture_default_str();
  bench_ar->add_option("--master-port", bench_run.master_port,
                       "With --np: rendezvous port (default: a free port)");

  pipesgd::launcher::ProbeArgs probe;
  pipesgd::launcher::RunArgs probe_run;
  int probe_np = 0;
  auto* probe_cmd = app.add_subcommand(
      "probe",
      "Measure the links between ring neighbours (ping-pong latency, bandwidth, per-message "
      "cost) and the compute time of one step of the configured model, for `pipesgd model`. "
      "One rank per node (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or -np N local ranks");
  probe_cmd->add_option("config", probe.config_path, "Job config (protobuf text format)")
      ->required()->check(CLI::ExistingFile);
  probe_cmd->add_option("--set", probe.overrides, kSetHelp)->allow_extra_args(false);
  probe_cmd->add_option("--json", probe.json_path, "Rank 0 writes the results here (for pipesgd model --probe)");
  probe_cmd->add_option("--np", probe_np, "Start this many local ranks (also -np)")->check(CLI::Range(1, 1024));
  probe_cmd->add_option("--pings", probe.pings, "Ping-pong round trips timed")
      ->capture_default_str()->check(CLI::Range(1, 1000000));
  probe_cmd->add_option("--compute-steps", probe.compute_steps, "Forward + backward steps timed")
      ->capture_default_str()->check(CLI::Range(1, 100000));
  probe_cmd->add_option("--master-addr", probe_run.master_addr, "With -np: rendezvous address");

  pipesgd::launcher::ModelArgs model;
  pipesgd::launcher::ReportArgs report;
  auto* report_cmd = app.add_subcommand(
      "report",
      "Compare runs side by side: a table (mode, width, codec, transport, samples/s, time to each "
      "target accuracy, final accuracy, speedup over the first run) and a PNG of test accuracy "
      "against training time (gnuplot)");
  report_cmd->add_option("runs", report.runs,
                         "--out directories (metrics.jsonl, summary.json) or metrics.jsonl files")
      ->required()
      ->check(CLI::ExistingPath);
  report_cmd->add_option("--target", report.targets,
                         "Test accuracy to report the time to (repeatable; default: the runs' "
                         "train.target_accuracy, else 0.85)")
      ->allow_extra_args(false);
  report_cmd->add_option("--png", report.png, "Where to draw the plot ('' = none)")
      ->capture_default_str();

  auto* model_cmd = app.add_subcommand(
      "model",
      "Predict the time per iteration of every scheme (PS sync, PS async, ring sync, Pipe-SGD "
      "width 2; each codec) from latency, bandwidth, world size, model size and compute time, "
      "and print the best choice (docs/timing_models.md)");
  model_cmd->add_option("--probe", model.probe_json, "Inputs from pipesgd probe --json FILE")
      ->check(CLI::ExistingFile);
  // -np, as everywhere ranks are counted; not -w, which is bench's warm-up.
  model_cmd->add_option("--np,--workers", model.workers, "W: workers (ring: world size; PS: world size - 1)")
      ->check(CLI::Range(1, 1 << 20));
  model_cmd->add_option("--model-bytes", model.model_bytes, "M: gradient bytes (4 x parameters)")
      ->check(FiniteNumber(true));
  model_cmd->add_option("--latency-s", model.latency_s, "alpha: one-way latency, seconds")
      ->check(FiniteNumber(false));
  model_cmd->add_option("--bandwidth-Bps", model.bandwidth_Bps, "B: link bandwidth, bytes/s")
      ->check(FiniteNumber(true));
  model_cmd->add_option("--link-rate-bps", model.link_rate_bps, "B = RATE / 8 (e.g. 1e9 for 1gbit)")
      ->check(FiniteNumber(true));
  model_cmd->add_option("--compute-s", model.compute_s, "C: forward + backward per step, seconds")
      ->check(FiniteNumber(false));
  model_cmd->add_option("--update-s", model.update_s, "U: optimizer update, seconds")
      ->check(FiniteNumber(false));
  model_cmd->add_option("--pipelined-update-s", model.pipelined_update_s,
                        "U_K: the update at width >= 2 with its staleness compensation, seconds "
                        "(default: U)")
      ->check(FiniteNumber(false));
  model_cmd->add_option("--reduce-s-per-byte", model.reduce_s_per_byte, "rho: float32 add, seconds per byte")
      ->check(FiniteNumber(false));
  model_cmd->add_option("--chunk-overhead-s", model.chunk_overhead_s, "o: cost of one chunk message, seconds")
      ->check(FiniteNumber(false));
  model_cmd->add_option("--contention", model.contention,
                        "gamma: share of the shorter of link and CPU time that does not overlap "
                        "the longer (0: a NIC; 1: the cores copy the bytes, as on loopback)")
      ->check(FiniteNumber(false) & CLI::Range(0.0, 1.0));
  model_cmd->add_option("--chunk-bytes", model.chunk_bytes, "Evaluate only this chunk size (default: search 4 KiB..16 MiB)")
      ->check(FiniteNumber(true));
  model_cmd->add_option("--json", model.json_path, "Write the predictions as JSON");

  auto* info_cmd = app.add_subcommand(
      "info", "Print what this build and host support: transports, RDMA devices, GPUDirect, BLAS, "
              "convolution kernels");

  // What `pipesgd run` runs over ssh (launcher/remote_rank.h); hidden from --help.
  auto* remote_rank_cmd = app.add_subcommand(
      "remote-rank", "One rank started over ssh by pipesgd run (reads the job on stdin)");
  remote_rank_cmd->group("");
  auto* remote_probe_cmd =
      app.add_subcommand("remote-probe", "Preflight of pipesgd run over ssh");
  remote_probe_cmd->group("");

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
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr && run_cmd->parsed() &&
        pipesgd::launcher::IsProgram(run.config_path)) {
      std::fprintf(stderr, "error: run: %s is a program: give its arguments after --, as in "
                           "pipesgd run -np N -- %s ARGS...\n",
                   run.config_path.c_str(), run.config_path.c_str());
      return 2;
    }
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;  // --help and --version exit 0; usage errors 2
  }

  try {
    if (*info_cmd) {
      pipesgd::InitLogging(false);
      std::fputs(pipesgd::launcher::InfoReport().c_str(), stdout);
      return 0;
    }
    if (*remote_probe_cmd) return pipesgd::launcher::RunRemoteProbe();
    if (*remote_rank_cmd) {
      pipesgd::InitLogging(false);
      return pipesgd::launcher::RunRemoteRank();
    }
    if (*run_cmd) {
      pipesgd::InitLogging(run.verbose);
      const bool over_ssh = !host_lists.empty() || !hostfile.empty();
      namespace fs = std::filesystem;
      std::error_code ec;
      if (program.empty() && pipesgd::launcher::IsProgram(run.config_path)) {
        // `pipesgd run -np 4 ./my_program`; a file named as given, even without a '/'.
        program = {run.config_path.find('/') == std::string::npos ? "./" + run.config_path
                                                                  : run.config_path};
      } else if (program.empty() && !run.config_path.empty() && !fs::exists(run.config_path, ec)) {
        if (run.config_path.find('/') == std::string::npos) {
          try {
            pipesgd::launcher::FindProgram(run.config_path);
            program = {run.config_path};  // `pipesgd run -np 4 hostname`, as mpirun takes it
          } catch (const pipesgd::Error&) {
          }
        }
        if (program.empty()) {
          std::fprintf(stderr, "error: run: %s: no such config file (nor a program of that name "
                               "on PATH)\n", run.config_path.c_str());
          return 2;
        }
      } else if (!program.empty() && !run.config_path.empty()) {
        std::fprintf(stderr, "error: run: both a config (%s) and a program after -- (%s); give "
                             "one\n", run.config_path.c_str(), program[0].c_str());
        return 2;
      }
      if (program.empty() && run.config_path.empty()) {
        std::fprintf(stderr, "error: run: give a job config (pipesgd run -np 4 CONFIG) or a "
                             "program (pipesgd run -np 4 -- PROGRAM ARGS...)\n");
        return 2;
      }
      if (!program.empty()) {
        for (const char* name : {"--set", "--out", "--resume", "--overwrite", "--timeline",
                                 "--transport", "--network-interface"}) {
          if (run_cmd->count(name) > 0) {
            std::fprintf(stderr, "error: %s applies to a pipesgd job config, not to a program "
                                 "(%s)\n", name, program[0].c_str());
            return 2;
          }
        }
        run.program = program;
      }
      if (!over_ssh) {
        for (const auto* o : ssh_only) {
          if (o->count() > 0) {
            std::fprintf(stderr, "error: %s applies only to runs over ssh (-H or --hostfile)\n",
                         o->get_name().c_str());
            return 2;
          }
        }
        if (run_cmd->count("--np") == 0) {
          std::fprintf(stderr, "error: run: give -np N (local workers), or -H / --hostfile "
                               "(ranks over ssh)\n");
          return 2;
        }
      }
      run.master_addr_given = run_cmd->count("--master-addr") > 0;
      run.command_line = pipesgd::launcher::ShellJoin({argv, argv + argc});
      // Per-network choices reach every rank as config overrides, so the config check and the
      // rendezvous's comparison of configs cover them too.
      if (!transport_name.empty()) {
        run.overrides.push_back("comm.transport=" +
                                pipesgd::job::TransportEnumName(transport_name));
      }
      if (run_cmd->count("--network-interface") > 0) {
        run.overrides.push_back("comm.network_interface=" + network_interface);
      }
      if (!run_timeline.empty()) {
        run.extra_worker_args = {"--timeline", run_timeline, "--timeline-first-step",
                                 run_timeline_first, "--timeline-steps",
                                 std::to_string(run_timeline_steps)};
      }
      if (!over_ssh) {
        const int status = pipesgd::launcher::RunLocal(run);
        if (status == 0 && !run_timeline.empty() && run.num_processes > 1) {
          pipesgd::timeline::MergeRankFiles(run_timeline, run.num_processes);
          std::printf("pipesgd run: timeline of %d ranks merged into %s\n", run.num_processes,
                      run_timeline.c_str());
        }
        return status;
      }
      if (!hostfile.empty()) {
        ssh.hosts = pipesgd::launcher::ReadHostfile(hostfile);
      } else {
        std::string joined;
        for (const auto& h : host_lists) joined += (joined.empty() ? "" : ",") + h;
        ssh.hosts = pipesgd::launcher::ParseHostList(joined);
      }
      if (run_cmd->count("--np") == 0) {
        run.num_processes = pipesgd::launcher::TotalSlots(ssh.hosts);
      }
      return pipesgd::launcher::RunOverSsh(run, ssh);
    }
    if (*bench_cmd) {
      pipesgd::InitLogging(false);
      // Log lines are comments among the table, as nccl-tests prints its own.
      pipesgd::SetLogLinePrefix("# ");
      bench.min_bytes = pipesgd::launcher::ParseBytes(min_bytes);
      bench.max_bytes = pipesgd::launcher::ParseBytes(max_bytes);
      if (!step_bytes.empty()) bench.step_bytes = pipesgd::launcher::ParseBytes(step_bytes);
      bench.chunk_bytes = chunk_bytes == "auto" ? 0 : pipesgd::launcher::ParseBytes(chunk_bytes);
      pipesgd::launcher::CheckAllReduceBenchArgs(bench);  // before any rank starts
      if (!bench.json_path.empty()) {
        pipesgd::launcher::CheckWritableFile(bench.json_path, "--json");
      }
      if (bench_np > 0) {
        bench_run.num_processes = bench_np;
        bench_run.worker_command = pipesgd::launcher::AllReduceBenchWorkerCommand(bench);
        bench_run.prefix_stdout = false;  // the table as all_reduce_perf prints it
        return pipesgd::launcher::RunLocal(bench_run);
      }
      // As all_reduce_perf: a wrong element fails the run.
      return pipesgd::launcher::RunAllReduceBench(bench) == 0 ? 0 : 1;
    }
    if (*probe_cmd) {
      pipesgd::InitLogging(false);
      if (!probe.json_path.empty()) {
        pipesgd::launcher::CheckWritableFile(probe.json_path, "probe --json");
      }
      if (probe_np > 0) {
        probe_run.num_processes = probe_np;
        probe_run.worker_command = pipesgd::launcher::ProbeWorkerCommand(probe);
        return pipesgd::launcher::RunLocal(probe_run);
      }
      pipesgd::launcher::RunProbe(probe);
      return 0;
    }
    if (*report_cmd) {
      pipesgd::launcher::RunReport(report);
      return 0;
    }
    if (*model_cmd) {
      pipesgd::launcher::RunModel(model);
      return 0;
    }
    pipesgd::InitLogging(worker.verbose);
    worker.timeline_first_step = FirstStepValue(worker_timeline_first);
    pipesgd::job::RunWorker(worker);
    return 0;
  } catch (const pipesgd::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    if (*worker_cmd && e.culprit() >= 0) {
      int rank = -1;  // from the same environment the worker read (RANK, SLURM_PROCID, ...)
      try {
        const auto launch = pipesgd::transport::ReadLaunchEnv();
        if (launch.launcher != pipesgd::transport::Launcher::kNone) rank = launch.rank;
      } catch (const pipesgd::Error&) {
      }
      if (rank >= 0 && e.culprit() != rank) return pipesgd::job::kExitBecauseOfAnotherRank;
    }
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
