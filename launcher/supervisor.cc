// The supervisor of launcher/supervisor.h. Over 600 lines for a reason: the ranks' start, their
// streams, the launcher's signals, the stop sequence and the verdict all work on one Rank record
// and its helpers (Forward, Name, Describe), which nothing else uses; split into files they
// would all become header API.
#include "launcher/supervisor.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include "core/base/measure.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "core/job/config.h"
#include "core/job/worker.h"
#include "transport/failure_relay.h"

namespace pipesgd::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// Written by the signal handler, read by the poll loop (self-pipe trick).
int g_signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  const unsigned char s = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t ignored = write(g_signal_pipe[1], &s, 1);
}

// Installs the handlers for the lifetime of one Supervise call and restores the defaults after.
class SignalCatcher {
 public:
  SignalCatcher() {
    if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      Throw(ErrorCode::kIo, "pipe: {}", std::strerror(errno));
    }
    struct sigaction sa{};
    sa.sa_handler = OnSignal;
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGHUP, &sa, nullptr);
    // A closed stdout shows up as a failed write, handled below, not as a silent death.
    signal(SIGPIPE, SIG_IGN);
  }
  ~SignalCatcher() {
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    close(g_signal_pipe[0]);
    close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }
  SignalCatcher(const SignalCatcher&) = delete;
  SignalCatcher& operator=(const SignalCatcher&) = delete;
  int fd() const { return g_signal_pipe[0]; }
};

// Reserves a port for the rendezvous (`port` 0: a free one; else that one, which must be free): a
// socket bound with SO_REUSEADDR but not listening.
// While it stays open the kernel hands the port to no outgoing connection, yet rank 0 can still
// bind and listen on it (also with SO_REUSEADDR). Closing a probe socket instead would leave a
// window in which any connection on the machine could take the port.
struct ReservedPort {
  int fd = -1;
  uint16_t port = 0;
  ~ReservedPort() {
    if (fd >= 0) close(fd);
  }
};

void ReservePort(const std::string& addr, uint16_t port, ReservedPort* reserved) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  if (inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) {
    if (port != 0) return;  // a host name: rank 0 resolves it, and fails clearly if it must
    Throw(ErrorCode::kInvalidArgument,
          "--master-addr {}: expected a numeric IPv4 address of this machine when no "
          "--master-port is given",
          addr);
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    const int err = errno;
    if (fd >= 0) close(fd);
    if (port != 0 && err == EADDRINUSE) {
      Throw(ErrorCode::kUnavailable,
            "--master-port {}: the port is in use on {} (another job or program holds it); no "
            "rank was started. Pick another port, or leave --master-port out for a free one",
            port, addr);
    }
    if (port != 0) {
      Throw(ErrorCode::kIo, "--master-port {}: cannot bind it on {}: {}", port, addr,
            std::strerror(err));
    }
    Throw(ErrorCode::kIo, "cannot reserve a port on {}: {}", addr, std::strerror(err));
  }
  socklen_t len = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  reserved->fd = fd;
  reserved->port = ntohs(sa.sin_port);
}

void CloseFd(int* fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

// One running rank, its streams and what became of it.
struct Rank {
  RankCommand command;
  Child child;
  size_t stdin_written = 0;
  std::string out_partial;
  std::string err_partial;
  std::string err_tail;  // the last few KiB of its stderr: which rank its error blames
  int out_file = -1;  // --log-dir files
  int err_file = -1;
  std::optional<int> status;

  ~Rank() {
    CloseFd(&child.stdin_fd);
    CloseFd(&child.out_fd);
    CloseFd(&child.err_fd);
    CloseFd(&out_file);
    CloseFd(&err_file);
  }
};

// Prefixes complete lines of `data` and writes them to `fd`; keeps the remainder. Returns false
// if `fd` is closed (e.g. `pipesgd run ... | head`).
bool Forward(const std::string& prefix, std::string& partial, const char* data, size_t n, int fd,
             bool flush_all) {
  partial.append(data, n);
  size_t start = 0;
  std::string out;
  while (true) {
    size_t nl = partial.find('\n', start);
    if (nl == std::string::npos) break;
    out += prefix;
    out.append(partial, start, nl + 1 - start);
    start = nl + 1;
  }
  partial.erase(0, start);
  if (flush_all && !partial.empty()) {
    out += prefix + partial + "\n";
    partial.clear();
  }
  return WriteAll(fd, out.data(), out.size());
}

// "rank 1 (pid 1234)" for a local rank, "rank 2 on lab2" for a remote one.
std::string Name(const Rank& r) {
  if (r.command.host.empty()) return fmt::format("rank {} (pid {})", r.command.rank, r.child.pid);
  return fmt::format("rank {} on {}", r.command.rank, r.command.host);
}

bool RemoteSignalStatus(int code) { return code > 128 && code <= 128 + 64; }

// What a rank's end means, in words.
std::string Describe(const Rank& r, int status, bool remote) {
  if (!remote || !WIFEXITED(status)) {
    std::string what = DescribeWaitStatus(status);
    if (remote) what = "(its ssh) " + what;
    return what;
  }
  const int code = WEXITSTATUS(status);
  if (code == 255) {
    return fmt::format("exited with status 255: ssh failed or lost the connection to {} (see "
                       "ssh's message above)",
                       r.command.host);
  }
  if (RemoteSignalStatus(code)) {
    return fmt::format("exited with status {}: its worker was killed by signal {} ({})", code,
                       code - 128, strsignal(code - 128));
  }
  if (code == job::kExitBecauseOfAnotherRank) {
    return fmt::format("exited with status {} (it failed because of another rank)", code);
  }
  return fmt::format("exited with status {}", code);
}

// A death that is the likely cause of the others' failures: a signal, or (over ssh) a lost host.
bool IsRootCause(int status, bool remote) {
  if (WIFSIGNALED(status)) return true;
  if (!remote || !WIFEXITED(status)) return false;
  const int code = WEXITSTATUS(status);
  return code == 255 || RemoteSignalStatus(code);
}

}  // namespace

std::vector<std::pair<std::string, std::string>> ResolveForwardedEnv(
    const std::vector<std::string>& entries) {
  static const char* const kReserved[] = {"RANK",        "WORLD_SIZE",  "LOCAL_RANK",
                                          "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                          "PIPESGD_JOB_TOKEN", "PIPESGD_HOST", "PIPESGD_HOSTS",
                                          "PIPESGD_COMMAND_LINE"};
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& entry : entries) {
    const size_t eq = entry.find('=');
    const std::string name = entry.substr(0, eq);
    bool valid = !name.empty() && !(name[0] >= '0' && name[0] <= '9');
    for (char c : name) {
      valid &= (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
    }
    if (!valid) {
      Throw(ErrorCode::kInvalidArgument,
            "-x {}: expected NAME or NAME=VALUE, NAME of letters, digits and _", entry);
    }
    for (const char* reserved : kReserved) {
      if (name == reserved) {
        Throw(ErrorCode::kInvalidArgument,
              "-x {}: {} is set by pipesgd run for every rank and cannot be forwarded", entry,
              name);
      }
    }
    if (eq != std::string::npos) {
      out.emplace_back(name, entry.substr(eq + 1));
      continue;
    }
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) {
      Throw(ErrorCode::kInvalidArgument,
            "-x {}: {} is not set in the launcher's environment (give -x {}=VALUE to set it)",
            entry, name, name);
    }
    out.emplace_back(name, value);
  }
  return out;
}

namespace {

// Creates --log-dir's rank.R/stdout and stderr for every rank.
void OpenLogFiles(std::vector<Rank>& ranks, const std::string& output_dir) {
  for (auto& r : ranks) {
    const auto dir = std::filesystem::path(output_dir) / fmt::format("rank.{}", r.command.rank);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      Throw(ErrorCode::kIo, "--log-dir {}: cannot create {}: {}", output_dir, dir.string(),
            ec.message());
    }
    for (auto [file, name] : {std::pair{&r.out_file, "stdout"}, std::pair{&r.err_file, "stderr"}}) {
      const auto path = dir / name;
      *file = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (*file < 0) {
        Throw(ErrorCode::kIo, "--log-dir: cannot write {}: {}", path.string(),
              std::strerror(errno));
      }
    }
  }
}

// Starts every rank; if one cannot start, kills those already started and rethrows.
void StartRanks(std::vector<Rank>& ranks) {
  for (auto& r : ranks) {
    try {
      r.child = SpawnChild(r.command.spec, fmt::format("rank {}", r.command.rank));
    } catch (const Error&) {
      for (auto& started : ranks) {
        if (started.child.pid <= 0) continue;
        kill(-started.child.pid, SIGKILL);
        kill(started.child.pid, SIGKILL);
        waitpid(started.child.pid, nullptr, 0);
      }
      throw;
    }
    if (r.child.stdin_fd >= 0) {
      fcntl(r.child.stdin_fd, F_SETFL, fcntl(r.child.stdin_fd, F_GETFL) | O_NONBLOCK);
    }
  }
}

// One supervised run of started ranks: their exits, their streams, the launcher's signals, and
// the stop sequence once one fails (a settle window, then stop: SIGTERM, or closing stdin then
// SIGTERM; SIGKILL after the grace).
class Supervision {
 public:
  Supervision(std::vector<Rank>& ranks, const SuperviseOptions& options, int signal_fd)
      : ranks_(ranks), options_(options), signal_fd_(signal_fd) {}

  // Until every rank has exited and its output is drained; returns the launcher's exit code.
  int Run() {
    while (true) {
      Reap();
      if (settle_until_ && !stop_sent_ && Clock::now() >= *settle_until_) {
        int running = 0;
        for (auto& r : ranks_) running += !r.status;
        if (running > 0) PSGD_LOG_ERROR("pipesgd run: stopping the other {} rank(s)", running);
        StopAll();
      }
      if (Finished()) break;
      Escalate();
      PollOnce();
    }
    return Verdict();
  }

 private:
  // The rank whose failure decides the exit code, chosen among those that failed on their own
  // (before the launcher stopped anyone).
  struct Failure {
    int index;
    int status;
  };

  void Reap() {
    for (size_t i = 0; i < ranks_.size(); ++i) {
      Rank& r = ranks_[i];
      if (r.status) continue;
      int status = 0;
      if (waitpid(r.child.pid, &status, WNOHANG) != r.child.pid) continue;
      r.status = status;
      CloseFd(&r.child.stdin_fd);
      if (ExitCodeOf(status) == 0 || stop_sent_) continue;
      failures_.push_back({static_cast<int>(i), status});
      PSGD_LOG_ERROR("pipesgd run: {} {}", Name(r), Describe(r, status, options_.remote));
      if (!settle_until_) {
        settle_until_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(options_.settle_s));
      }
    }
  }

  bool Finished() const {
    for (const auto& r : ranks_) {
      if (!r.status || r.child.out_fd >= 0 || r.child.err_fd >= 0) return false;
    }
    return true;
  }

  void SignalAll(int sig) {
    for (auto& r : ranks_) {
      if (r.status) continue;
      if (r.command.spec.own_process_group) kill(-r.child.pid, sig);
      kill(r.child.pid, sig);
      // A stopped rank (SIGSTOP, a debugger) would hold SIGTERM pending until SIGKILL: resume
      // it so it can stop now (as systemd does).
      if (sig == SIGTERM) {
        if (r.command.spec.own_process_group) kill(-r.child.pid, SIGCONT);
        kill(r.child.pid, SIGCONT);
      }
    }
  }

  void StopAll() {
    if (stop_sent_) return;
    stop_sent_ = Clock::now();
    if (options_.stop_by_closing_stdin) {
      for (auto& r : ranks_) CloseFd(&r.child.stdin_fd);
    } else {
      SignalAll(SIGTERM);
    }
  }

  // After a stop: SIGTERM once the ranks had close_grace_s to leave on a closed stdin, SIGKILL
  // after kill_grace_s more.
  void Escalate() {
    if (!stop_sent_) return;
    const double since = SecondsSince(*stop_sent_);
    if (options_.stop_by_closing_stdin) {
      if (escalation_ == 0 && since > options_.close_grace_s) {
        SignalAll(SIGTERM);
        escalation_ = 1;
      } else if (escalation_ == 1 && since > options_.close_grace_s + options_.kill_grace_s) {
        SignalAll(SIGKILL);
        escalation_ = 2;
      }
    } else if (escalation_ < 2 && since > options_.kill_grace_s) {
      SignalAll(SIGKILL);
      escalation_ = 2;
    }
  }

  // Up to 50 ms for the launcher's signals and the ranks' stdin, stdout and stderr.
  void PollOnce() {
    std::vector<pollfd> fds = {{signal_fd_, POLLIN, 0}};
    std::vector<std::pair<Rank*, int>> owners = {{nullptr, 0}};  // 0 stdin, 1 stdout, 2 stderr
    for (auto& r : ranks_) {
      if (r.child.stdin_fd >= 0 && r.stdin_written < r.command.stdin_data.size()) {
        fds.push_back({r.child.stdin_fd, POLLOUT, 0});
        owners.push_back({&r, 0});
      }
      if (r.child.out_fd >= 0) {
        fds.push_back({r.child.out_fd, POLLIN, 0});
        owners.push_back({&r, 1});
      }
      if (r.child.err_fd >= 0) {
        fds.push_back({r.child.err_fd, POLLIN, 0});
        owners.push_back({&r, 2});
      }
    }
    poll(fds.data(), fds.size(), 50);
    if (fds[0].revents & POLLIN) {
      unsigned char sig = 0;
      if (read(signal_fd_, &sig, 1) == 1 && !stop_sent_) {
        PSGD_LOG_WARN("pipesgd run: got signal {} ({}); stopping all ranks", sig, strsignal(sig));
        stopped_by_signal_ = sig;
        StopAll();
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLOUT | POLLHUP | POLLERR))) continue;
      if (owners[i].second == 0) {
        FeedStdin(*owners[i].first);
      } else {
        Drain(*owners[i].first, owners[i].second == 1);
      }
    }
  }

  void FeedStdin(Rank& r) {
    if (r.child.stdin_fd < 0) return;
    const std::string& data = r.command.stdin_data;
    const ssize_t w =
        write(r.child.stdin_fd, data.data() + r.stdin_written, data.size() - r.stdin_written);
    if (w > 0) r.stdin_written += static_cast<size_t>(w);
    // The reader is gone (ssh failed): its exit tells why.
    if (w < 0 && errno != EAGAIN && errno != EINTR) r.stdin_written = data.size();
  }

  // One read of a rank's stdout or stderr, forwarded with its prefix (and to --log-dir).
  void Drain(Rank& r, bool out) {
    int& fd = out ? r.child.out_fd : r.child.err_fd;
    if (fd < 0) return;
    char buf[65536];
    const ssize_t got = read(fd, buf, sizeof(buf));
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) return;
    std::string& partial = out ? r.out_partial : r.err_partial;
    const int sink = out ? STDOUT_FILENO : STDERR_FILENO;
    const int file = out ? r.out_file : r.err_file;
    const std::string prefix =
        out && !options_.prefix_stdout ? std::string()
        : options_.host_in_prefix && !r.command.host.empty()
            ? fmt::format("[rank {} {}] ", r.command.rank, r.command.host)
            : fmt::format("[rank {}] ", r.command.rank);
    bool written = true;
    if (got > 0 && !out) {
      r.err_tail.append(buf, static_cast<size_t>(got));
      if (r.err_tail.size() > 8192) r.err_tail.erase(0, r.err_tail.size() - 8192);
    }
    if (got > 0) {
      if (file >= 0) WriteAll(file, buf, static_cast<size_t>(got));
      written = Forward(prefix, partial, buf, static_cast<size_t>(got), sink, false);
    } else {
      written = Forward(prefix, partial, buf, 0, sink, true);
      CloseFd(&fd);
    }
    if (!written && !stop_sent_ && !output_closed_) {
      output_closed_ = true;
      StopAll();
    }
  }

  // The exit code, and the line that names the failure.
  int Verdict() const {
    if (!failures_.empty()) return FailureVerdict();
    if (stopped_by_signal_) {
      PSGD_LOG_ERROR("pipesgd run: interrupted by signal {} ({}); all ranks stopped",
                     *stopped_by_signal_, strsignal(*stopped_by_signal_));
      return 128 + *stopped_by_signal_;
    }
    if (output_closed_) {
      PSGD_LOG_ERROR("pipesgd run: output closed; all ranks stopped");
      return 128 + SIGPIPE;
    }
    PSGD_LOG_INFO("pipesgd run: all {} {} finished", ranks_.size(),
                  options_.remote ? "ranks" : "workers");
    return 0;
  }

  // The first root cause (a signal, a lost host), else the first rank that failed on its own
  // (not because of another rank), else the first failure.
  int FailureVerdict() const {
    Failure chosen = failures_.front();
    for (const auto& f : failures_) {
      if (ExitCodeOf(f.status) != job::kExitBecauseOfAnotherRank) {
        chosen = f;
        break;
      }
    }
    for (const auto& f : failures_) {
      if (IsRootCause(f.status, options_.remote)) {
        chosen = f;
        break;
      }
    }
    const Rank& r = ranks_[chosen.index];
    // Every rank that failed did so because of another one: the one their errors name (the
    // failure relay makes them agree) is the failure, even if it never exited on its own (a
    // stopped or hung rank the launcher had to stop).
    if (ExitCodeOf(chosen.status) == job::kExitBecauseOfAnotherRank) {
      const int blamed = transport::FailureRelay::BlamedRankIn(r.err_tail);
      const auto it = std::find_if(ranks_.begin(), ranks_.end(),
                                   [&](const Rank& x) { return x.command.rank == blamed; });
      if (it != ranks_.end()) {
        PSGD_LOG_ERROR("pipesgd run: failed: {} (named by every rank that failed: {} {})",
                       Name(*it), Name(r), Describe(r, chosen.status, options_.remote));
        return ExitCodeOf(chosen.status);
      }
    }
    PSGD_LOG_ERROR("pipesgd run: failed: {} {}", Name(r),
                   Describe(r, chosen.status, options_.remote));
    return ExitCodeOf(chosen.status);
  }

  std::vector<Rank>& ranks_;
  const SuperviseOptions& options_;
  const int signal_fd_;
  std::vector<Failure> failures_;
  std::optional<Clock::time_point> settle_until_;
  std::optional<int> stopped_by_signal_;  // the signal that stopped the launcher
  bool output_closed_ = false;
  std::optional<Clock::time_point> stop_sent_;
  int escalation_ = 0;  // 0: stop requested; 1: SIGTERM sent (stdin mode); 2: SIGKILL sent
};

}  // namespace

int Supervise(std::vector<RankCommand> commands, const SuperviseOptions& options) {
  SignalCatcher signals;
  std::vector<Rank> ranks(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) ranks[i].command = std::move(commands[i]);
  if (!options.output_dir.empty()) OpenLogFiles(ranks, options.output_dir);
  StartRanks(ranks);
  return Supervision(ranks, options, signals.fd()).Run();
}

int RunLocal(const RunArgs& args) {
  if (args.num_processes < 1 || args.num_processes > 1024) {
    Throw(ErrorCode::kInvalidArgument, "-np {}: expected a number of processes in [1, 1024]",
          args.num_processes);
  }
  // Check the config once here, so a mistake is reported once and not by every worker.
  if (args.worker_command.empty() && args.program.empty()) {
    const config::Job job = job::LoadJobConfig(args.config_path, args.overrides);
    job::CheckLocalGpus(job, args.num_processes);  // here, not once per rank after its start
  }
  if (!args.out_dir.empty()) {
    job::CheckOutDirIsFree(args.out_dir, args.overwrite || args.resume);  // before any rank starts
    std::error_code ec;
    std::filesystem::create_directories(args.out_dir, ec);
    if (ec) Throw(ErrorCode::kIo, "--out {}: cannot create the directory: {}", args.out_dir, ec.message());
  }
  const auto forwarded = ResolveForwardedEnv(args.forward_env);

  const std::string exe = SelfExe();
  ReservedPort reserved;  // held until every worker has exited
  uint16_t port = static_cast<uint16_t>(args.master_port);
  if (port == 0) {
    ReservePort(args.master_addr, 0, &reserved);
    port = reserved.port;
  } else {
    // An explicit port is checked (and held) before any rank starts: with a stranger listening
    // there, the ranks would knock at its door instead of rank 0's.
    ReservePort(args.master_addr, port, &reserved);
  }
  const std::string token = RandomToken();

  std::vector<std::string> argv = {exe};
  if (!args.program.empty()) {
    argv = args.program;
    argv[0] = FindProgram(argv[0]);  // a missing program is one error here, not N from the ranks
  } else if (!args.worker_command.empty()) {
    argv.insert(argv.end(), args.worker_command.begin(), args.worker_command.end());
  } else {
    argv.insert(argv.end(), {"worker", args.config_path});
    for (const auto& o : args.overrides) {
      argv.push_back("--set");
      argv.push_back(o);
    }
    if (!args.out_dir.empty()) {
      argv.push_back("--out");
      argv.push_back(args.out_dir);
    }
    if (args.resume) argv.push_back("--resume");
    if (args.overwrite) argv.push_back("--overwrite");
    if (args.verbose) argv.push_back("--verbose");
    argv.insert(argv.end(), args.extra_worker_args.begin(), args.extra_worker_args.end());
  }
  const std::string host = RankHost();
  std::string hosts;  // every rank's host, in rank order, for summary.json
  for (int r = 0; r < args.num_processes; ++r) hosts += (r ? "," : "") + host;
  std::vector<RankCommand> commands;
  for (int r = 0; r < args.num_processes; ++r) {
    RankCommand c;
    c.rank = r;
    c.spec.argv = argv;
    c.spec.env = forwarded;
    c.spec.env.insert(c.spec.env.end(),
                      {{"RANK", std::to_string(r)},
                       {"LOCAL_RANK", std::to_string(r)},
                       {"WORLD_SIZE", std::to_string(args.num_processes)},
                       {"LOCAL_WORLD_SIZE", std::to_string(args.num_processes)},
                       {"MASTER_ADDR", args.master_addr},
                       {"MASTER_PORT", std::to_string(port)},
                       {"PIPESGD_JOB_TOKEN", token},
                       {"PIPESGD_HOSTS", hosts}});
    if (!args.command_line.empty()) c.spec.env.emplace_back("PIPESGD_COMMAND_LINE", args.command_line);
    c.spec.env_defaults = kRankThreadDefaults;
    commands.push_back(std::move(c));
  }
  PSGD_LOG_INFO("pipesgd run: starting {} {} (rendezvous {}:{})", args.num_processes,
                args.program.empty() ? "workers" : "ranks of " + argv[0], args.master_addr, port);
  std::string defaulted;
  for (const auto& [var, value] : kRankThreadDefaults) {
    if (std::getenv(var.c_str()) == nullptr) {
      defaulted += fmt::format("{}{}={}", defaulted.empty() ? "" : ", ", var, value);
    }
  }
  if (!defaulted.empty()) {
    PSGD_LOG_INFO("pipesgd run: {} for every worker (unset here; export a value to give each "
                  "worker more threads)",
                  defaulted);
  }
  SuperviseOptions options;
  options.kill_grace_s = args.kill_grace_s;
  options.output_dir = args.output_dir;
  options.prefix_stdout = args.prefix_stdout;
  return Supervise(std::move(commands), options);
}

}  // namespace pipesgd::launcher
