#include "tests/support/multiproc.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <thread>

namespace pipesgd::testing {
namespace {

void WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace

// True if a TCP socket can bind 127.0.0.1:port right now.
static bool CanBind(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// A port below the kernel's ephemeral range (ip_local_port_range, usually 32768-60999), free
// now. A port taken from the ephemeral range (bind to port 0) can be handed to another test's
// outgoing connection before rank 0 binds it: "Address already in use" flakes under ctest -j.
// Below the range only explicit binds compete, and the choice is random per process.
uint16_t FreePort() {
  static std::mt19937 rng(static_cast<uint32_t>(getpid()) ^
                          static_cast<uint32_t>(
                              std::chrono::steady_clock::now().time_since_epoch().count()));
  std::uniform_int_distribution<int> pick(20000, 32000);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const auto port = static_cast<uint16_t>(pick(rng));
    if (CanBind(port)) return port;
  }
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

int ListenOnLoopback(uint16_t* port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, 16) != 0) {
    std::perror("ListenOnLoopback");
    std::abort();
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

std::string PackFloats(const float* data, size_t n) {
  return std::string(reinterpret_cast<const char*>(data), n * sizeof(float));
}

std::vector<float> UnpackFloats(const std::string& bytes) {
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

std::vector<RankResult> RunRanks(int world_size,
                                 const std::function<std::string(const RankContext&)>& fn,
                                 double timeout_s) {
  const uint16_t port = FreePort();
  std::vector<pid_t> pids(world_size, -1);
  std::vector<int> out_fds(world_size, -1), err_fds(world_size, -1);
  for (int r = 0; r < world_size; ++r) {
    int out_pipe[2], err_pipe[2];
    if (pipe(out_pipe) != 0 || pipe(err_pipe) != 0) std::abort();
    pid_t pid = fork();
    if (pid == 0) {
      close(out_pipe[0]);
      close(err_pipe[0]);
      int code = 0;
      try {
        std::string out = fn(RankContext{r, world_size, port});
        WriteAll(out_pipe[1], out);
      } catch (const std::exception& e) {
        WriteAll(err_pipe[1], e.what());
        code = 1;
      }
      close(out_pipe[1]);
      close(err_pipe[1]);
      _exit(code);  // no atexit handlers or gtest teardown in the child
    }
    close(out_pipe[1]);
    close(err_pipe[1]);
    pids[r] = pid;
    out_fds[r] = out_pipe[0];
    err_fds[r] = err_pipe[0];
  }

  std::vector<RankResult> results(world_size);
  // Drain pipes while waiting, so a rank writing a large result cannot block on a full pipe.
  std::vector<pollfd> fds;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int open_fds = 2 * world_size;
  bool killed = false;
  while (open_fds > 0) {
    fds.clear();
    for (int r = 0; r < world_size; ++r) {
      if (out_fds[r] >= 0) fds.push_back({out_fds[r], POLLIN, 0});
      if (err_fds[r] >= 0) fds.push_back({err_fds[r], POLLIN, 0});
    }
    if (!killed && std::chrono::steady_clock::now() > deadline) {
      for (pid_t pid : pids) kill(pid, SIGKILL);
      killed = true;
    }
    poll(fds.data(), fds.size(), 100);
    for (const pollfd& p : fds) {
      if (!(p.revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[65536];
      ssize_t n = read(p.fd, buf, sizeof(buf));
      for (int r = 0; r < world_size; ++r) {
        std::string* sink = p.fd == out_fds[r] ? &results[r].output
                            : p.fd == err_fds[r] ? &results[r].error : nullptr;
        if (!sink) continue;
        if (n > 0) {
          sink->append(buf, static_cast<size_t>(n));
        } else {
          close(p.fd);
          (p.fd == out_fds[r] ? out_fds[r] : err_fds[r]) = -1;
          --open_fds;
        }
      }
    }
  }
  for (int r = 0; r < world_size; ++r) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    results[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  return results;
}

}  // namespace pipesgd::testing
