// Multi-process test harness: runs a function as N ranks in N forked processes on loopback
// (gloo's MultiProcTest). Each rank returns bytes to the parent through a pipe, so assertions run
// in the parent on real values; a rank that throws exits non-zero with the message on stderr.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace pipesgd::testing {

struct RankResult {
  int exit_code = -1;     // 0 on success; 128+signal if killed
  std::string output;     // what the rank function returned
  std::string error;      // exception message, if it threw
};

// Environment a rank runs in: rendezvous at 127.0.0.1:master_port.
struct RankContext {
  int rank = 0;
  int world_size = 1;
  uint16_t master_port = 0;
};

// Forks world_size processes running fn(ctx); waits for all (killing everyone after timeout_s,
// which then shows as exit code 128+SIGKILL). The parent must not have started threads.
std::vector<RankResult> RunRanks(int world_size,
                                 const std::function<std::string(const RankContext&)>& fn,
                                 double timeout_s = 60);

// A TCP port on 127.0.0.1 that was free a moment ago.
uint16_t FreePort();

// A socket listening on 127.0.0.1 at a free port (a stranger on a port, for tests); sets *port.
// The caller closes it.
int ListenOnLoopback(uint16_t* port);

// Helpers to pass floats through RankResult::output.
std::string PackFloats(const float* data, size_t n);
std::vector<float> UnpackFloats(const std::string& bytes);

}  // namespace pipesgd::testing
