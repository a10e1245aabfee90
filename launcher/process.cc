#include "launcher/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string_view>

#include <fmt/format.h>

#include "core/base/error.h"

extern char** environ;

namespace pipesgd::launcher {
namespace {

// The child's environment as "NAME=VALUE" strings, built before the fork (setenv after a fork
// is not async-signal-safe).
std::vector<std::string> ChildEnvironment(const ChildSpec& spec) {
  std::map<std::string, std::string> vars;
  std::vector<std::string> order;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) continue;
    const std::string name = entry.substr(0, eq);
    if (vars.emplace(name, entry.substr(eq + 1)).second) order.push_back(name);
  }
  for (const auto& [name, value] : spec.env_defaults) {
    if (vars.emplace(name, value).second) order.push_back(name);
  }
  for (const auto& [name, value] : spec.env) {
    if (!vars.count(name)) order.push_back(name);
    vars[name] = value;
  }
  for (const auto& name : spec.env_unset) vars.erase(name);
  std::vector<std::string> out;
  for (const auto& name : order) {
    auto it = vars.find(name);
    if (it != vars.end()) out.push_back(name + "=" + it->second);
  }
  return out;
}

}  // namespace

Child SpawnChild(const ChildSpec& spec, const std::string& what) {
  if (spec.argv.empty()) Throw(ErrorCode::kInvalidArgument, "{}: nothing to run", what);
  std::vector<std::string> argv = spec.argv;
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  std::vector<std::string> envp = ChildEnvironment(spec);
  std::vector<char*> cenvp;
  for (auto& e : envp) cenvp.push_back(e.data());
  cenvp.push_back(nullptr);

  int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1};
  auto close_all = [&] {
    for (int fd : {in[0], in[1], out[0], out[1], err[0], err[1]}) {
      if (fd >= 0) close(fd);
    }
  };
  if ((spec.stdin_pipe && pipe2(in, O_CLOEXEC) != 0) || pipe2(out, O_CLOEXEC) != 0 ||
      pipe2(err, O_CLOEXEC) != 0) {
    const int e = errno;
    close_all();
    Throw(ErrorCode::kIo, "cannot start {}: pipe: {}", what, std::strerror(e));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int e = errno;
    close_all();
    Throw(ErrorCode::kIo, "cannot start {}: fork: {}", what, std::strerror(e));
  }
  if (pid == 0) {
    // If the launcher dies without stopping us (kill -9, a closed terminal), stop too; the
    // getppid() check closes the race with a launcher that died before prctl.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    if (spec.own_process_group) setpgid(0, 0);
    if (spec.stdin_pipe) dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGCHLD}) signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execvpe(cargv[0], cargv.data(), cenvp.data());
    const int e = errno;
    dprintf(STDERR_FILENO, "cannot exec %s: %s\n", cargv[0], strerror(e));
    _exit(127);
  }
  // Also from the parent, so the group exists before anyone signals it.
  if (spec.own_process_group) setpgid(pid, pid);
  Child child;
  child.pid = pid;
  if (spec.stdin_pipe) {
    close(in[0]);
    child.stdin_fd = in[1];
  }
  close(out[1]);
  close(err[1]);
  child.out_fd = out[0];
  child.err_fd = err[0];
  return child;
}

ChildResult RunChild(const ChildSpec& spec, const std::string& what, Deadline deadline) {
  Child child = SpawnChild(spec, what);
  if (child.stdin_fd >= 0) close(child.stdin_fd);
  ChildResult result;
  char buf[4096];
  while (child.out_fd >= 0 || child.err_fd >= 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline.when() - Deadline::Clock::now());
    if (left.count() <= 0) {
      kill(child.pid, SIGKILL);
      waitpid(child.pid, nullptr, 0);
      for (int fd : {child.out_fd, child.err_fd}) {
        if (fd >= 0) close(fd);
      }
      Throw(ErrorCode::kDeadlineExceeded, "{} did not finish in time; killed", what);
    }
    pollfd fds[2] = {{child.out_fd, POLLIN, 0}, {child.err_fd, POLLIN, 0}};
    if (poll(fds, 2, static_cast<int>(std::min<int64_t>(left.count(), 1000))) < 0 &&
        errno != EINTR) {
      break;
    }
    for (int k = 0; k < 2; ++k) {
      int& fd = k == 0 ? child.out_fd : child.err_fd;
      if (fd < 0 || (fds[k].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n > 0 && k == 1) result.err.append(buf, static_cast<size_t>(n));
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        close(fd);
        fd = -1;
      }
    }
  }
  while (waitpid(child.pid, &result.status, 0) < 0 && errno == EINTR) {
  }
  return result;
}

std::string SelfExe() {
  std::error_code ec;
  auto path = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) Throw(ErrorCode::kIo, "cannot find this program's path: {}", ec.message());
  return path.string();
}

bool IsProgram(const std::string& path) {
  std::error_code ec;
  return !path.empty() && std::filesystem::is_regular_file(path, ec) &&
         access(path.c_str(), X_OK) == 0 && !path.ends_with(".pbtxt");
}

void CheckWritableFile(const std::string& path, const std::string& option) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto fail = [&](std::string_view why) {
    Throw(ErrorCode::kIo, "{} {}: cannot write: {}", option, path, why);
  };
  if (path.empty()) fail("an empty path");
  if (fs::is_directory(path, ec)) fail("a directory");
  if (fs::exists(path, ec)) {
    if (access(path.c_str(), W_OK) != 0) fail(std::strerror(errno));
    return;
  }
  const fs::path parent = fs::path(path).parent_path();
  const std::string dir = parent.empty() ? "." : parent.string();
  if (!fs::is_directory(dir, ec)) fail(fmt::format("no folder {}", dir));
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    fail(fmt::format("folder {}: {}", dir, std::strerror(errno)));
  }
}

std::string FindProgram(const std::string& name) {
  const auto runnable = [](const std::filesystem::path& p) {
    std::error_code ec;
    return std::filesystem::is_regular_file(p, ec) && access(p.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    if (!runnable(name)) {
      Throw(ErrorCode::kInvalidArgument, "program {}: {}", name,
            access(name.c_str(), F_OK) == 0 ? "not an executable file" : "no such file");
    }
    return std::filesystem::absolute(name).lexically_normal().string();
  }
  const char* path = std::getenv("PATH");
  std::string_view dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    const size_t colon = dirs.find(':');
    const std::string dir(dirs.substr(0, colon));
    const std::filesystem::path candidate = std::filesystem::path(dir.empty() ? "." : dir) / name;
    if (runnable(candidate)) return candidate.string();
    if (colon == std::string_view::npos) break;
    dirs.remove_prefix(colon + 1);
  }
  Throw(ErrorCode::kInvalidArgument, "program {}: not found on PATH ({}); give its path",
        name, path != nullptr ? path : "unset");
}

std::string DescribeWaitStatus(int status) {
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

bool WriteAll(int fd, const char* data, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t w = write(fd, data + done, size - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    done += static_cast<size_t>(w);
  }
  return true;
}

std::string RandomToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) Throw(ErrorCode::kIo, "cannot make a job token: getrandom: {}", std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

}  // namespace pipesgd::launcher
