#include "launcher/remote_rank.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>

#include <nlohmann/json.hpp>

#include "core/base/deadline.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "launcher/process.h"
#include "transport/ifname.h"

namespace pipesgd::launcher {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr double kJobReadTimeoutS = 60;
constexpr size_t kMaxJobBytes = 64 << 20;

int g_signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  const unsigned char s = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t ignored = write(g_signal_pipe[1], &s, 1);
}

// A private temporary directory, removed with everything in it when this goes away.
class TempDir {
 public:
  explicit TempDir(const std::string& stem) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = fmt::format("{}/{}-XXXXXX", tmp && *tmp ? tmp : "/tmp", stem);
    if (mkdtemp(pattern.data()) == nullptr) {
      Throw(ErrorCode::kIo, "cannot make a temporary directory {}: {}", pattern,
            std::strerror(errno));
    }
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Reads one line from fd 0 within the deadline; the rest of stdin stays unread.
std::string ReadJobLine(Deadline deadline) {
  std::string line;
  while (true) {
    const double left = deadline.remaining_s();
    if (left <= 0) {
      Throw(ErrorCode::kDeadlineExceeded,
            "remote-rank: no job on stdin within {} s (this subcommand is what `pipesgd run -H` "
            "runs over ssh; it is not meant to be started by hand)",
            kJobReadTimeoutS);
    }
    pollfd p{STDIN_FILENO, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(std::min(left, 1.0) * 1000) + 1);
    if (ready <= 0) continue;
    char c;
    const ssize_t n = read(STDIN_FILENO, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Throw(ErrorCode::kUnavailable, "remote-rank: stdin closed before the whole job arrived "
                                     "({} bytes)", line.size());
    }
    if (c == '\n') return line;
    line += c;
    if (line.size() > kMaxJobBytes) {
      Throw(ErrorCode::kDataLoss, "remote-rank: the job on stdin exceeds {} bytes", kMaxJobBytes);
    }
  }
}

void WriteConfig(const fs::path& path, const std::string& text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 || !WriteAll(fd, text.data(), text.size())) {
    const int e = errno;
    if (fd >= 0) close(fd);
    Throw(ErrorCode::kIo, "remote-rank: cannot write the shipped config {}: {}", path.string(),
          std::strerror(e));
  }
  close(fd);
}

// A TCP port that nothing listens on here, below the ephemeral range; 0 if none is found.
int FindFreePort() {
  int lo = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> lo;
  std::mt19937 random(std::random_device{}());
  const int first = 20000;
  const bool below = lo - first >= 1000;
  std::uniform_int_distribution<int> pick(below ? first : 1024, below ? lo - 1 : 65535);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = pick(random);
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return 0;
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
    close(fd);
    if (ok) return port;
  }
  return 0;
}

}  // namespace

std::string EncodeRemoteJob(const RemoteJob& job) {
  nlohmann::json j = {{"format", 1},
                      {"rank", job.rank},
                      {"host", job.host},
                      {"env", job.env},
                      {"env_defaults", job.env_defaults},
                      {"config_name", job.config_name},
                      {"config", job.config_text},
                      {"worker_args", job.worker_args},
                      {"program", job.program},
                      {"cwd", job.cwd},
                      {"kill_grace_s", job.kill_grace_s}};
  // dump() escapes control characters, so the line holds no newline; invalid UTF-8 (a config
  // is text, but be safe) is replaced rather than thrown on.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

RemoteJob DecodeRemoteJob(const std::string& line) {
  try {
    const auto j = nlohmann::json::parse(line);
    if (j.at("format").get<int>() != 1) {
      Throw(ErrorCode::kDataLoss, "remote-rank: job format {} is not 1 (a different pipesgd "
                                  "version launched this)", j.at("format").dump());
    }
    RemoteJob job;
    job.rank = j.at("rank").get<int>();
    job.host = j.at("host").get<std::string>();
    job.env = j.at("env").get<std::map<std::string, std::string>>();
    job.env_defaults = j.at("env_defaults").get<std::map<std::string, std::string>>();
    job.config_name = j.at("config_name").get<std::string>();
    job.config_text = j.at("config").get<std::string>();
    job.worker_args = j.at("worker_args").get<std::vector<std::string>>();
    job.program = j.at("program").get<std::vector<std::string>>();
    job.cwd = j.at("cwd").get<std::string>();
    job.kill_grace_s = j.at("kill_grace_s").get<double>();
    if (job.program.empty() &&
        (job.config_name.empty() || job.config_name.find('/') != std::string::npos ||
         job.config_name == "." || job.config_name == "..")) {
      Throw(ErrorCode::kDataLoss, "remote-rank: bad config file name '{}'", job.config_name);
    }
    return job;
  } catch (const nlohmann::json::exception& e) {
    Throw(ErrorCode::kDataLoss, "remote-rank: malformed job on stdin: {}", e.what());
  }
}

int RunRemoteProbe() {
  std::string out = "probe 1\nversion " PIPESGD_VERSION "\n";
  if (const char* c = std::getenv("SSH_CONNECTION"); c && *c) out += fmt::format("ssh_connection {}\n", c);
  for (const auto& i : transport::ListNetInterfaces()) {
    out += fmt::format("interface {} {}/{}\n", i.name, i.ip, i.prefix_len);
  }
  out += fmt::format("free_port {}\n", FindFreePort());
  return WriteAll(STDOUT_FILENO, out.data(), out.size()) ? 0 : 1;
}

int RunRemoteRank() {
  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    Throw(ErrorCode::kIo, "remote-rank: pipe: {}", std::strerror(errno));
  }
  struct sigaction sa{};
  sa.sa_handler = OnSignal;
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGCHLD}) sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  const RemoteJob job = DecodeRemoteJob(ReadJobLine(Deadline::After(kJobReadTimeoutS)));
  if (!job.cwd.empty() && chdir(job.cwd.c_str()) != 0) {
    const char* home = std::getenv("HOME");
    PSGD_LOG_WARN("rank {} on {}: the launcher's directory {} does not exist here ({}); relative "
                  "paths are relative to {}",
                  job.rank, job.host, job.cwd, std::strerror(errno), home ? home : "/");
  }
  TempDir dir(fmt::format("pipesgd-rank{}", job.rank));
  std::vector<std::string> argv = job.program;
  if (argv.empty()) {
    const fs::path config = dir.path() / job.config_name;
    WriteConfig(config, job.config_text);
    PSGD_LOG_DEBUG("rank {} on {}: shipped config written to {}", job.rank, job.host,
                   config.string());
    argv = {SelfExe(), "worker", config.string()};
    argv.insert(argv.end(), job.worker_args.begin(), job.worker_args.end());
  }

  for (const auto& [name, value] : job.env_defaults) setenv(name.c_str(), value.c_str(), 0);
  for (const auto& [name, value] : job.env) setenv(name.c_str(), value.c_str(), 1);
  const std::string exe = argv[0];
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);

  const pid_t parent = getpid();
  const pid_t worker = fork();
  if (worker < 0) Throw(ErrorCode::kIo, "remote-rank: fork: {}", std::strerror(errno));
  if (worker == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    const int null = open("/dev/null", O_RDONLY);
    if (null >= 0) dup2(null, STDIN_FILENO);
    for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGCHLD, SIGPIPE}) signal(sig, SIG_DFL);
    execvp(exe.c_str(), cargv.data());  // a program may be a name on this host's PATH
    dprintf(STDERR_FILENO, "cannot exec %s: %s\n", exe.c_str(), strerror(errno));
    _exit(127);
  }
  setpgid(worker, worker);

  std::optional<int> status;
  std::optional<Clock::time_point> stop_sent;
  bool killed = false;
  bool stdin_open = true;
  auto stop = [&](const std::string& why) {
    if (stop_sent) return;
    PSGD_LOG_DEBUG("rank {} on {}: {}; stopping the worker (pid {})", job.rank, job.host, why,
                   worker);
    stop_sent = Clock::now();
    kill(-worker, SIGTERM);
  };
  while (!status) {
    int st = 0;
    if (waitpid(worker, &st, WNOHANG) == worker) {
      status = st;
      break;
    }
    if (stop_sent && !killed &&
        std::chrono::duration<double>(Clock::now() - *stop_sent).count() > job.kill_grace_s) {
      kill(-worker, SIGKILL);
      killed = true;
    }
    pollfd fds[2] = {{g_signal_pipe[0], POLLIN, 0}, {stdin_open ? STDIN_FILENO : -1, POLLIN, 0}};
    poll(fds, 2, 200);
    if (fds[0].revents & POLLIN) {
      unsigned char sig = 0;
      while (read(g_signal_pipe[0], &sig, 1) == 1) {
        if (sig != SIGCHLD) stop(fmt::format("got signal {} ({})", sig, strsignal(sig)));
      }
    }
    if (stdin_open && (fds[1].revents & (POLLIN | POLLHUP | POLLERR))) {
      char buf[4096];
      const ssize_t n = read(STDIN_FILENO, buf, sizeof(buf));
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        stdin_open = false;
        stop("the launcher closed the session");
      }
    }
  }
  // Anything the worker left in its group goes with it.
  kill(-worker, SIGKILL);
  if (WIFSIGNALED(*status) && !stop_sent) {
    PSGD_LOG_ERROR("rank {} on {}: the worker (pid {}) was killed by signal {} ({})", job.rank,
                   job.host, worker, WTERMSIG(*status), strsignal(WTERMSIG(*status)));
  }
  return ExitCodeOf(*status);
}

}  // namespace pipesgd::launcher
