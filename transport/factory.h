// Creating a transport by kind, and the `auto` choice. The launcher maps the config
// (comm.transport, comm.ib_device, ...) to TransportOptions; nothing here reads the config or
// the environment, except what UCX itself reads (UCX_*).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pipesgd/types.h"

#include "transport/transport.h"

namespace pipesgd::transport {

using TransportKind = ::pipesgd::TransportKind;  // pipesgd/types.h (public)

// "tcp", "ucx", "ibverbs".
std::string_view TransportKindName(TransportKind kind);
// Accepts the names above in any case; nullopt otherwise.
std::optional<TransportKind> ParseTransportKind(std::string_view text);
// Whether this build has the transport (UCX and ibverbs are optional at build time).
bool TransportCompiled(TransportKind kind);

struct TransportOptions {
  TransportKind kind = TransportKind::kTcp;
  int rank = 0;
  int world_size = 1;
  // tcp: numeric IP to listen on and publish.
  std::string bind_host = "127.0.0.1";
  // ucx: UCX NET_DEVICES ("" = UCX_NET_DEVICES or UCX's default).
  std::string ucx_net_devices;
  // ibverbs: the ranks Connect will be called with, and the streams per rank (the queue pairs
  // are created up front so that their numbers travel in the rendezvous address).
  std::vector<int> peers;
  int streams = 1;
  // ibverbs: device name ("" = first with an active port), port (0 = first active), GID index
  // (-1 = auto).
  std::string ib_device;
  int ib_port = 0;
  int gid_index = -1;
  // ibverbs: ACK timeout exponent and retry count (comm.ib_timeout, comm.ib_retry_count).
  int ib_ack_timeout = 18;
  int ib_retry_count = 6;
};

// Throws Error kInvalidArgument if the kind is not in this build (naming the missing library),
// and whatever the transport's constructor throws.
std::unique_ptr<Transport> CreateTransport(const TransportOptions& options);

struct AutoChoice {
  TransportKind kind = TransportKind::kTcp;
  std::string reason;  // for the log: why this one and not the others
};

// ibverbs if an RDMA port is ACTIVE (and this build has ibverbs), else TCP (without RDMA, UCX
// runs over TCP or shared memory; over TCP it is the slower, and its shared memory cannot tell
// a dead peer). Deterministic for a given host and build; ranks on different hosts may differ,
// which the rendezvous then rejects by name (the launcher puts the choice in the job text).
AutoChoice ChooseAutoTransport();

// One line per compiled-in capability, for `pipesgd info`.
std::vector<std::string> DescribeTransportSupport();

}  // namespace pipesgd::transport
