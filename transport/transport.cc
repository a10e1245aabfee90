#include "transport/transport.h"

#include <algorithm>
#include <chrono>

#include "core/base/error.h"
#include "core/base/log.h"

namespace pipesgd::transport {

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

std::unique_ptr<MemoryRegion> Transport::RegisterMemory(void* data, size_t bytes,
                                                        MemoryKind kind) {
  if (kind != MemoryKind::kHost) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: the {} transport cannot send from or receive into {} memory ({} bytes at {}); "
          "use a transport with GPU support (ibverbs with GPUDirect RDMA, or UCX built with CUDA)",
          rank(), name(), MemoryKindName(kind), bytes, data);
  }
  return std::make_unique<MemoryRegion>(data, bytes, kind);
}

void Transport::Wait(Op& op, Deadline deadline, const char* what, const std::atomic<bool>* abort) {
  const auto start = Deadline::Clock::now();
  const auto stall_after = std::min<Deadline::Clock::duration>(
      std::chrono::seconds(10), (deadline.when() - start) / 4);
  const int spins = SpinsBeforeIdle();
  bool warned = false;
  int idle = 0;
  while (!op.done) {
    if (abort && abort->load(std::memory_order_relaxed)) {
      Throw(ErrorCode::kAborted, "rank {}: {}: aborted", rank(), what);
    }
    if (!warned && Deadline::Clock::now() - start > stall_after) {
      warned = true;
      PSGD_LOG_WARN("rank {}: still waiting after {:.1f} s for {} ({} of {} bytes; deadline in "
                    "{:.0f} s)",
                    rank(), std::chrono::duration<double>(Deadline::Clock::now() - start).count(),
                    what, op.bytes_done, op.total_bytes(),
                    std::chrono::duration<double>(deadline.when() - Deadline::Clock::now()).count());
    }
    if (deadline.expired()) {
      Throw(ErrorCode::kDeadlineExceeded,
            "rank {}: timed out waiting for {} ({} bytes): the peer is stalled or gone", rank(),
            what, op.total_bytes());
    }
    if (ProgressOnce()) {
      idle = 0;
      continue;
    }
    if (++idle < spins) continue;
    Idle(std::min(deadline.when(), Deadline::Clock::now() + std::chrono::milliseconds(50)));
  }
  if (op.error) std::rethrow_exception(op.error);
}

}  // namespace pipesgd::transport
