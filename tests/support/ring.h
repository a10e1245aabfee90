// Builds a ring communicator for a test rank on loopback TCP (rendezvous at
// 127.0.0.1:ctx.master_port).
#pragma once

#include <memory>

#include "core/collective/ring_allreduce.h"
#include "tests/support/multiproc.h"
#include "transport/rendezvous.h"
#include "transport/tcp/tcp_transport.h"

namespace pipesgd::testing {

inline std::unique_ptr<collective::Communicator> ConnectRing(
    const RankContext& ctx, const collective::CommunicatorOptions& options) {
  transport::tcp::TcpOptions tcp;
  tcp.rank = ctx.rank;
  tcp.world_size = ctx.world_size;
  tcp.bind_host = "127.0.0.1";
  auto transport = transport::tcp::CreateTcpTransport(tcp);
  transport::RendezvousOptions rdv{"127.0.0.1", ctx.master_port, ctx.rank, ctx.world_size, "test", ""};
  auto addresses =
      transport::RendezvousAllGather(rdv, transport->LocalAddress(), Deadline::After(30));
  return collective::Communicator::Create(std::move(transport), ctx.world_size, addresses,
                                          options, Deadline::After(30));
}

inline std::unique_ptr<collective::Communicator> ConnectRing(const RankContext& ctx,
                                                             uint64_t chunk_bytes = 1 << 20,
                                                             int streams = 1) {
  collective::CommunicatorOptions options;
  options.chunk_bytes = chunk_bytes;
  options.streams = streams;
  return ConnectRing(ctx, options);
}

}  // namespace pipesgd::testing
