#include "tests/support/transports.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

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
          {"ibverbs", TransportKind::kIbverbs, "", true, true},
          // UCX's aliases: rc_v is rc_verbs with ud_verbs for its wire-up only. Both ranks on one
          // soft-RoCE device: UCX 1.13's UD drops every packet as "wrong destination GID"
          // (measured: ucx_perftest never connects) unless that check is off.
          {"ucx_rc_verbs", TransportKind::kUcx, "rc_v", true, true, {{"UCX_UD_VERBS_ETH_DGID_CHECK", "n"}}},
          {"ucx_ud_verbs", TransportKind::kUcx, "ud_v", true, true, {{"UCX_UD_VERBS_ETH_DGID_CHECK", "n"}}}};
}

namespace {

// The RDMA ports /sys/class/infiniband lists, "device/port state" each, and whether one is active.
std::string DescribeSysfsPorts(bool* active) {
  std::string out;
  *active = false;
  std::error_code ec;
  for (const auto& dev : std::filesystem::directory_iterator("/sys/class/infiniband", ec)) {
    for (const auto& port : std::filesystem::directory_iterator(dev.path() / "ports", ec)) {
      std::ifstream in(port.path() / "state");
      std::string state;
      std::getline(in, state);
      *active = *active || state.find("ACTIVE") != std::string::npos;
      out += (out.empty() ? "" : ", ") + dev.path().filename().string() + "/" +
             port.path().filename().string() + " " + state;
    }
  }
  return out.empty() ? "none" : out;
}

}  // namespace

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
  if (p.needs_rdma_port) {
    bool active = false;
    const std::string ports = DescribeSysfsPorts(&active);
    if (!active) {
      return p.name + ": this host has no active RDMA port (" + ports +
             "), so it is NOT exercised here; the rdma tier runs it on soft-RoCE "
             "(ctest -L rdma, scripts/rdma_vm)";
    }
  }
  return "";
}

void ApplyEnvironment(const TransportParam& p) {
  if (!p.ucx_tls.empty()) setenv("UCX_TLS", p.ucx_tls.c_str(), 1);
  for (const auto& [name, value] : p.env) setenv(name.c_str(), value.c_str(), 1);
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
