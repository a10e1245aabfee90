// One rank of an exact AllReduce check, for the cluster tier: started on each emulated lab node
// with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set. Rank r contributes 1000*r + i; every
// element of the sum must be exact. Prints "rank R ok: ..." and exits 0, or names the first
// wrong element and exits 1.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/collective/ring_allreduce.h"
#include "transport/message_io.h"
#include "transport/rendezvous.h"
#include "transport/tcp/tcp_transport.h"

int main() {
  using namespace pipesgd;
  try {
    const int rank = std::atoi(std::getenv("RANK"));
    const int world = std::atoi(std::getenv("WORLD_SIZE"));
    const std::string master = std::getenv("MASTER_ADDR");
    const uint16_t port = static_cast<uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
    transport::tcp::TcpOptions tcp{rank, world, transport::LocalIpToward(master, port)};
    auto transport = transport::tcp::CreateTcpTransport(tcp);
    transport::RendezvousOptions rdv{master, port, rank, world, "allreduce_check", ""};
    auto addresses = transport::RendezvousAllGather(rdv, transport->LocalAddress(),
                                                    Deadline::After(30));
    auto comm = collective::Communicator::Create(std::move(transport), world, addresses, {},
                                                 Deadline::After(30));
    for (uint64_t count : {0ull, 1ull, 7ull, 1023ull, 1ull << 20, (1ull << 22) + 3}) {
      std::vector<float> data(count);
      for (uint64_t i = 0; i < count; ++i) data[i] = static_cast<float>(1000 * rank + i % (1 << 20));
      comm->AllReduce(data, collective::ReduceOp::kSum, Deadline::After(60));
      for (uint64_t i = 0; i < count; ++i) {
        const float expected = static_cast<float>(1000.0 * world * (world - 1) / 2 +
                                                  static_cast<double>(world) * (i % (1 << 20)));
        if (data[i] != expected) {
          std::fprintf(stderr, "rank %d: count %llu element %llu = %.1f, expected %.1f\n", rank,
                       static_cast<unsigned long long>(count), static_cast<unsigned long long>(i),
                       data[i], expected);
          return 1;
        }
      }
    }
    std::printf("rank %d ok: %d ranks, %s, exact sums up to 2^22+3 elements\n", rank, world,
                addresses.size() == static_cast<size_t>(world) ? "ring connected" : "?");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
