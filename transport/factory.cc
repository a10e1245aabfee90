#include "transport/factory.h"

#include <algorithm>
#include <cctype>

#include "core/base/error.h"
#include "transport/ibverbs/ib_common.h"
#include "transport/tcp/tcp_transport.h"
#ifdef PIPESGD_HAVE_UCX
#include "transport/ucx/ucx_transport.h"
#endif
#ifdef PIPESGD_HAVE_IBVERBS
#include "transport/ibverbs/ib_transport.h"
#endif

namespace pipesgd::transport {

std::string_view TransportKindName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kTcp:
      return "tcp";
    case TransportKind::kUcx:
      return "ucx";
    case TransportKind::kIbverbs:
      return "ibverbs";
  }
  return "unknown";
}

std::optional<TransportKind> ParseTransportKind(std::string_view text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (TransportKind k : {TransportKind::kTcp, TransportKind::kUcx, TransportKind::kIbverbs}) {
    if (lower == TransportKindName(k)) return k;
  }
  return std::nullopt;
}

bool TransportCompiled(TransportKind kind) {
  switch (kind) {
    case TransportKind::kTcp:
      return true;
    case TransportKind::kUcx:
#ifdef PIPESGD_HAVE_UCX
      return true;
#else
      return false;
#endif
    case TransportKind::kIbverbs:
#ifdef PIPESGD_HAVE_IBVERBS
      return true;
#else
      return false;
#endif
  }
  return false;
}

std::unique_ptr<Transport> CreateTransport(const TransportOptions& o) {
  switch (o.kind) {
    case TransportKind::kTcp:
      return tcp::CreateTcpTransport({o.rank, o.world_size, o.bind_host});
    case TransportKind::kUcx:
#ifdef PIPESGD_HAVE_UCX
      return ucx::CreateUcxTransport({o.rank, o.world_size, o.ucx_net_devices});
#else
      Throw(ErrorCode::kInvalidArgument,
            "rank {}: this pipesgd was built without the ucx transport (UCX, Debian libucx-dev, "
            "was not found at build time); use comm.transport = TCP or rebuild",
            o.rank);
#endif
    case TransportKind::kIbverbs:
#ifdef PIPESGD_HAVE_IBVERBS
      return ibverbs::CreateIbTransport({o.rank, o.world_size, o.peers, o.streams, o.ib_device,
                                         o.ib_port, o.gid_index, o.ib_ack_timeout,
                                         o.ib_retry_count});
#else
      Throw(ErrorCode::kInvalidArgument,
            "rank {}: this pipesgd was built without the ibverbs transport (libibverbs-dev was "
            "not found at build time); use comm.transport = TCP or UCX, or rebuild",
            o.rank);
#endif
  }
  Throw(ErrorCode::kInvalidArgument, "unknown transport kind {}", static_cast<int>(o.kind));
}

AutoChoice ChooseAutoTransport() {
  std::string rdma;
#ifdef PIPESGD_HAVE_IBVERBS
  const std::vector<ibverbs::IbDeviceDesc> devices = ibverbs::ProbeIbDevices();
  for (const auto& d : devices) {
    for (const auto& p : d.ports) {
      if (p.active) {
        return {TransportKind::kIbverbs,
                fmt::format("RDMA port {} port {} is ACTIVE", d.name, p.port)};
      }
    }
  }
  rdma = devices.empty() ? "no RDMA device (ibv_get_device_list found none)"
                         : fmt::format("no ACTIVE RDMA port ({})", ibverbs::DescribeIbDevices(devices));
#else
  rdma = "this build has no ibverbs transport";
#endif
  // Without RDMA, UCX runs over TCP, where pipesgd's own TCP transport moves about twice its
  // bus bandwidth (bench allreduce, 4 ranks; docs/transports.md, "AUTO"), or over shared memory,
  // which is faster on one host but cannot tell a dead peer. So TCP, whether UCX is built or not.
  return {TransportKind::kTcp,
          fmt::format("{}; tcp: faster than UCX over TCP, and unlike UCX's shared memory it detects a "
                      "dead peer (docs/transports.md)",
                      rdma)};
}

std::vector<std::string> DescribeTransportSupport() {
  std::vector<std::string> lines;
  lines.push_back("tcp: built in (Boost.Asio)");
#ifdef PIPESGD_HAVE_UCX
  const auto tls = ucx::UcxTransportsAvailable();
  lines.push_back(fmt::format("ucx: built in, UCX {}; transports on this host: {}",
                              ucx::UcxVersion(), tls.empty() ? "none" : fmt::format("{}", fmt::join(tls, ", "))));
#else
  lines.push_back("ucx: not built (libucx-dev was not found at build time)");
#endif
#ifdef PIPESGD_HAVE_IBVERBS
  const auto devices = ibverbs::ProbeIbDevices();
  lines.push_back(fmt::format("ibverbs: built in; RDMA devices and ports seen: {}",
                              devices.empty() ? "none (no InfiniBand/RoCE device on this host, so "
                                                "the ibverbs transport cannot run here)"
                                              : ibverbs::DescribeIbDevices(devices)));
  lines.push_back(fmt::format("GPUDirect RDMA: {}", ibverbs::GpuDirectStatus()));
#else
  lines.push_back("ibverbs: not built (libibverbs-dev was not found at build time)");
  lines.push_back("GPUDirect RDMA: not built (needs the ibverbs transport)");
#endif
  lines.push_back(fmt::format("RLIMIT_MEMLOCK: {}",
                              ibverbs::DescribeMemlock(ibverbs::ReadMemlockLimit())));
  return lines;
}

}  // namespace pipesgd::transport
