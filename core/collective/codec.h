// Gradient compression codecs for the ring AllReduce: each one turns one chunk of fp32 values
// into a smaller byte string and back, so that the ring moves fewer bytes per element.
//
// Pipe-SGD (Li et al., NeurIPS 2018, its section on compression) truncates every fp32 gradient to
// its upper 16 bits before it goes on the wire; `trunc16` is that codec (the result is bfloat16).
// `fp16` (IEEE binary16) and `q8` (per-chunk min-max 8-bit quantization, optionally with the
// unbiased stochastic rounding of QSGD, Alistarh et al., NeurIPS 2017) are the two others.
// Below 8 bits (codec_lowbit.cc): `q4` (min-max quantization to 4 bits, one scale per group of
// 256 elements) and `sign1` (the scaled sign of EF-SignSGD: 1 bit per element and the group's
// mean |x|). They are meant to run with error feedback (CommunicatorOptions::error_feedback).
//
// How the ring uses a codec, chunk by chunk (the API is over spans of one chunk):
//   reduce-scatter hop: DecodeAdd(received bytes, local fp32 chunk), then Encode(local chunk)
//                       and send the bytes to the right;
//   all-gather:         the owner of a block encodes each reduced chunk once; every other rank
//                       Decodes the same bytes. The owner must also replace its own copy with
//                       Decode(Encode(chunk)), or its replica differs from everyone else's.
//
// Wire format: every multi-byte value is little-endian (the host order on every supported
// platform; codec.cc static_asserts it), with no padding and no alignment requirement on the
// byte spans. Element i of a chunk is always at the same place, and EncodedBytes(n) is a pure
// function of n, so the receiver knows the payload size from the element count alone:
//   none     n x fp32 (the value's bits)                                       4n bytes
//   trunc16  n x uint16: the upper 16 bits of each fp32 (= bfloat16)          2n bytes
//   fp16     n x uint16: IEEE binary16                                         2n bytes
//   q8       fp32 min, fp32 scale, then n x uint8 codes; x = min + code*scale  8 + n bytes
//            (EncodedBytes(0) = 8: an empty chunk still carries its 8-byte header)
//   q4       per group of 256 (the last may be shorter): fp32 min, fp32 scale, then two 4-bit
//            codes a byte (low nibble first); x = min + code*scale
//                                                        8 * ceil(n/256) + ceil(n/2) bytes
//   sign1    per group of 256: fp32 scale = mean |x|, then one sign bit an element (bit j%8 of
//            byte j/8); x = +-scale                       4 * ceil(n/256) + ceil(n/8) bytes
//
// Errors: Encode throws Error(kNumerical) if the chunk holds a NaN or an infinity, naming the
// element index (within the chunk) and the value; what it wrote to dst is then unspecified.
// A size mismatch between a span and EncodedBytes is a caller bug (PSGD_CHECK). Decode trusts
// its input (the transport has checked the chunk header and its length): corrupt payload bytes
// give wrong values, never an out-of-bounds access.
//
// Reproducibility: every codec is a deterministic function of (options, src, stream). Rounding
// uses the default floating-point environment (round to nearest even); FTZ/DAZ do not change
// any result, except sign1's scale of a group of subnormal values (its mean |x| is summed in
// double from the floats, which DAZ reads as zero).
//
// Performance: Encode/Decode/DecodeAdd do no allocation and no virtual call per element; their
// inner loops are branch-free and vectorize at the baseline x86-64 target (SSE2). Encode reads
// src once (twice for q8: min/max, then codes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "pipesgd/types.h"

namespace pipesgd {

// CodecKind: pipesgd/types.h (public, shared with the embedding API).

// "none", "trunc16", "fp16", "q8", "q4", "sign1" ("unknown" for a value outside the enum).
std::string_view CodecName(CodecKind kind);

// The inverse of CodecName (exact, lower case). Throws Error(kInvalidArgument) naming the value
// and the accepted names for anything else.
CodecKind ParseCodecKind(std::string_view name);

struct CodecOptions {
  CodecKind kind = CodecKind::kNone;
  // trunc16 only: round to nearest even on the 16 dropped bits instead of truncating.
  bool round_to_nearest_even = false;
  // q8 and q4 only: code = floor(t) + (u < frac(t)) with u uniform in [0, 1) (unbiased),
  // instead of round-to-nearest-even of t.
  bool stochastic_rounding = false;
  // q8/q4 stochastic only: keys the noise, together with Encode's `stream` and the element index.
  uint64_t seed = 0;
};

// What Encode had to change beyond ordinary rounding.
struct EncodeStats {
  // Elements whose rounded value would not have been finite and were clamped to the largest
  // finite value of the format, keeping the sign: fp16 |x| >= 65520 -> +-65504; trunc16 with
  // round_to_nearest_even, |x| >= 0x1.ffp+127 -> +-0x1.fep+127 (the largest finite bf16).
  uint64_t saturated = 0;

  EncodeStats& operator+=(const EncodeStats& other) {
    saturated += other.saturated;
    return *this;
  }
};

// One codec instance is immutable after MakeCodec: share it between threads freely.
class Codec {
 public:
  virtual ~Codec() = default;

  CodecKind kind() const { return options_.kind; }
  const CodecOptions& options() const { return options_; }

  // Encoded size in bytes of n fp32 elements; a pure function of n (see the table above).
  virtual size_t EncodedBytes(size_t n) const = 0;

  // Encodes src (n elements) into dst, which must be exactly EncodedBytes(n) bytes (PSGD_CHECK).
  // `stream` is any caller value mixed into the stochastic-rounding noise (q8/q4 stochastic only;
  // ignored otherwise): the same (seed, stream, src) always gives the same bytes. Give each
  // Encode whose noise should be independent its own stream value, e.g.
  // (seq * world_size + rank) * max_chunks_per_rank + chunk_index; two ranks that encode with the
  // same seed and stream get correlated rounding noise, which no longer averages out.
  // Throws Error(kNumerical) naming the element index and value if src holds a NaN or an Inf.
  virtual EncodeStats Encode(std::span<const float> src, std::span<std::byte> dst,
                             uint64_t stream = 0) const = 0;

  // dst[i] = decoded value of element i. src must be exactly EncodedBytes(dst.size()) bytes.
  virtual void Decode(std::span<const std::byte> src, std::span<float> dst) const = 0;

  // dst[i] += decoded value of element i (fused for the reduce-scatter hop); bitwise the same
  // as Decode into a temporary followed by dst[i] += tmp[i].
  virtual void DecodeAdd(std::span<const std::byte> src, std::span<float> dst) const = 0;

  // An upper bound on |x - Decode(Encode(x))| for a finite element x of a chunk whose smallest
  // and largest values are chunk_min and chunk_max (used by q8 only). With A = max(|chunk_min|,
  // |chunk_max|) and, for q8, scale = the stored scale ~= (chunk_max - chunk_min) / 255:
  //   none                     0 (bitwise exact)
  //   trunc16 (truncation)     max(|x| * 2^-7, 2^-133)       (less than one bf16 ulp of x)
  //   trunc16 (RNE)            max(|x| * 2^-8, 2^-134)       (half a bf16 ulp; also when saturated)
  //   fp16, |x| <  65520       max(|x| * 2^-11, 2^-25)       (half an fp16 ulp; 2^-25 subnormals)
  //   fp16, |x| >= 65520       |x| - 65504                   (saturated)
  //   q8 (round to even)       scale/2 + slack
  //   q8 (stochastic)          scale   + slack
  //   q8 slack = scale * 2^-12 + A * 2^-20 + 2^-149: float rounding of (x - min) / scale and of
  //   min + code*scale, and of a subnormal result. A constant chunk (scale 0) is exact: 0.
  //   q4                       as q8, with scale ~= (chunk_max - chunk_min) / 15 (a group's
  //                            range lies inside the chunk's, so its step is no larger)
  //   sign1                    max(|x|, A) * (1 + 2^-20) + 2^-149: ||x| - s| with s <= A; one
  //                            encode can lose all of x, which error feedback gives back later
  // The 2^-133 / 2^-134 / 2^-25 / 2^-149 terms only matter in the format's subnormal range.
  virtual double ErrorBound(double x, double chunk_min, double chunk_max) const = 0;

 protected:
  explicit Codec(const CodecOptions& options) : options_(options) {}

 private:
  CodecOptions options_;
};

// Throws Error(kInvalidArgument) for an unknown kind, or for a rounding option that the kind
// does not use (round_to_nearest_even without trunc16, stochastic_rounding without q8 or q4), so that
// a misconfigured job fails instead of silently ignoring a setting. `seed` is never rejected.
std::unique_ptr<Codec> MakeCodec(const CodecOptions& options);

// Pieces of the q8 codec that the CUDA codecs (core/cuda/cuda_codec.h) share with the
// CPU ones, so that both compute the header and the noise identically. Not for other callers.
namespace codec_internal {
// The stored scale of a chunk with smallest and largest values mn, mx (0 for a constant chunk).
float Q8Scale(float mn, float mx);
// Whether the float fast path applies to (mn, scale); else double arithmetic.
bool Q8FastPath(float mn, float scale);
// The stochastic-rounding noise key of elements [segment * 2^32, (segment + 1) * 2^32).
struct NoiseKey {
  uint32_t lo, hi;
};
NoiseKey MakeNoiseKey(uint64_t seed, uint64_t stream, uint64_t segment);
}  // namespace codec_internal

}  // namespace pipesgd
