// TCP congestion control of a connected socket, started afresh.
//
// Why: the start-up tuning (core/train/autotune.cc) sends seconds of traffic of its own on the
// job's ring connections. Under BBR each connection then keeps a ProbeRTT phase of its own
// (every 10 s without a new minimum RTT it sends at 4 packets for 200 ms); the ring waits for
// its slowest link, so connections out of phase stall the ring once per connection per 10 s,
// where a fresh job's connections, started together, stall together. Measured on the 4-node lab
// at 100 Mbit/s: the job after the tuning 1.3% slower than the same values untuned under BBR,
// no slower under CUBIC (docs/results/auto_grid/README.md).
#pragma once

#include <string>

namespace pipesgd::transport {

// Reinitialises the congestion control of the connected TCP socket `fd`: the same algorithm,
// its state (BBR's bandwidth and RTT filters and ProbeRTT clock, CUBIC's epoch) as on a new
// connection. Linux ignores a request for the algorithm already in use, so the socket passes
// through reno (allowed to every process) and back. Done only where the way back is open: the
// algorithm is the namespace's default or in net.ipv4.tcp_allowed_congestion_control. Returns
// the algorithm restarted, or "" where nothing was done (not TCP, reno, not allowed back, or an
// error), with the reason in `why` when given.
std::string RestartCongestionControl(int fd, std::string* why = nullptr);

}  // namespace pipesgd::transport
