#include "launcher/ssh_launcher.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <charconv>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <utility>
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/base/deadline.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "core/job/config.h"
#include "launcher/process.h"
#include "launcher/remote_rank.h"
#include "transport/ifname.h"

namespace pipesgd::launcher {
namespace {

namespace fs = std::filesystem;

// The preflight's extra time beyond ssh's ConnectTimeout: authentication and the probe itself.
constexpr double kProbeSlackS = 10;
// How long a remote rank has to stop after its stdin closes before ssh gets SIGTERM, and from
// there to SIGKILL; the remote wrapper's own SIGTERM-to-SIGKILL grace.
constexpr double kCloseGraceS = 4;
constexpr double kSshKillGraceS = 2;
constexpr double kRemoteKillGraceS = 2;

struct Probe {
  std::string host;
  std::optional<int> exit_status;  // wait status, once it ended
  bool timed_out = false;
  std::string out;
  std::string err;
};

// What a successful probe said.
struct HostInfo {
  std::string version;
  std::string server_address;  // where ssh reached the host ($SSH_CONNECTION's third field)
  int free_port = 0;
  std::vector<transport::NetInterface> interfaces;  // up: IPv4, then IPv6
};

std::string Trimmed(const std::string& text) {
  std::string t = text;
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  // Keep messages on one line each, readable inside a list.
  for (size_t at = t.find('\n'); at != std::string::npos; at = t.find('\n', at)) {
    t.replace(at, 1, " | ");
  }
  return t.empty() ? "(no message)" : t;
}

// The preflight's remote command: the probe in a process group of its own (setsid, util-linux:
// every Debian host has it), and a watcher that
// kills that group when the ssh session's stdin closes (the launcher gave up on the probe, or
// died). Without it a probe that hangs on the other host (no tty: no SIGHUP) would outlive the
// launcher there. The exit status is the probe's (127: no such binary). The watcher reads fd 3
// (a copy of stdin), since a background list's own stdin is /dev/null.
std::string ProbeCommand(const std::string& binary) {
  const std::string script =
      "exec 3<&0; setsid \"$1\" remote-probe </dev/null & p=$!; "
      "{ cat <&3 >/dev/null; kill -KILL -$p || kill -KILL $p; } >/dev/null 2>&1 & w=$!; "
      "exec 3<&-; "
      "wait $p; s=$?; kill $w 2>/dev/null; exit $s";
  return "exec sh -c " + ShellQuote(script) + " pipesgd-preflight " + ShellQuote(binary);
}

// Runs the probes on every host at once; returns each one's output, within the deadline
// (probes still running then are killed and marked timed out).
std::vector<Probe> RunProbes(const SshOptions& ssh, const std::vector<std::string>& hosts,
                             const std::string& binary, Deadline deadline) {
  std::vector<Probe> probes(hosts.size());
  std::vector<Child> children(hosts.size());
  for (size_t i = 0; i < hosts.size(); ++i) {
    probes[i].host = hosts[i];
    ChildSpec spec;
    spec.argv = SshArgv(ssh, hosts[i], ProbeCommand(binary));
    // Held open while the probe runs (ssh must not read the launcher's terminal either): its
    // end, when ssh ends, is what stops a probe that hangs on the other host.
    spec.stdin_pipe = true;
    try {
      children[i] = SpawnChild(spec, fmt::format("ssh to {}", hosts[i]));
    } catch (const Error&) {
      for (auto& c : children) {
        if (c.pid <= 0) continue;
        kill(c.pid, SIGKILL);
        waitpid(c.pid, nullptr, 0);
      }
      throw;
    }
  }
  auto close_stdin = [](Child& c) {
    if (c.stdin_fd >= 0) close(c.stdin_fd);
    c.stdin_fd = -1;
  };
  while (true) {
    bool done = true;
    for (size_t i = 0; i < children.size(); ++i) {
      if (!probes[i].exit_status) {
        int st = 0;
        if (waitpid(children[i].pid, &st, WNOHANG) == children[i].pid) {
          probes[i].exit_status = st;
          close_stdin(children[i]);
        }
      }
      done &= probes[i].exit_status.has_value() && children[i].out_fd < 0 &&
              children[i].err_fd < 0;
    }
    if (done) break;
    if (deadline.expired()) {
      for (size_t i = 0; i < children.size(); ++i) {
        if (!probes[i].exit_status) {
          // The session's end closes the remote watcher's stdin, which kills the probe there.
          kill(children[i].pid, SIGKILL);
          waitpid(children[i].pid, nullptr, 0);
          probes[i].timed_out = true;
        }
        close_stdin(children[i]);
        for (int* fd : {&children[i].out_fd, &children[i].err_fd}) {
          if (*fd >= 0) close(*fd);
          *fd = -1;
        }
      }
      break;
    }
    std::vector<pollfd> fds;
    std::vector<std::pair<size_t, bool>> owners;  // probe, is stdout
    for (size_t i = 0; i < children.size(); ++i) {
      if (children[i].out_fd >= 0) {
        fds.push_back({children[i].out_fd, POLLIN, 0});
        owners.push_back({i, true});
      }
      if (children[i].err_fd >= 0) {
        fds.push_back({children[i].err_fd, POLLIN, 0});
        owners.push_back({i, false});
      }
    }
    poll(fds.data(), fds.size(), fds.empty() ? 20 : 100);
    for (size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [i, is_out] = owners[k];
      int& fd = is_out ? children[i].out_fd : children[i].err_fd;
      char buf[8192];
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n > 0) {
        (is_out ? probes[i].out : probes[i].err).append(buf, static_cast<size_t>(n));
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        close(fd);
        fd = -1;
      }
    }
  }
  return probes;
}

// Reads a probe's "key value" lines; nullopt if it is not a probe's output.
std::optional<HostInfo> ParseProbe(const std::string& out) {
  HostInfo info;
  bool is_probe = false;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string key;
    words >> key;
    if (key == "probe") {
      is_probe = true;
    } else if (key == "version") {
      words >> info.version;
    } else if (key == "ssh_connection") {
      std::string client, client_port;
      words >> client >> client_port >> info.server_address;
    } else if (key == "free_port") {
      words >> info.free_port;
    } else if (key == "interface") {
      // "interface eth0 10.0.0.2/24"
      transport::NetInterface i;
      std::string cidr;
      words >> i.name >> cidr;
      const size_t slash = cidr.find('/');
      i.ip = cidr.substr(0, slash);
      // No or a bad prefix: the address alone (the launcher needs no subnet).
      const int bits = i.ip.find(':') == std::string::npos ? 32 : 128;  // IPv4 or IPv6
      i.prefix_len = bits;
      if (slash != std::string::npos) {
        int n = -1;
        const char* end = cidr.data() + cidr.size();
        if (auto [p, ec] = std::from_chars(cidr.data() + slash + 1, end, n);
            ec == std::errc() && p == end && n >= 0 && n <= bits) {
          i.prefix_len = n;
        }
      }
      info.interfaces.push_back(i);
    }
  }
  if (!is_probe) return std::nullopt;
  return info;
}

std::string ReadConfigText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  if (in) text << in.rdbuf();
  if (!in || in.bad()) {
    Throw(ErrorCode::kNotFound, "cannot read config file {}: {}", path, std::strerror(errno));
  }
  return text.str();
}

}  // namespace

std::vector<std::string> SshArgv(const SshOptions& ssh, const std::string& host,
                                 const std::string& remote_command) {
  std::vector<std::string> argv = {ssh.program, "-o", "BatchMode=yes", "-o",
                                   fmt::format("ConnectTimeout={}",
                                               std::max(1, static_cast<int>(ssh.connect_timeout_s + 0.5)))};
  if (!ssh.config_file.empty()) argv.insert(argv.end(), {"-F", ssh.config_file});
  if (ssh.port != 0) argv.insert(argv.end(), {"-p", std::to_string(ssh.port)});
  if (!ssh.identity.empty()) argv.insert(argv.end(), {"-i", ssh.identity});
  for (const auto& o : ssh.options) argv.insert(argv.end(), {"-o", o});
  argv.insert(argv.end(), {"-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-T",
                           "-x", "--", host, remote_command});
  return argv;
}

namespace {

// Preflight: `remote-probe` on every distinct host, in parallel. Each host's interfaces, free
// port and version, or one error naming every host that failed and why (nothing started).
std::map<std::string, HostInfo> Preflight(const SshOptions& ssh,
                                          const std::vector<Placement>& placement,
                                          const std::string& binary) {
  std::vector<std::string> hosts;
  for (const auto& p : placement) {
    if (std::find(hosts.begin(), hosts.end(), p.host) == hosts.end()) hosts.push_back(p.host);
  }
  const double probe_deadline_s = ssh.connect_timeout_s + kProbeSlackS;
  PSGD_LOG_INFO("pipesgd run: preflight: ssh to {} host(s) ({}), checking {}", hosts.size(),
                fmt::join(hosts, ", "), binary);
  const std::vector<Probe> probes =
      RunProbes(ssh, hosts, binary, Deadline::After(probe_deadline_s));
  std::map<std::string, HostInfo> info;
  std::vector<std::string> problems;
  for (const auto& p : probes) {
    const std::string err = Trimmed(p.err);
    if (p.timed_out) {
      problems.push_back(fmt::format("{}: no answer within {} s (ssh ConnectTimeout={} s){}",
                                     p.host, probe_deadline_s, ssh.connect_timeout_s,
                                     p.err.empty() ? "" : ": " + err));
      continue;
    }
    const int code = ExitCodeOf(*p.exit_status);
    if (code == 255) {
      problems.push_back(fmt::format("{}: ssh failed: {}", p.host, err));
    } else if (code == 127) {
      problems.push_back(fmt::format(
          "{}: no pipesgd binary at {} there ({}); install it at the same path, or pass "
          "--remote-binary PATH",
          p.host, binary, err));
    } else if (code == 126) {
      problems.push_back(fmt::format("{}: {} cannot be run there ({})", p.host, binary, err));
    } else if (code != 0) {
      problems.push_back(fmt::format("{}: `{} remote-probe` failed with status {}: {}", p.host,
                                     binary, code, err));
    } else if (auto parsed = ParseProbe(p.out); !parsed) {
      problems.push_back(fmt::format("{}: {} did not answer as pipesgd does (output: {})", p.host,
                                     binary, Trimmed(p.out)));
    } else if (parsed->version != PIPESGD_VERSION) {
      problems.push_back(fmt::format("{}: {} is pipesgd {}, this launcher is pipesgd {}; run the "
                                     "same version everywhere",
                                     p.host, binary, parsed->version, PIPESGD_VERSION));
    } else {
      info[p.host] = *parsed;
    }
  }
  if (!problems.empty()) {
    Throw(ErrorCode::kUnavailable,
          "preflight failed on {} of {} host(s); nothing was started:\n  {}",
          problems.size(), hosts.size(), fmt::join(problems, "\n  "));
  }
  return info;
}

// Where rank 0 will listen: --master-addr, else the address rank 0's host was reached at (or the
// one of its interfaces comm.network_interface picks); --master-port, else the host's free port.
std::pair<std::string, int> RendezvousOf(const RunArgs& args, const config::Job& job,
                                         const std::vector<Placement>& placement,
                                         const std::map<std::string, HostInfo>& info) {
  const HostInfo& lead = info.at(placement.front().host);
  std::string master_addr = args.master_addr;
  if (!args.master_addr_given) {
    master_addr = lead.server_address;
    const std::string& spec = job.comm().network_interface();
    if (!spec.empty()) {
      // The same choice rank 0's worker makes there, with the address ssh reached it at as the
      // route; the worker then listens on it.
      const char* source = "comm.network_interface";
      master_addr = transport::ChooseInterface(lead.interfaces,
                                               transport::ParseIfnameFilter(spec, source), source,
                                               "", lead.server_address)
                        .iface.ip;
    }
    if (master_addr.empty()) {
      Throw(ErrorCode::kInvalidArgument,
            "cannot tell the address of {} (rank 0's host): its ssh session has no "
            "SSH_CONNECTION; pass --master-addr",
            placement.front().host);
    }
    // A loopback address works only if every rank is on that same machine.
    if (master_addr.rfind("127.", 0) == 0 || master_addr == "::1") {
      for (const auto& [host, other] : info) {
        if (other.server_address.rfind("127.", 0) != 0 && other.server_address != "::1") {
          Throw(ErrorCode::kInvalidArgument,
                "rank 0's host {} was reached at {}, which {} cannot reach; name it in the host "
                "list as the other hosts can reach it, or pass --master-addr",
                placement.front().host, master_addr, host);
        }
      }
    }
  }
  int master_port = args.master_port;
  if (master_port == 0) master_port = lead.free_port;
  if (master_port == 0) {
    Throw(ErrorCode::kUnavailable,
          "found no free port on {} (rank 0's host); pass --master-port",
          placement.front().host);
  }
  return {master_addr, master_port};
}

// What every rank's `ssh HOST pipesgd remote-rank` reads on its stdin: the job (config text,
// worker flags, environment with the rendezvous and a fresh token).
std::vector<RankCommand> RemoteRankCommands(
    const RunArgs& args, const SshOptions& ssh, const std::vector<Placement>& placement,
    const std::string& binary, const std::string& config_text,
    const std::vector<std::pair<std::string, std::string>>& forwarded,
    const std::pair<std::string, int>& rendezvous) {
  const std::string token = RandomToken();
  std::vector<std::string> worker_args;
  for (const auto& o : args.overrides) worker_args.insert(worker_args.end(), {"--set", o});
  if (!args.out_dir.empty()) worker_args.insert(worker_args.end(), {"--out", args.out_dir});
  if (args.resume) worker_args.push_back("--resume");
  if (args.overwrite) worker_args.push_back("--overwrite");
  if (args.verbose) worker_args.push_back("--verbose");
  worker_args.insert(worker_args.end(), args.extra_worker_args.begin(), args.extra_worker_args.end());
  std::error_code ec;
  const std::string cwd = fs::current_path(ec).string();
  std::string config_name = fs::path(args.config_path).filename().string();
  if (config_name.empty() || config_name == "." || config_name == "..") config_name = "job.pbtxt";

  std::string rank_hosts;  // every rank's host, in rank order, for summary.json
  for (const auto& p : placement) rank_hosts += (rank_hosts.empty() ? "" : ",") + p.host;
  std::vector<RankCommand> commands;
  for (const auto& p : placement) {
    RemoteJob remote;
    remote.rank = p.rank;
    remote.host = p.host;
    remote.env = {forwarded.begin(), forwarded.end()};
    remote.env["RANK"] = std::to_string(p.rank);
    remote.env["WORLD_SIZE"] = std::to_string(args.num_processes);
    remote.env["LOCAL_RANK"] = std::to_string(p.local_rank);
    remote.env["LOCAL_WORLD_SIZE"] = std::to_string(p.local_world_size);
    remote.env["MASTER_ADDR"] = rendezvous.first;
    remote.env["MASTER_PORT"] = std::to_string(rendezvous.second);
    remote.env["PIPESGD_JOB_TOKEN"] = token;
    remote.env["PIPESGD_HOST"] = p.host;
    remote.env["PIPESGD_HOSTS"] = rank_hosts;
    if (!args.command_line.empty()) remote.env["PIPESGD_COMMAND_LINE"] = args.command_line;
    // As for local workers, unless -x or the host says otherwise (and results then match a
    // local run bit for bit).
    for (const auto& [var, value] : kRankThreadDefaults) remote.env_defaults[var] = value;
    remote.config_name = config_name;
    remote.config_text = config_text;
    remote.worker_args = worker_args;
    remote.program = args.program;
    remote.cwd = cwd;
    remote.kill_grace_s = kRemoteKillGraceS;

    RankCommand c;
    c.rank = p.rank;
    c.host = p.host;
    c.spec.argv = SshArgv(ssh, p.host, "exec " + ShellQuote(binary) + " remote-rank");
    c.spec.stdin_pipe = true;
    c.stdin_data = EncodeRemoteJob(remote);
    commands.push_back(std::move(c));
  }
  return commands;
}

}  // namespace

int RunOverSsh(const RunArgs& args, const SshOptions& ssh) {
  const std::vector<Placement> placement = PlaceRanks(ssh.hosts, args.num_processes);
  // Check the config here once; then ship its text, so it need not exist on the other hosts.
  // A program (`run -- PROGRAM`) must be at its path, or on PATH, on every host, as for mpirun.
  const bool program = !args.program.empty();
  const std::string config_text = program ? "" : ReadConfigText(args.config_path);
  const config::Job job = program ? config::Job() : job::LoadJobConfig(args.config_path, args.overrides);
  const auto forwarded = ResolveForwardedEnv(args.forward_env);
  const std::string binary = ssh.remote_binary.empty() ? SelfExe() : ssh.remote_binary;
  if (binary.empty() || binary.front() != '/') {
    Throw(ErrorCode::kInvalidArgument, "--remote-binary {}: expected an absolute path", binary);
  }
  if (ssh.connect_timeout_s <= 0) {
    Throw(ErrorCode::kInvalidArgument, "--ssh-connect-timeout {}: expected seconds > 0",
          ssh.connect_timeout_s);
  }
  const std::map<std::string, HostInfo> info = Preflight(ssh, placement, binary);
  const std::pair<std::string, int> rendezvous = RendezvousOf(args, job, placement, info);
  std::vector<RankCommand> commands =
      RemoteRankCommands(args, ssh, placement, binary, config_text, forwarded, rendezvous);
  std::vector<std::string> where;
  for (const auto& p : placement) where.push_back(fmt::format("{}:{}", p.rank, p.host));
  PSGD_LOG_INFO("pipesgd run: starting {} ranks over ssh (rank:host {}); rendezvous {}:{}",
                args.num_processes, fmt::join(where, " "), rendezvous.first, rendezvous.second);

  SuperviseOptions options;
  options.remote = true;
  options.stop_by_closing_stdin = true;
  options.close_grace_s = kCloseGraceS;
  options.kill_grace_s = kSshKillGraceS;
  options.host_in_prefix = args.verbose;
  options.output_dir = args.output_dir;
  return Supervise(std::move(commands), options);
}

}  // namespace pipesgd::launcher
