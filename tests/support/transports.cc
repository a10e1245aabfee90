#include "tests/support/transports.h"

#include <cstdlib>

#include "transport/rendezvous.h"
#ifdef PIPESGD_HAVE_IBVERBS
#include "transport/ibverbs/ib_transport.h"
#endif

namespace pipesgd::testing {

using transport::TransportKind;

std::vector<TransportParam> AllTransportParams() {
  return {{"tcp", TransportKind::kTcp, "", true},
          {"ucx_tcp", TransportKind::kUcx, "tcp", true},
          {"ucx_sm", TransportKind::kUcx, "sm,self", false},
          {"ibverbs", TransportKind::kIbverbs, "", true}};
}

std::string SkipReason(const TransportParam& p) {
  if (!transport::TransportCompiled(p.kind)) {
    return std::string(transport::TransportKindName(p.kind)) +
           ": not in this build (its library was not found at build time)";
  }
#ifdef PIPESGD_HAVE_IBVERBS
  if (p.kind == TransportKind::kIbverbs) {
    const auto devices = transport::ibverbs::ProbeIbDevices();
    bool active = false;
    for (const auto& d : devices) {
      for (const auto& port : d.ports) active = active || port.active;
    }
    if (!active) {
      return "ibverbs: built, but this host has no active RDMA port (devices: " +
             transport::ibverbs::DescribeIbDevices(devices) +
             "), so the ibverbs transport is NOT exercised here";
    }
  }
#endif
  return "";
}

void ApplyEnvironment(const TransportParam& p) {
  if (!p.ucx_tls.empty()) setenv("UCX_TLS", p.ucx_tls.c_str(), 1);
}

std::unique_ptr<transport::Transport> MakeTransport(const TransportParam& p, const RankContext& ctx,
                                                    const std::vector<int>& peers, int streams) {
  ApplyEnvironment(p);
  transport::TransportOptions o;
  o.kind = p.kind;
  o.rank = ctx.rank;
  o.world_size = ctx.world_size;
  o.bind_host = "127.0.0.1";
  o.peers = peers;
  o.streams = streams;
  return transport::CreateTransport(o);
}

Connected ConnectAll(const TransportParam& p, const RankContext& ctx, int streams) {
  std::vector<int> peers;
  for (int r = 0; r < ctx.world_size; ++r) {
    if (r != ctx.rank) peers.push_back(r);
  }
  Connected c;
  c.transport = MakeTransport(p, ctx, peers, streams);
  transport::RendezvousOptions rdv{"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size,
                                   "test", ""};
  auto addresses =
      transport::RendezvousAllGather(rdv, c.transport->LocalAddress(), Deadline::After(30));
  std::vector<std::pair<int, std::string>> list;
  for (int r : peers) list.push_back({r, addresses[r]});
  c.connections = c.transport->Connect(list, Deadline::After(30), streams);
  return c;
}

}  // namespace pipesgd::testing
