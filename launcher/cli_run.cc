// `pipesgd run` and `pipesgd worker`: the commands that start a job's ranks and run one.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/base/timeline.h"
#include "core/job/config.h"
#include "core/job/worker.h"
#include "launcher/commands.h"
#include "launcher/hostfile.h"
#include "launcher/process.h"
#include "launcher/ssh_launcher.h"
#include "launcher/supervisor.h"

namespace pipesgd::launcher {

const char* const kSetHelp =
    "Override a config field by its path, e.g. --set train.pipeline_width=1 or "
    "--set model.layers[0].linear.out_features=512 (repeatable; applied in order)";

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
  return text == "auto" ? job::kTimelineFirstStepAuto : std::stoll(text);
}

namespace {

struct RunState {
  RunArgs run;
  SshOptions ssh;
  std::vector<std::string> host_lists;
  std::string hostfile, transport_name, network_interface;
  std::string timeline;
  std::string timeline_first = "auto";
  int64_t timeline_steps = 20;
  std::vector<CLI::Option*> ssh_only;
  std::vector<std::string> program;
  std::vector<std::string> argv;
};

// A job config or a program, and the options that fit it; 2 and a message where they do not.
int ResolveConfigOrProgram(RunState* s, CLI::App* cmd, bool over_ssh) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (s->program.empty() && IsProgram(s->run.config_path)) {
    // `pipesgd run -np 4 ./my_program`; a file named as given, even without a '/'.
    s->program = {s->run.config_path.find('/') == std::string::npos ? "./" + s->run.config_path
                                                              : s->run.config_path};
  } else if (s->program.empty() && !s->run.config_path.empty() && !fs::exists(s->run.config_path, ec)) {
    if (s->run.config_path.find('/') == std::string::npos) {
      try {
        FindProgram(s->run.config_path);
        s->program = {s->run.config_path};  // `pipesgd run -np 4 hostname`, as mpirun takes it
      } catch (const pipesgd::Error&) {
      }
    }
    if (s->program.empty()) {
      std::fprintf(stderr, "error: run: %s: no such config file (nor a program of that name "
                           "on PATH)\n", s->run.config_path.c_str());
      return 2;
    }
  } else if (!s->program.empty() && !s->run.config_path.empty()) {
    std::fprintf(stderr, "error: run: both a config (%s) and a program after -- (%s); give "
                         "one\n", s->run.config_path.c_str(), s->program[0].c_str());
    return 2;
  }
  if (s->program.empty() && s->run.config_path.empty()) {
    std::fprintf(stderr, "error: run: give a job config (pipesgd run -np 4 CONFIG) or a "
                         "program (pipesgd run -np 4 -- PROGRAM ARGS...)\n");
    return 2;
  }
  if (!s->program.empty()) {
    for (const char* name : {"--set", "--out", "--resume", "--overwrite", "--timeline",
                             "--transport", "--network-interface"}) {
      if (cmd->count(name) > 0) {
        std::fprintf(stderr, "error: %s applies to a pipesgd job config, not to a program "
                             "(%s)\n", name, s->program[0].c_str());
        return 2;
      }
    }
    s->run.program = s->program;
  }
  if (!over_ssh) {
    for (const auto* o : s->ssh_only) {
      if (o->count() > 0) {
        std::fprintf(stderr, "error: %s applies only to runs over ssh (-H or --hostfile)\n",
                     o->get_name().c_str());
        return 2;
      }
    }
    if (cmd->count("--np") == 0) {
      std::fprintf(stderr, "error: run: give -np N (local workers), or -H / --hostfile "
                           "(ranks over ssh)\n");
      return 2;
    }
  }
  return 0;
}

// After ResolveConfigOrProgram: local ranks or ranks over ssh.
int RunJobOrProgram(RunState* s, CLI::App* cmd, bool over_ssh) {
  s->run.master_addr_given = cmd->count("--master-addr") > 0;
  s->run.command_line = ShellJoin(s->argv);
  // Per-network choices reach every rank as config overrides, so the config check and the
  // rendezvous's comparison of configs cover them too.
  if (!s->transport_name.empty()) {
    s->run.overrides.push_back("comm.transport=" +
                            job::TransportEnumName(s->transport_name));
  }
  if (cmd->count("--network-interface") > 0) {
    s->run.overrides.push_back("comm.network_interface=" + s->network_interface);
  }
  if (!s->timeline.empty()) {
    s->run.extra_worker_args = {"--timeline", s->timeline, "--timeline-first-step",
                             s->timeline_first, "--timeline-steps",
                             std::to_string(s->timeline_steps)};
  }
  if (!over_ssh) {
    const int status = RunLocal(s->run);
    if (status == 0 && !s->timeline.empty() && s->run.num_processes > 1) {
      timeline::MergeRankFiles(s->timeline, s->run.num_processes);
      std::printf("pipesgd run: timeline of %d ranks merged into %s\n", s->run.num_processes,
                  s->timeline.c_str());
    }
    return status;
  }
  if (!s->hostfile.empty()) {
    s->ssh.hosts = ReadHostfile(s->hostfile);
  } else {
    std::string joined;
    for (const auto& h : s->host_lists) joined += (joined.empty() ? "" : ",") + h;
    s->ssh.hosts = ParseHostList(joined);
  }
  if (cmd->count("--np") == 0) {
    s->run.num_processes = TotalSlots(s->ssh.hosts);
  }
  return RunOverSsh(s->run, s->ssh);
}

// -H, --hostfile and the options that apply only over ssh (refused without them).
void AddSshOptions(CLI::App* cmd, RunState* s) {
  auto* hosts_opt = cmd->add_option(
      "-H,--host", s->host_lists,
      "Run over ssh on these hosts: host[:slots],... (slots default 1; repeatable). Ranks fill "
      "the hosts in order, slot by slot");
  auto* hostfile_opt = cmd->add_option(
      "--hostfile,--machinefile", s->hostfile,
      "Run over ssh on the hosts of an Open MPI hostfile: 'host [slots=N]' per line, # comments");
  hosts_opt->excludes(hostfile_opt);
  s->ssh_only = {
      cmd->add_option("--ssh-port", s->ssh.port, "ssh port on every host (ssh -p)")
          ->check(CLI::Range(1, 65535)),
      cmd->add_option("--ssh-identity", s->ssh.identity, "ssh private key file (ssh -i)")
          ->check(CLI::ExistingFile),
      cmd->add_option("-F,--ssh-config", s->ssh.config_file,
                          "ssh client config file (ssh -F), e.g. $(scripts/lab ssh-config)")
          ->check(CLI::ExistingFile),
      cmd->add_option("--ssh-option", s->ssh.options,
                          "Extra ssh option, passed as -o OPTION ahead of pipesgd's defaults "
                          "(repeatable), e.g. --ssh-option StrictHostKeyChecking=accept-new")
          ->allow_extra_args(false),
      cmd->add_option("--ssh-connect-timeout", s->ssh.connect_timeout_s,
                          "Seconds for ssh to connect to a host (ssh -o ConnectTimeout)")
          ->capture_default_str()
          ->check(CLI::Range(1.0, 3600.0)),
      cmd->add_option("--ssh-program", s->ssh.program,
                          "The ssh client to run (same options as OpenSSH's)")
          ->capture_default_str(),
      cmd->add_option("--remote-binary", s->ssh.remote_binary,
                          "Absolute path of pipesgd on the hosts (default: this binary's path)"),
  };
}

}  // namespace

Command AddRunCommand(CLI::App& app, const CommandLine& line) {
  auto s = std::make_shared<RunState>();
  s->program = line.program;
  s->argv = line.argv;
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Start the ranks of a job and supervise them: N local workers (-np N), or ranks on other "
      "machines over ssh (-H host:slots,... or --hostfile FILE)");
  // -np (or --np) counts ranks in every subcommand; -n is bench's iterations, as in nccl-tests.
  cmd->add_option("--np", s->run.num_processes,
                      "Number of ranks, also -np (with -H/--hostfile: default all slots; at most that)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("config", s->run.config_path,
                      "Job config (protobuf text format), or a program to start on every rank "
                      "(a path, or a name on PATH; with arguments: -- PROGRAM ARGS...), with "
                      "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and "
                      "PIPESGD_JOB_TOKEN set");
  cmd->add_option("--set", s->run.overrides, kSetHelp)->allow_extra_args(false);
  cmd->add_option("--out", s->run.out_dir,
                      "Directory for metrics.jsonl (one line per epoch) and summary.json "
                      "(written by rank 0, on its host)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // --log-dir: not to be confused with --out (metrics); --output-dir is its earlier name.
  cmd->add_option("--log-dir,--output-dir", s->run.output_dir,
                      "Keep each rank's stdout and stderr in DIR/rank.R/{stdout,stderr} (on this "
                      "machine), besides printing them")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_option("--master-addr", s->run.master_addr,
                      "Address rank 0 listens on for the rendezvous (default: 127.0.0.1; over "
                      "ssh: the address rank 0's host was reached at, or its address on "
                      "--network-interface)");
  cmd->add_option("--master-port", s->run.master_port,
                      "Rendezvous port (default: a free port; over ssh, one free on rank 0's "
                      "host)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("-x", s->run.forward_env,
                      "Set an environment variable on every rank: NAME (this shell's value) or "
                      "NAME=VALUE (repeatable, as mpirun -x)")
      ->allow_extra_args(false);
  cmd->add_option("--transport", s->transport_name,
                      "Transport between ranks, for every rank: tcp, ucx, ibverbs or auto (= --set "
                      "comm.transport=NAME)");
  cmd->add_option("--network-interface", s->network_interface,
                      "Network interface(s) every rank uses, NCCL_SOCKET_IFNAME grammar: eth,ib "
                      "(prefixes) ^docker,lo (exclude) =eth0 (exact) (= --set "
                      "comm.network_interface=...)");
  cmd->add_flag("-v,--verbose", s->run.verbose,
                    "Debug logging in every worker; over ssh also the host in each line's prefix");
  cmd->add_flag("--overwrite", s->run.overwrite,
                    "Let --out replace a finished run there (otherwise refused)");
  cmd->add_flag("--resume", s->run.resume,
                    "Continue from the newest checkpoint every rank has in checkpoint.dir");
  cmd->add_option("--timeline", s->timeline,
                      "Write a Chrome trace-event JSON timeline (open in Perfetto) of every rank's "
                      "compute and communication spans: FILE.rankR.json per rank, merged into "
                      "FILE at the end of a local run");
  cmd->add_option("--timeline-first-step", s->timeline_first,
                      "First step the timeline records; auto: the first steady step, after "
                      "train.sync_warmup_steps (the last steps of a shorter run)")
      ->capture_default_str()
      ->check(FirstStep());
  cmd->add_option("--timeline-steps", s->timeline_steps,
                      "Steps the timeline records")->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  AddSshOptions(cmd, s.get());
  cmd->footer(
      "Each rank's output is prefixed with [rank R]. If any rank fails, the others are stopped "
      "(over ssh: on every host, with everything they started) and the run exits with that "
      "rank's status, naming it. Ctrl-C stops every rank.\n"
      "Over ssh: ssh runs with BatchMode=yes (never a prompt); every host is checked first "
      "(reachable, same pipesgd binary), the config is shipped to each rank, and the job token "
      "travels on the ssh session's stdin.");

  Command c;
  c.cli = cmd;
  c.run = [s, cmd] {
    InitLogging(s->run.verbose);
    const bool over_ssh = !s->host_lists.empty() || !s->hostfile.empty();
    if (const int status = ResolveConfigOrProgram(s.get(), cmd, over_ssh); status != 0) {
      return status;
    }
    return RunJobOrProgram(s.get(), cmd, over_ssh);
  };
  c.explain = [s, cmd](const CLI::ParseError& e) -> std::optional<int> {
    if (dynamic_cast<const CLI::ExtrasError*>(&e) == nullptr || !cmd->parsed() ||
        !IsProgram(s->run.config_path)) {
      return std::nullopt;
    }
    std::fprintf(stderr, "error: run: %s is a program: give its arguments after --, as in "
                         "pipesgd run -np N -- %s ARGS...\n",
                 s->run.config_path.c_str(), s->run.config_path.c_str());
    return 2;
  };
  return c;
}

Command AddWorkerCommand(CLI::App& app) {
  struct State {
    job::WorkerArgs args;
    std::string timeline_first = "auto";
  };
  auto s = std::make_shared<State>();
  CLI::App* cmd = app.add_subcommand(
      "worker",
      "Run one rank. Takes its place from the environment: RANK, WORLD_SIZE, MASTER_ADDR, "
      "MASTER_PORT (as torchrun and pipesgd run set them), or srun's (SLURM_PROCID, ...) or "
      "mpirun's (OMPI_COMM_WORLD_RANK, ...); with none of them it runs alone "
      "(docs/launchers.md)");
  cmd->add_option("config", s->args.config_path, "Job config (protobuf text format)")
      ->required();
  cmd->add_option("--set", s->args.overrides, kSetHelp)->allow_extra_args(false);
  cmd->add_option("--out", s->args.out_dir,
                         "Directory for metrics.jsonl and summary.json (written by rank 0)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->add_flag("-v,--verbose", s->args.verbose, "Debug logging");
  cmd->add_option("--timeline", s->args.timeline,
                         "Write this rank's Chrome trace-event JSON timeline (one rank: FILE; "
                         "else FILE.rankR.json)");
  cmd->add_option("--timeline-first-step", s->timeline_first,
                         "First step the timeline records; auto: the first steady step, after "
                         "train.sync_warmup_steps (the last steps of a shorter run)")
      ->capture_default_str()
      ->check(FirstStep());
  cmd->add_option("--timeline-steps", s->args.timeline_steps, "Steps the timeline records")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_flag("--overwrite", s->args.overwrite,
                       "Let --out replace a finished run there (otherwise refused)");
  cmd->add_flag("--resume", s->args.resume,
                       "Continue from the newest checkpoint every rank has in checkpoint.dir");

  Command c;
  c.cli = cmd;
  c.run = [s] {
    InitLogging(s->args.verbose);
    s->args.timeline_first_step = FirstStepValue(s->timeline_first);
    job::RunWorker(s->args);
    return 0;
  };
  return c;
}

}  // namespace pipesgd::launcher
