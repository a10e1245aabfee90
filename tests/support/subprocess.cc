#include "tests/support/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

namespace pipesgd::testing {

CommandResult RunCommand(const std::vector<std::string>& argv,
                         const std::map<std::string, std::string>& env, double timeout_s) {
  int out_pipe[2], err_pipe[2];
  // Close-on-exec: a command started at the same time from another thread must not inherit
  // this one's pipes (it would hold them open, and this call would wait for its end too).
  // dup2 below clears the flag on the copies the child keeps.
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) std::abort();
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    close(out_pipe[0]);
    close(err_pipe[0]);
    close(out_pipe[1]);
    close(err_pipe[1]);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  CommandResult result;
  int fds_open[2] = {out_pipe[0], err_pipe[0]};
  std::string* sinks[2] = {&result.out, &result.err};
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (fds_open[0] >= 0 || fds_open[1] >= 0) {
    if (!result.timed_out && std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      result.timed_out = true;
    }
    pollfd p[2];
    int n = 0;
    int which[2];
    for (int i = 0; i < 2; ++i) {
      if (fds_open[i] >= 0) {
        p[n] = {fds_open[i], POLLIN, 0};
        which[n++] = i;
      }
    }
    poll(p, n, 100);
    for (int j = 0; j < n; ++j) {
      if (!(p[j].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[65536];
      ssize_t got = read(p[j].fd, buf, sizeof(buf));
      if (got > 0) {
        sinks[which[j]]->append(buf, static_cast<size_t>(got));
      } else {
        close(p[j].fd);
        fds_open[which[j]] = -1;
      }
    }
  }
  int status = 0;
  waitpid(pid, &status, 0);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

}  // namespace pipesgd::testing
