#include "launcher/supervisor.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <optional>

#include "core/base/error.h"
#include "core/base/log.h"
#include "launcher/config.h"

namespace pipesgd::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// Written by the signal handler, read by the poll loop (self-pipe trick).
int g_signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  const unsigned char s = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t ignored = write(g_signal_pipe[1], &s, 1);
}

// Reserves a free port for the rendezvous: a socket bound with SO_REUSEADDR but not listening.
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

void ReservePort(const std::string& addr, ReservedPort* reserved) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  if (inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) {
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
    Throw(ErrorCode::kIo, "cannot reserve a port on {}: {}", addr, std::strerror(err));
  }
  socklen_t len = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  reserved->fd = fd;
  reserved->port = ntohs(sa.sin_port);
}

std::string SelfExe() {
  std::error_code ec;
  auto path = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) Throw(ErrorCode::kIo, "cannot find this program's path: {}", ec.message());
  return path.string();
}

std::string DescribeStatus(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  }
  return fmt::format("ended with wait status {}", status);
}

int ExitCodeOf(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// One worker process and its two output streams.
struct Worker {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;
  int err_fd = -1;
  std::string out_partial;
  std::string err_partial;
  std::optional<int> status;
};

// Prefixes complete lines of `data` with the rank and writes them to `fd`; keeps the remainder.
// Returns false if `fd` is closed (e.g. `pipesgd run ... | head`).
bool Forward(int rank, std::string& partial, const char* data, size_t n, int fd, bool flush_all) {
  partial.append(data, n);
  size_t start = 0;
  std::string out;
  while (true) {
    size_t nl = partial.find('\n', start);
    if (nl == std::string::npos) break;
    out += fmt::format("[rank {}] ", rank);
    out.append(partial, start, nl + 1 - start);
    start = nl + 1;
  }
  partial.erase(0, start);
  if (flush_all && !partial.empty()) {
    out += fmt::format("[rank {}] {}\n", rank, partial);
    partial.clear();
  }
  size_t done = 0;
  while (done < out.size()) {
    ssize_t w = write(fd, out.data() + done, out.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    done += static_cast<size_t>(w);
  }
  return true;
}

pid_t SpawnWorker(const std::string& exe, const RunArgs& args, int rank, uint16_t port,
                  int out_fd, int err_fd) {
  std::vector<std::string> argv = {exe};
  if (!args.worker_command.empty()) {
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
    if (args.verbose) argv.push_back("--verbose");
  }
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const std::string rank_s = std::to_string(rank);
  const std::string world_s = std::to_string(args.num_processes);
  const std::string port_s = std::to_string(port);

  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) Throw(ErrorCode::kIo, "cannot start rank {}: fork: {}", rank, std::strerror(errno));
  if (pid == 0) {
    // If the launcher dies without stopping us (kill -9, a closed terminal), stop too; the
    // getppid() check closes the race with a launcher that died before prctl.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    dup2(out_fd, STDOUT_FILENO);
    dup2(err_fd, STDERR_FILENO);
    setenv("RANK", rank_s.c_str(), 1);
    setenv("LOCAL_RANK", rank_s.c_str(), 1);
    setenv("WORLD_SIZE", world_s.c_str(), 1);
    setenv("MASTER_ADDR", args.master_addr.c_str(), 1);
    setenv("MASTER_PORT", port_s.c_str(), 1);
    // N workers share this machine's cores: one BLAS thread each unless the user says otherwise.
    setenv("OPENBLAS_NUM_THREADS", "1", 0);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    execv(exe.c_str(), cargv.data());
    fprintf(stderr, "cannot exec %s: %s\n", exe.c_str(), strerror(errno));
    _exit(127);
  }
  return pid;
}

}  // namespace

int RunLocal(const RunArgs& args) {
  if (args.num_processes < 1 || args.num_processes > 1024) {
    Throw(ErrorCode::kInvalidArgument, "-np {}: expected a number of processes in [1, 1024]",
          args.num_processes);
  }
  // Check the config once here, so a mistake is reported once and not by every worker.
  if (args.worker_command.empty()) LoadJobConfig(args.config_path, args.overrides);
  if (!args.out_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(args.out_dir, ec);
    if (ec) Throw(ErrorCode::kIo, "--out {}: cannot create the directory: {}", args.out_dir, ec.message());
  }

  const std::string exe = SelfExe();
  ReservedPort reserved;  // held until every worker has exited
  uint16_t port = static_cast<uint16_t>(args.master_port);
  if (port == 0) {
    ReservePort(args.master_addr, &reserved);
    port = reserved.port;
  }
  if (pipe2(g_signal_pipe, O_CLOEXEC) != 0) Throw(ErrorCode::kIo, "pipe: {}", std::strerror(errno));
  struct sigaction sa{};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
  // A closed stdout shows up as a failed write, handled below, not as a silent death.
  signal(SIGPIPE, SIG_IGN);

  std::vector<Worker> workers(args.num_processes);
  for (int r = 0; r < args.num_processes; ++r) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
      Throw(ErrorCode::kIo, "pipe: {}", std::strerror(errno));
    }
    workers[r].rank = r;
    workers[r].pid = SpawnWorker(exe, args, r, port, out[1], err[1]);
    close(out[1]);
    close(err[1]);
    workers[r].out_fd = out[0];
    workers[r].err_fd = err[0];
  }
  PSGD_LOG_INFO("pipesgd run: started {} workers (rendezvous {}:{})", args.num_processes,
                args.master_addr, port);

  // The first failure decides the exit code; after it everyone else is stopped.
  std::optional<std::pair<int, int>> first_failure;  // rank, wait status
  std::optional<std::string> stop_reason;
  Clock::time_point term_sent{};
  bool killed = false;

  auto stop_all = [&](const std::string& reason) {
    if (stop_reason) return;
    stop_reason = reason;
    term_sent = Clock::now();
    for (auto& w : workers) {
      if (!w.status) kill(w.pid, SIGTERM);
    }
  };

  while (true) {
    // Reap exits.
    for (auto& w : workers) {
      if (w.status) continue;
      int status = 0;
      if (waitpid(w.pid, &status, WNOHANG) == w.pid) {
        w.status = status;
        if (ExitCodeOf(status) != 0 && !first_failure && !stop_reason) {
          first_failure = {w.rank, status};
          PSGD_LOG_ERROR("pipesgd run: rank {} (pid {}) {}; stopping the other workers", w.rank,
                         w.pid, DescribeStatus(status));
          stop_all(fmt::format("rank {} failed", w.rank));
        }
      }
    }
    bool all_exited = true;
    bool streams_open = false;
    for (auto& w : workers) {
      all_exited &= w.status.has_value();
      streams_open |= w.out_fd >= 0 || w.err_fd >= 0;
    }
    if (all_exited && !streams_open) break;
    if (stop_reason && !killed &&
        std::chrono::duration<double>(Clock::now() - term_sent).count() > args.kill_grace_s) {
      for (auto& w : workers) {
        if (!w.status) kill(w.pid, SIGKILL);
      }
      killed = true;
    }

    std::vector<pollfd> fds = {{g_signal_pipe[0], POLLIN, 0}};
    for (auto& w : workers) {
      if (w.out_fd >= 0) fds.push_back({w.out_fd, POLLIN, 0});
      if (w.err_fd >= 0) fds.push_back({w.err_fd, POLLIN, 0});
    }
    poll(fds.data(), fds.size(), 100);
    if (fds[0].revents & POLLIN) {
      unsigned char sig = 0;
      if (read(g_signal_pipe[0], &sig, 1) == 1) {
        PSGD_LOG_WARN("pipesgd run: got signal {} ({}); stopping all workers", sig, strsignal(sig));
        if (!first_failure) first_failure = {-1, (128 + sig) << 8};
        stop_all(fmt::format("interrupted by signal {} ({})", sig, strsignal(sig)));
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      for (auto& w : workers) {
        const bool is_out = fds[i].fd == w.out_fd;
        const bool is_err = fds[i].fd == w.err_fd;
        if (!is_out && !is_err) continue;
        char buf[65536];
        ssize_t n = read(fds[i].fd, buf, sizeof(buf));
        std::string& partial = is_out ? w.out_partial : w.err_partial;
        const int sink = is_out ? STDOUT_FILENO : STDERR_FILENO;
        bool written = true;
        if (n > 0) {
          written = Forward(w.rank, partial, buf, static_cast<size_t>(n), sink, false);
        } else {
          written = Forward(w.rank, partial, buf, 0, sink, true);
          close(fds[i].fd);
          (is_out ? w.out_fd : w.err_fd) = -1;
        }
        if (!written && !stop_reason) {
          if (!first_failure) first_failure = {-1, (128 + SIGPIPE) << 8};
          stop_all(is_out ? "stdout closed" : "stderr closed");
        }
      }
    }
  }
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGHUP, SIG_DFL);
  close(g_signal_pipe[0]);
  close(g_signal_pipe[1]);

  if (first_failure) {
    const auto [rank, status] = *first_failure;
    if (rank < 0) {
      PSGD_LOG_ERROR("pipesgd run: {}; all workers stopped", *stop_reason);
      return ExitCodeOf(status);
    }
    PSGD_LOG_ERROR("pipesgd run: failed: rank {} {}", rank, DescribeStatus(status));
    return ExitCodeOf(status);
  }
  PSGD_LOG_INFO("pipesgd run: all {} workers finished", args.num_processes);
  return 0;
}

}  // namespace pipesgd::launcher
