// libFuzzer target: 48 bytes received where a chunk header is expected, checked against what a
// rank expects. Must pass only for the exact expected header, else throw pipesgd::Error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/base/error.h"
#include "core/collective/ring_allreduce.h"

using pipesgd::collective::ChunkHeader;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < sizeof(ChunkHeader)) return 0;
  ChunkHeader got;
  std::memcpy(&got, data, sizeof(ChunkHeader));
  ChunkHeader want;
  want.op = 1;
  want.dtype = 1;
  want.codec = 3;
  want.seq = 7;
  want.count = 1000;
  want.chunk_index = 2;
  want.payload_bytes = 258;
  try {
    pipesgd::collective::CheckChunkHeader(got, want, 1, 0);
    // Accepted: then every checked field must be the expected one.
    if (got.magic != want.magic || got.seq != want.seq || got.count != want.count ||
        got.payload_bytes != want.payload_bytes || got.codec != want.codec) {
      std::abort();
    }
  } catch (const pipesgd::Error&) {
  }
  return 0;
}
