// Starting child processes for the launchers: fork + exec with pipes on stdout and stderr (and
// optionally stdin), an environment prepared before the fork, its own process group, and
// PR_SET_PDEATHSIG so that a launcher killed without cleaning up (SIGKILL, a closed terminal)
// still takes its children down.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "core/base/deadline.h"

#include "transport/launch_env.h"

namespace pipesgd::launcher {

// What every rank gets where the launcher's environment (or, over ssh, the host's) has no value:
// one BLAS and one OpenMP (oneDNN) thread, as ranks share the machine's cores. torchrun sets
// OMP_NUM_THREADS=1 too where more than one rank shares a node; pipesgd always, so that -np 1
// and a run over ssh with one rank per host compute with the same thread counts, and so the
// same bits, as -np N on one machine.
inline const std::vector<std::pair<std::string, std::string>> kRankThreadDefaults = {
    {"OPENBLAS_NUM_THREADS", "1"}, {"OMP_NUM_THREADS", "1"}};

struct ChildSpec {
  // argv[0] is the program: a path, or a name looked up on PATH (execvp).
  std::vector<std::string> argv;
  // Set in the child's environment (replacing the launcher's value).
  std::vector<std::pair<std::string, std::string>> env;
  // Set only where the launcher's environment has no value (e.g. OPENBLAS_NUM_THREADS=1).
  std::vector<std::pair<std::string, std::string>> env_defaults;
  // Removed from the child's environment.
  std::vector<std::string> env_unset;
  // True: the child's stdin is a pipe whose write end the caller gets; false: inherited.
  bool stdin_pipe = false;
  // True: the child leads a process group of its own, so a terminal's Ctrl-C reaches only the
  // launcher, which then stops the children in order.
  bool own_process_group = true;
};

// A started child. The fds are the parent's ends (close-on-exec), -1 when closed.
struct Child {
  pid_t pid = -1;
  int stdin_fd = -1;
  int out_fd = -1;
  int err_fd = -1;
};

// Starts `spec`. If exec fails, the child writes "cannot exec PROGRAM: REASON" to its stderr and
// exits 127. Throws Error kIo if a pipe or the fork fails (naming `what`, e.g. "rank 2").
Child SpawnChild(const ChildSpec& spec, const std::string& what);

// Runs `spec` to its end and returns its wait status, keeping what it wrote to stderr. Both
// pipes are drained together (a child filling one cannot block), and at `deadline` the child
// is killed. Throws Error kIo if it cannot start, kDeadlineExceeded (naming `what`) at the
// deadline.
struct ChildResult {
  int status = 0;
  std::string err;
};
ChildResult RunChild(const ChildSpec& spec, const std::string& what, Deadline deadline);

using transport::RankHost;  // transport/launch_env.h

// The path of this program (/proc/self/exe). Throws Error kIo if it cannot be read.
std::string SelfExe();

// True if `path` names a program to start rather than a job config: an executable regular
// file (not a .pbtxt), as `pipesgd run -np 4 ./my_program`.
bool IsProgram(const std::string& path);

// Throws Error kIo where a file cannot be written at `path` ("OPTION PATH: cannot write:
// REASON"): a directory, a folder that is missing or not writable, a read-only file. Creates
// and changes nothing, so that a command that writes its results at the end (probe, bench)
// fails before it runs rather than after.
void CheckWritableFile(const std::string& path, const std::string& option);

// `name` as a child would exec it: a path containing '/' (made absolute), else the first
// executable NAME on PATH. Throws Error kInvalidArgument naming it when there is none.
std::string FindProgram(const std::string& name);

// "exited with status 3", "was killed by signal 9 (Killed)" for a waitpid status.
std::string DescribeWaitStatus(int status);

// The shell's convention: the exit status, or 128+N for a death by signal N.
int ExitCodeOf(int status);

// Writes all of `data` to `fd` (retrying on EINTR and short writes). Returns false on error
// (EPIPE for a reader that went away).
bool WriteAll(int fd, const char* data, size_t size);

// 16 random bytes from the kernel (getrandom) as 32 hex digits. Throws Error kIo if the kernel
// gives none.
std::string RandomToken();

}  // namespace pipesgd::launcher
