// The UCX transport: UCP tag messages over whatever UCX selects (UCX_TLS: tcp, shared memory
// (posix, sysv, cma), rc/ud/dc verbs, cuda_copy/cuda_ipc where UCX was built with them).
//
// Address: a wire::UcxAddress {worker_address, rank}: the UCP worker address, exchanged through
//   the rendezvous.
// Connect: one UCP endpoint per (peer, stream), created from the peer's worker address with peer
//   failure handling on; then a hello tag message each way on every endpoint (a
//   wire::ConnectionHello), so Connect returns only when every endpoint has carried data in both
//   directions and the peer agreed on the world size, protocol and stream count.
// Data: each non-empty part of a send is one tag message. The 64-bit tag is
//   [kind:2][sender rank:22][stream:8][sequence:32] with a sequence number per connection and
//   direction, so every message matches exactly one receive (docs/wire_protocol.md); receives
//   are posted with the full mask. Ops complete in posting order per connection and direction.
// Progress: Transport::Wait calls ucp_worker_progress on the calling thread; when nothing moves
//   it sleeps on the worker's event fd (ucp_worker_arm), at most 50 ms at a time.
#pragma once

#include <memory>
#include <string>

#include "transport/transport.h"

namespace pipesgd::transport::ucx {

struct UcxOptions {
  int rank = 0;
  int world_size = 1;
  // UCX's NET_DEVICES for this transport ("eth0", "mlx5_0:1"); empty: UCX_NET_DEVICES from the
  // environment, or UCX's default (all devices).
  std::string net_devices;
};

// Reads UCX_* from the environment (UCX_TLS, UCX_NET_DEVICES, ...), creates the UCP context and
// worker. Throws Error kUnavailable if UCX cannot start (e.g. UCX_TLS names no usable transport),
// naming the UCX status.
std::unique_ptr<Transport> CreateUcxTransport(const UcxOptions& options);

// "1.13.1": the UCX library this process runs with.
std::string UcxVersion();

// The UCT transports and devices this host offers ("tcp/eth0", "posix/memory", "rc_verbs/mlx5_0:1"),
// whatever UCX_TLS says. Empty if UCX cannot list them.
std::vector<std::string> UcxTransportsAvailable();

}  // namespace pipesgd::transport::ucx
