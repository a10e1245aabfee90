// Pieces shared by the codec implementations (codec.cc: none, trunc16, fp16, q8; codec_lowbit.cc:
// q4, sign1). Not part of the codec API: include only from those files.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "core/collective/codec.h"

namespace pipesgd::codec_internal {

// Elements per inner loop: small enough for stack temporaries in L1, long enough to vectorize.
constexpr size_t kBlock = 256;

inline uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float FromBits(uint32_t b) { return std::bit_cast<float>(b); }
// 1 if the fp32 bit pattern is an Inf or a NaN (exponent all ones), else 0.
inline uint32_t NonFinite(uint32_t b) { return (b & 0x7f800000u) == 0x7f800000u ? 1u : 0u; }

// Throws Error(kNumerical) for the first non-finite element of src at or after `from` (there is
// one), naming the codec, the element's index within the chunk and its value.
[[noreturn]] void ThrowNonFinite(CodecKind kind, std::span<const float> src, size_t from);

// Sets mn, mx to the smallest and largest of in[0, n) (both 0 for n = 0); false if any element
// is not finite.
bool MinMax(const float* in, size_t n, float& mn, float& mx);

// The stored scale of a min-max quantizer with `levels` steps (255 for q8, 15 for q4) over
// [mn, mx]: (mx - mn) / levels rounded up to a float, so no (x - mn) / scale exceeds levels;
// 0 for a constant chunk.
float MinMaxScale(float mn, float mx, double levels);

// Stochastic-rounding noise of element `index` under `key`: u in [0, 1) on a 2^-24 grid.
inline float Noise(uint32_t index, NoiseKey key) {
  uint32_t x = (index ^ key.hi) * 0x9e3779b9u + key.lo;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return static_cast<float>(x >> 8) * 0x1p-24f;
}

std::unique_ptr<Codec> MakeQ4Codec(const CodecOptions& options);
std::unique_ptr<Codec> MakeSign1Codec(const CodecOptions& options);

}  // namespace pipesgd::codec_internal
