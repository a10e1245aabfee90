#include "transport/transport.h"

#include "core/base/error.h"

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

}  // namespace pipesgd::transport
