// The vocabulary the embedding API (pipesgd/pipesgd.h) shares with the library inside: which
// transport, which reduction, which codec on the wire. One definition for both sides, so
// nothing is translated at the boundary.
#pragma once

#include <cstdint>

namespace pipesgd {

// kTcp is always built; kUcx and kIbverbs only where their libraries were found at build time.
enum class TransportKind { kTcp, kUcx, kIbverbs };

// kSum, or kAverage (the sum divided by the world size).
enum class ReduceOp : uint8_t { kSum = 1, kAverage = 2 };

// Compression of the chunks on the wire (docs/compression.md): kNone; kTrunc16 (bf16 by
// truncation); kFp16; kQ8 (8-bit with a per-chunk scale); kQ4 (4-bit, a scale per 256
// elements); kSign1 (1-bit scaled sign). The values are the wire's codec byte.
enum class CodecKind : uint8_t { kNone = 0, kTrunc16 = 1, kFp16 = 2, kQ8 = 3, kQ4 = 4, kSign1 = 5 };

}  // namespace pipesgd
