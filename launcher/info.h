// `pipesgd info`: what this build and host can do, for bug reports and for choosing a transport.
#pragma once

#include <string>

namespace pipesgd::launcher {

// The report, one "key: value" line each: version, transports compiled in and what each sees
// on this host (UCX transports, RDMA devices and ports), GPUDirect RDMA and CUDA support,
// RLIMIT_MEMLOCK, network interfaces, what comm.transport = AUTO would pick and why, the BLAS.
// Never throws: a probe that fails says so in its line.
std::string InfoReport();

}  // namespace pipesgd::launcher
