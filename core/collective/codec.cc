#include "core/collective/codec.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/collective/codec_internal.h"

namespace pipesgd {

// The wire format is little-endian and every codec works on the host's representation.
static_assert(std::endian::native == std::endian::little,
              "codec.cc writes host-order words; port it before using a big-endian host");
static_assert(std::numeric_limits<float>::is_iec559, "codecs assume IEEE-754 binary32 floats");

namespace codec_internal {

void ThrowNonFinite(CodecKind kind, std::span<const float> src, size_t from) {
  for (size_t i = from; i < src.size(); ++i) {
    if (!std::isfinite(src[i])) {
      Throw(ErrorCode::kNumerical,
            "{} codec: element {} of a chunk of {} is {}; only finite values can be encoded",
            CodecName(kind), i, src.size(), src[i]);
    }
  }
  PSGD_CHECK(false && "ThrowNonFinite called on a finite chunk");
  std::abort();  // unreachable; keeps [[noreturn]] honest for the compiler
}

}  // namespace codec_internal

namespace {

using codec_internal::Bits;
using codec_internal::FromBits;
using codec_internal::kBlock;
using codec_internal::NonFinite;
using codec_internal::ThrowNonFinite;

// ---------------------------------------------------------------------------------------------
// none: the fp32 bits, unchanged.

class NoneCodec final : public Codec {
 public:
  explicit NoneCodec(const CodecOptions& options) : Codec(options) {}

  size_t EncodedBytes(size_t n) const override { return n * sizeof(float); }

  EncodeStats Encode(std::span<const float> src, std::span<std::byte> dst,
                     uint64_t /*stream*/) const override {
    PSGD_CHECK_EQ(dst.size(), EncodedBytes(src.size()));
    const size_t n = src.size();
    const float* in = src.data();
    for (size_t b = 0; b < n; b += kBlock) {
      const size_t len = std::min(kBlock, n - b);
      uint32_t bad = 0;
      for (size_t j = 0; j < len; ++j) bad |= NonFinite(Bits(in[b + j]));
      if (bad) ThrowNonFinite(kind(), src, b);
      std::memcpy(dst.data() + b * sizeof(float), in + b, len * sizeof(float));
    }
    return {};
  }

  void Decode(std::span<const std::byte> src, std::span<float> dst) const override {
    PSGD_CHECK_EQ(src.size(), EncodedBytes(dst.size()));
    if (!dst.empty()) std::memcpy(dst.data(), src.data(), src.size());
  }

  void DecodeAdd(std::span<const std::byte> src, std::span<float> dst) const override {
    PSGD_CHECK_EQ(src.size(), EncodedBytes(dst.size()));
    const std::byte* in = src.data();
    float* out = dst.data();
    for (size_t i = 0; i < dst.size(); ++i) {
      float v;
      std::memcpy(&v, in + i * sizeof(float), sizeof(float));
      out[i] += v;
    }
  }

  double ErrorBound(double, double, double) const override { return 0.0; }
};

// ---------------------------------------------------------------------------------------------
// Codecs that send one uint16 per element: trunc16 and fp16 share the block loops and differ in
// the per-element conversion, passed in as an inline function object (no call per element).

template <typename Derived>
class Codec16 : public Codec {
 public:
  explicit Codec16(const CodecOptions& options) : Codec(options) {}

  size_t EncodedBytes(size_t n) const override { return n * sizeof(uint16_t); }

  void Decode(std::span<const std::byte> src, std::span<float> dst) const override {
    Run</*kAdd=*/false>(src, dst);
  }
  void DecodeAdd(std::span<const std::byte> src, std::span<float> dst) const override {
    Run</*kAdd=*/true>(src, dst);
  }

 protected:
  // to_half(uint32_t fp32_bits, uint32_t& saturated) -> uint16_t code.
  template <typename ToHalf>
  EncodeStats EncodeWith(std::span<const float> src, std::span<std::byte> dst,
                         ToHalf to_half) const {
    PSGD_CHECK_EQ(dst.size(), EncodedBytes(src.size()));
    const size_t n = src.size();
    const float* in = src.data();
    EncodeStats stats;
    for (size_t b = 0; b < n; b += kBlock) {
      const size_t len = std::min(kBlock, n - b);
      uint16_t tmp[kBlock];
      uint32_t bad = 0;
      uint32_t saturated = 0;
      for (size_t j = 0; j < len; ++j) {
        const uint32_t x = Bits(in[b + j]);
        bad |= NonFinite(x);
        tmp[j] = to_half(x, saturated);
      }
      if (bad) ThrowNonFinite(kind(), src, b);
      stats.saturated += saturated;
      std::memcpy(dst.data() + b * sizeof(uint16_t), tmp, len * sizeof(uint16_t));
    }
    return stats;
  }

 private:
  template <bool kAdd>
  void Run(std::span<const std::byte> src, std::span<float> dst) const {
    PSGD_CHECK_EQ(src.size(), EncodedBytes(dst.size()));
    const size_t n = dst.size();
    float* out = dst.data();
    for (size_t b = 0; b < n; b += kBlock) {
      const size_t len = std::min(kBlock, n - b);
      uint16_t tmp[kBlock];
      std::memcpy(tmp, src.data() + b * sizeof(uint16_t), len * sizeof(uint16_t));
      for (size_t j = 0; j < len; ++j) {
        const float v = Derived::FromHalf(tmp[j]);
        if constexpr (kAdd) {
          out[b + j] += v;
        } else {
          out[b + j] = v;
        }
      }
    }
  }
};

// trunc16: the upper half of the fp32 bits (bfloat16). Truncation drops the low 16 bits; RNE
// adds 0x7fff plus the kept LSB before dropping them, and a finite value that would round up to
// the Inf pattern (|x| >= 0x1.ffp+127 does) is clamped to the largest finite bf16.
class Trunc16Codec final : public Codec16<Trunc16Codec> {
 public:
  explicit Trunc16Codec(const CodecOptions& options)
      : Codec16(options), rne_(options.round_to_nearest_even) {}

  EncodeStats Encode(std::span<const float> src, std::span<std::byte> dst,
                     uint64_t /*stream*/) const override {
    if (!rne_) {
      return EncodeWith(src, dst, [](uint32_t x, uint32_t&) {
        return static_cast<uint16_t>(x >> 16);
      });
    }
    return EncodeWith(src, dst, [](uint32_t x, uint32_t& saturated) {
      // x + 0x7fff + lsb cannot wrap for a finite x (at most 0xff7fffff + 0x8000).
      const uint32_t h = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
      // Rounding a finite value can only reach the Inf pattern 0x7f80 | sign (mantissa 0);
      // one less is the largest finite value of that sign.
      const uint32_t overflow = (h & 0x7f80u) == 0x7f80u ? 1u : 0u;
      saturated += overflow;
      return static_cast<uint16_t>(h - overflow);
    });
  }
  static float FromHalf(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

  double ErrorBound(double x, double, double) const override {
    return rne_ ? std::max(std::fabs(x) * 0x1p-8, 0x1p-134)
                : std::max(std::fabs(x) * 0x1p-7, 0x1p-133);
  }

 private:
  bool rne_;
};

// fp16: IEEE binary16, round to nearest even, subnormals, saturation at +-65504.
//
// fp32 -> fp16 (after F. Giesen's float_to_half_fast3_rtne, made branch-free so it vectorizes):
//  - |x| >= 2^-14 (fp16 normal): rebias the exponent by 127 - 15 and round the 13 dropped
//    mantissa bits to nearest even with an integer add (0xfff + the kept LSB); a carry moves into
//    the exponent as it should.
//  - |x| <  2^-14 (fp16 subnormal or zero): |x| + 0.5f. The ulp of 0.5f is 2^-24, the fp16
//    subnormal step, so the fp32 addition itself rounds |x| to a multiple of 2^-24 to nearest
//    even, and the low mantissa bits of the sum are the fp16 code (1024 = the smallest normal,
//    which is right). The sum is never subnormal, so FTZ/DAZ cannot change it.
//  - |x| >= 65520 = 65504 + half an ulp rounds to Inf under RNE (65520 is a tie and 65504's
//    mantissa is odd): clamp to 65504 and count it.
class Fp16Codec final : public Codec16<Fp16Codec> {
 public:
  explicit Fp16Codec(const CodecOptions& options) : Codec16(options) {}

  EncodeStats Encode(std::span<const float> src, std::span<std::byte> dst,
                     uint64_t /*stream*/) const override {
    PSGD_CHECK_EQ(dst.size(), EncodedBytes(src.size()));
    const size_t n = src.size();
    const float* in = src.data();
    EncodeStats stats;
    for (size_t b = 0; b < n; b += kBlock) {
      const size_t len = std::min(kBlock, n - b);
      // The subnormal candidate |x| + 0.5f for the whole block first, in a loop of its own: in
      // the same loop GCC sinks the float add into the branch that uses it, and then (as it
      // may trap, -ftrapping-math) refuses to vectorize the loop.
      uint32_t sub[kBlock];
      for (size_t j = 0; j < len; ++j) {
        sub[j] = Bits(FromBits(Bits(in[b + j]) & 0x7fffffffu) + 0.5f) - 0x3f000000u;
      }
      uint16_t tmp[kBlock];
      uint32_t bad = 0;
      uint32_t saturated = 0;
      for (size_t j = 0; j < len; ++j) {
        const uint32_t x = Bits(in[b + j]);
        bad |= NonFinite(x);
        const uint32_t sign = (x >> 16) & 0x8000u;
        const uint32_t a = x & 0x7fffffffu;
        const uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
        const uint32_t subnormal = sub[j];
        // Selects by masks (all ones or zero), which vectorize as blends.
        const uint32_t is_sub = 0u - (a < 0x38800000u ? 1u : 0u);  // |x| < 2^-14
        const uint32_t clamp = 0u - (a >= 0x477ff000u ? 1u : 0u);  // |x| >= 65520
        const uint32_t rounded = (subnormal & is_sub) | (normal & ~is_sub);
        const uint32_t h = (rounded & ~clamp) | (0x7bffu & clamp);
        saturated -= clamp;  // + 1 where clamped
        tmp[j] = static_cast<uint16_t>(h | sign);
      }
      if (bad) ThrowNonFinite(kind(), src, b);
      stats.saturated += saturated;
      std::memcpy(dst.data() + b * sizeof(uint16_t), tmp, len * sizeof(uint16_t));
    }
    return stats;
  }

  // fp16 -> fp32 (Giesen's half_to_float, branch-free): normal values shift the exponent and
  // mantissa into place and rebias by 127 - 15; Inf/NaN rebias once more to exponent 255;
  // subnormals m * 2^-24 are (0.5f with m in its low bits) - 0.5f, exact.
  static float FromHalf(uint16_t h) {
    const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
    const uint32_t em = static_cast<uint32_t>(h) & 0x7fffu;
    const uint32_t inf_nan = 0u - (em >= 0x7c00u ? 1u : 0u);
    const uint32_t normal = (em << 13) + 0x38000000u + (0x38000000u & inf_nan);
    const uint32_t subnormal = Bits(FromBits(0x3f000000u + em) - 0.5f);
    const uint32_t is_sub = 0u - (em < 0x0400u ? 1u : 0u);
    return FromBits((subnormal & is_sub) | (normal & ~is_sub) | sign);
  }

  double ErrorBound(double x, double, double) const override {
    const double a = std::fabs(x);
    if (a >= 65520.0) return a - 65504.0;
    return std::max(a * 0x1p-11, 0x1p-25);
  }
};

// ---------------------------------------------------------------------------------------------
// q8: per-chunk min-max quantization to 8 bits.
//
// Header: min (fp32), scale (fp32); then one code per element; x' = min + code * scale.
// scale is (max - min) / 255 rounded up to a float, so (x - min) / scale <= 255 for every x.
// Fast path (float arithmetic, vectorized): for 2^-126 <= scale <= 2^118 and |min| <= 2^126,
// where nothing in t = (x - min) * (1 / scale) or min + code * scale can overflow or lose the
// scale to subnormal precision. Otherwise (tiny or huge ranges) the chunk goes through double
// arithmetic, element by element. Encoder and decoder pick the path from the stored header, so
// they always agree. scale == 0 (a constant chunk, zeros included) writes codes 0 and decodes
// every element to min itself, bitwise (-0.0 included; a chunk that mixes +0.0 and -0.0 is
// constant too and decodes to zeros of the sign of whichever zero the min search kept).

uint64_t Mix64(uint64_t z) {  // the SplitMix64 finalizer (as in core/base/rng.h)
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

namespace codec_internal {

// In kLanes independent lanes: a float min/max reduction does not vectorize
// without -ffast-math, but `x < lo ? x : lo` per lane is minps.
bool MinMax(const float* in, size_t n, float& mn, float& mx) {
  constexpr size_t kLanes = 16;
  float lo[kLanes], hi[kLanes];
  const float first = n == 0 ? 0.0f : in[0];
  for (size_t k = 0; k < kLanes; ++k) lo[k] = hi[k] = first;
  uint32_t bad = 0;
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t k = 0; k < kLanes; ++k) {
      const float x = in[i + k];
      bad |= NonFinite(Bits(x));
      lo[k] = x < lo[k] ? x : lo[k];
      hi[k] = hi[k] < x ? x : hi[k];
    }
  }
  for (; i < n; ++i) {
    const float x = in[i];
    bad |= NonFinite(Bits(x));
    lo[0] = x < lo[0] ? x : lo[0];
    hi[0] = hi[0] < x ? x : hi[0];
  }
  mn = lo[0];
  mx = hi[0];
  for (size_t k = 1; k < kLanes; ++k) {
    mn = lo[k] < mn ? lo[k] : mn;
    mx = mx < hi[k] ? hi[k] : mx;
  }
  return bad == 0;
}

float MinMaxScale(float mn, float mx, double levels) {
  const double range = static_cast<double>(mx) - static_cast<double>(mn);
  if (!(range > 0.0)) return 0.0f;
  float scale = static_cast<float>(range / levels);
  // Round up, so that no element's t = (x - min) / scale exceeds `levels` (levels * scale is
  // exact in double). This also keeps a positive range from getting scale 0.
  if (static_cast<double>(scale) * levels < range) {
    scale = std::nextafter(scale, std::numeric_limits<float>::infinity());
  }
  return scale;
}

float Q8Scale(float mn, float mx) { return MinMaxScale(mn, mx, 255.0); }

bool Q8FastPath(float mn, float scale) {
  return scale >= 0x1p-126f && scale <= 0x1p118f && std::fabs(mn) <= 0x1p126f;
}

// The stochastic-rounding noise: a counter-based generator in the style of SplitMix64 (a Weyl
// sequence through a mixing function), keyed per (seed, stream, index >> 32) with the 64-bit
// SplitMix64 finalizer and mixed per element with a 32-bit finalizer (C. Wellons' "lowbias32")
// so that the loop vectorizes. Returns u in [0, 1) on a 2^-24 grid.
NoiseKey MakeNoiseKey(uint64_t seed, uint64_t stream, uint64_t segment) {
  const uint64_t k =
      Mix64(Mix64(Mix64(seed + 0x9e3779b97f4a7c15ULL) + stream) + segment);
  return {static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

}  // namespace codec_internal

namespace {

using codec_internal::MakeNoiseKey;
using codec_internal::MinMax;
using codec_internal::Noise;
using codec_internal::NoiseKey;
using codec_internal::Q8FastPath;
using codec_internal::Q8Scale;
class Q8Codec final : public Codec {
 public:
  static constexpr size_t kHeaderBytes = 2 * sizeof(float);

  explicit Q8Codec(const CodecOptions& options)
      : Codec(options), stochastic_(options.stochastic_rounding), seed_(options.seed) {}

  size_t EncodedBytes(size_t n) const override { return kHeaderBytes + n; }

  EncodeStats Encode(std::span<const float> src, std::span<std::byte> dst,
                     uint64_t stream) const override {
    PSGD_CHECK_EQ(dst.size(), EncodedBytes(src.size()));
    const size_t n = src.size();
    const float* in = src.data();

    float mn = 0.0f, mx = 0.0f;
    if (!MinMax(in, n, mn, mx)) ThrowNonFinite(kind(), src, 0);
    const float scale = Q8Scale(mn, mx);
    std::memcpy(dst.data(), &mn, sizeof(float));
    std::memcpy(dst.data() + sizeof(float), &scale, sizeof(float));
    std::byte* codes = dst.data() + kHeaderBytes;
    if (n == 0) return {};

    if (scale == 0.0f) {
      std::memset(codes, 0, n);
    } else if (Q8FastPath(mn, scale)) {
      const float inv = 1.0f / scale;
      if (!stochastic_) {
        for (size_t i = 0; i < n; ++i) {
          const float t = (in[i] - mn) * inv;  // in [0, 255 + a few ulps]
          // t + 2^23 rounds t to an integer, to nearest even, into the low mantissa bits.
          const uint32_t c = Bits(t + 0x1p23f) - 0x4b000000u;
          codes[i] = static_cast<std::byte>(std::min(c, 255u));
        }
      } else {
        ForSegments(n, stream, [&](size_t begin, size_t end, NoiseKey key) {
          for (size_t i = begin; i < end; ++i) {
            const float t = (in[i] - mn) * inv;
            const int32_t fl = static_cast<int32_t>(t);  // floor, t >= 0
            const float frac = t - static_cast<float>(fl);
            const uint32_t up = Noise(static_cast<uint32_t>(i), key) < frac ? 1u : 0u;
            codes[i] = static_cast<std::byte>(std::min(static_cast<uint32_t>(fl) + up, 255u));
          }
        });
      }
    } else {
      const double dmn = mn, dscale = scale;
      ForSegments(n, stream, [&](size_t begin, size_t end, NoiseKey key) {
        for (size_t i = begin; i < end; ++i) {
          const double t = (static_cast<double>(in[i]) - dmn) / dscale;
          double c;
          if (!stochastic_) {
            c = (t + 0x1p52) - 0x1p52;  // to nearest even
          } else {
            const double fl = std::floor(t);
            c = fl + (static_cast<double>(Noise(static_cast<uint32_t>(i), key)) < t - fl ? 1 : 0);
          }
          codes[i] = static_cast<std::byte>(static_cast<uint32_t>(std::clamp(c, 0.0, 255.0)));
        }
      });
    }
    return {};
  }

  void Decode(std::span<const std::byte> src, std::span<float> dst) const override {
    Run</*kAdd=*/false>(src, dst);
  }
  void DecodeAdd(std::span<const std::byte> src, std::span<float> dst) const override {
    Run</*kAdd=*/true>(src, dst);
  }

  double ErrorBound(double, double chunk_min, double chunk_max) const override {
    const float scale = Q8Scale(static_cast<float>(chunk_min), static_cast<float>(chunk_max));
    if (scale == 0.0f) return 0.0;
    const double s = scale;
    const double a = std::max(std::fabs(chunk_min), std::fabs(chunk_max));
    return (stochastic_ ? s : s / 2) + s * 0x1p-12 + a * 0x1p-20 + 0x1p-149;
  }

 private:
  // Calls f(begin, end, key) over [0, n) in pieces whose indices share their upper 32 bits, so
  // that the per-element noise is a function of (seed, stream, full 64-bit index).
  template <typename F>
  void ForSegments(size_t n, uint64_t stream, F&& f) const {
    constexpr uint64_t kSegment = uint64_t{1} << 32;
    for (uint64_t begin = 0; begin < n; begin += kSegment) {
      const uint64_t end = std::min<uint64_t>(n, begin + kSegment);
      f(static_cast<size_t>(begin), static_cast<size_t>(end),
        MakeNoiseKey(seed_, stream, begin >> 32));
    }
  }

  template <bool kAdd>
  void Run(std::span<const std::byte> src, std::span<float> dst) const {
    PSGD_CHECK_EQ(src.size(), EncodedBytes(dst.size()));
    const size_t n = dst.size();
    float mn, scale;
    std::memcpy(&mn, src.data(), sizeof(float));
    std::memcpy(&scale, src.data() + sizeof(float), sizeof(float));
    const std::byte* codes = src.data() + kHeaderBytes;
    float* out = dst.data();
    auto put = [out](size_t i, float v) {
      if constexpr (kAdd) {
        out[i] += v;
      } else {
        out[i] = v;
      }
    };
    if (scale == 0.0f) {
      for (size_t i = 0; i < n; ++i) put(i, mn);
    } else if (Q8FastPath(mn, scale)) {
      for (size_t i = 0; i < n; ++i) {
        put(i, mn + static_cast<float>(static_cast<uint8_t>(codes[i])) * scale);
      }
    } else {
      constexpr double kMax = std::numeric_limits<float>::max();
      for (size_t i = 0; i < n; ++i) {
        const double y = static_cast<double>(mn) +
                         static_cast<double>(static_cast<uint8_t>(codes[i])) * scale;
        put(i, static_cast<float>(std::clamp(y, -kMax, kMax)));
      }
    }
  }

  bool stochastic_;
  uint64_t seed_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------

std::string_view CodecName(CodecKind kind) {
  switch (kind) {
    case CodecKind::kNone: return "none";
    case CodecKind::kTrunc16: return "trunc16";
    case CodecKind::kFp16: return "fp16";
    case CodecKind::kQ8: return "q8";
    case CodecKind::kQ4: return "q4";
    case CodecKind::kSign1: return "sign1";
  }
  return "unknown";
}

CodecKind ParseCodecKind(std::string_view name) {
  for (CodecKind kind : {CodecKind::kNone, CodecKind::kTrunc16, CodecKind::kFp16, CodecKind::kQ8,
                         CodecKind::kQ4, CodecKind::kSign1}) {
    if (name == CodecName(kind)) return kind;
  }
  Throw(ErrorCode::kInvalidArgument,
        "unknown codec \"{}\": expected one of none, trunc16, fp16, q8, q4, sign1", name);
}

std::unique_ptr<Codec> MakeCodec(const CodecOptions& options) {
  const CodecKind kind = options.kind;
  if (CodecName(kind) == "unknown") {
    Throw(ErrorCode::kInvalidArgument,
          "unknown codec kind {}: expected 0 (none), 1 (trunc16), 2 (fp16), 3 (q8), 4 (q4) or "
          "5 (sign1)",
          static_cast<int>(kind));
  }
  if (options.round_to_nearest_even && kind != CodecKind::kTrunc16) {
    Throw(ErrorCode::kInvalidArgument,
          "codec {}: round_to_nearest_even applies to trunc16 only", CodecName(kind));
  }
  if (options.stochastic_rounding && kind != CodecKind::kQ8 && kind != CodecKind::kQ4) {
    Throw(ErrorCode::kInvalidArgument, "codec {}: stochastic_rounding applies to q8 and q4 only",
          CodecName(kind));
  }
  switch (kind) {
    case CodecKind::kNone: return std::make_unique<NoneCodec>(options);
    case CodecKind::kTrunc16: return std::make_unique<Trunc16Codec>(options);
    case CodecKind::kFp16: return std::make_unique<Fp16Codec>(options);
    case CodecKind::kQ8: return std::make_unique<Q8Codec>(options);
    case CodecKind::kQ4: return codec_internal::MakeQ4Codec(options);
    case CodecKind::kSign1: return codec_internal::MakeSign1Codec(options);
  }
  PSGD_CHECK(false && "unreachable");
  return nullptr;
}

}  // namespace pipesgd
