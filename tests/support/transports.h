// The transports the conformance suite runs over, as test parameters: TCP, UCX over tcp, UCX
// over shared memory, ibverbs, and UCX over rc_verbs and ud_verbs (the last three skip, with the
// reason, where there is no active RDMA port or the build lacks the library; the rdma tier runs
// them on soft-RoCE in a QEMU guest: scripts/rdma_vm).
#pragma once

#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "transport/factory.h"
#include "transport/transport.h"
#include "tests/support/multiproc.h"

namespace pipesgd::testing {

struct TransportParam {
  std::string name;  // for test names: tcp, ucx_tcp, ucx_sm, ibverbs, ucx_rc_verbs, ucx_ud_verbs
  transport::TransportKind kind = transport::TransportKind::kTcp;
  std::string ucx_tls;  // UCX_TLS for the ranks ("" = leave the environment alone)
  // A dead peer fails pending receives with kUnavailable; false: only the deadline catches it
  // (UCX 1.13's shared memory has no peer failure handling).
  bool detects_peer_death = true;
  bool needs_rdma_port = false;  // skips where no RDMA port is active
  std::vector<std::pair<std::string, std::string>> env;  // more environment for the ranks
};

std::vector<TransportParam> AllTransportParams();

// gtest prints parameters with this (the name, not the bytes).
inline void PrintTo(const TransportParam& p, std::ostream* os) { *os << p.name; }

// "" if `p` can run here, else why not (for GTEST_SKIP).
std::string SkipReason(const TransportParam& p);

// Sets up the environment `p` needs (UCX_TLS, env) in this (forked) rank.
void ApplyEnvironment(const TransportParam& p);

// A transport of kind p for rank ctx.rank that will connect to `peers` with `streams` each.
std::unique_ptr<transport::Transport> MakeTransport(const TransportParam& p, const RankContext& ctx,
                                                    const std::vector<int>& peers, int streams);

// Rendezvous (127.0.0.1:ctx.master_port, job "test") and Connect to every other rank; returns the
// transport and the connections, peer by peer in rank order, streams within.
struct Connected {
  std::unique_ptr<transport::Transport> transport;
  // Declared after the transport, so destroyed before it.
  std::vector<std::unique_ptr<transport::Connection>> connections;
};
Connected ConnectAll(const TransportParam& p, const RankContext& ctx, int streams = 1);

}  // namespace pipesgd::testing
