// The codecs below 8 bits per element: q4 (min-max quantization to 4 bits) and sign1 (the
// scaled sign of EF-SignSGD, Karimireddy et al., ICML 2019, and of 1-bit Adam's compression
// stage, Tang et al., ICML 2021). Both keep one scale per group of kGroup elements instead of
// one per chunk: a ring chunk holds up to a million elements, and one outlier would otherwise
// set the step of all of them (with 16 levels, or a single magnitude, that loses nearly every
// small gradient). The groups cost 8 (q4) or 4 (sign1) header bytes per 256 elements: 0.25 and
// 0.125 bits per element.
//
// Wire format, group after group (the last group may be shorter), little-endian:
//   q4     fp32 min, fp32 scale, then ceil(L/2) bytes; element j's code is the low nibble of
//          byte j/2 for even j, the high nibble for odd j; x = min + code * scale
//          EncodedBytes(n) = 8 * ceil(n / 256) + ceil(n / 2)
//   sign1  fp32 scale = mean |x| over the group, then ceil(L/8) bytes; bit j % 8 of byte j/8 is
//          the sign bit of element j; x = bit ? -scale : +scale
//          EncodedBytes(n) = 4 * ceil(n / 256) + ceil(n / 8)
// A constant group is exact in both (q4: scale 0; sign1: the mean of |c| is |c|, summed in
// double), and so is an all-zero one (sign1 keeps each zero's sign).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/collective/codec.h"
#include "core/collective/codec_internal.h"

namespace pipesgd::codec_internal {
namespace {

constexpr size_t kGroup = kBlock;

size_t Groups(size_t n) { return (n + kGroup - 1) / kGroup; }

// Calls f(group_begin, group_len) for every group of [0, n).
template <typename F>
void ForGroups(size_t n, F&& f) {
  for (size_t g = 0; g < n; g += kGroup) f(g, std::min(kGroup, n - g));
}

template <typename Derived>
class GroupCodec : public Codec {
 public:
  explicit GroupCodec(const CodecOptions& options) : Codec(options) {}

  void Decode(std::span<const std::byte> src, std::span<float> dst) const override {
    PSGD_CHECK_EQ(src.size(), EncodedBytes(dst.size()));
    static_cast<const Derived*>(this)->template Run<false>(src.data(), dst);
  }
  void DecodeAdd(std::span<const std::byte> src, std::span<float> dst) const override {
    PSGD_CHECK_EQ(src.size(), EncodedBytes(dst.size()));
    static_cast<const Derived*>(this)->template Run<true>(src.data(), dst);
  }

 protected:
  template <bool kAdd>
  static void Put(float* out, size_t i, float v) {
    if constexpr (kAdd) {
      out[i] += v;
    } else {
      out[i] = v;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// q4: the q8 arithmetic (codec.cc) with 15 steps per group instead of 255 per chunk.

class Q4Codec final : public GroupCodec<Q4Codec> {
 public:
  static constexpr size_t kHeaderBytes = 2 * sizeof(float);
  static constexpr uint32_t kLevels = 15;

  explicit Q4Codec(const CodecOptions& options)
      : GroupCodec(options), stochastic_(options.stochastic_rounding), seed_(options.seed) {}

  size_t EncodedBytes(size_t n) const override { return kHeaderBytes * Groups(n) + (n + 1) / 2; }

  EncodeStats Encode(std::span<const float> src, std::span<std::byte> dst,
                     uint64_t stream) const override {
    PSGD_CHECK_EQ(dst.size(), EncodedBytes(src.size()));
    std::byte* out = dst.data();
    ForGroups(src.size(), [&](size_t begin, size_t len) {
      const float* in = src.data() + begin;
      float mn = 0.0f, mx = 0.0f;
      if (!MinMax(in, len, mn, mx)) ThrowNonFinite(kind(), src, begin);
      const float scale = MinMaxScale(mn, mx, kLevels);
      std::memcpy(out, &mn, sizeof(float));
      std::memcpy(out + sizeof(float), &scale, sizeof(float));
      out += kHeaderBytes;
      uint8_t codes[kGroup];
      if (scale == 0.0f) {
        std::fill(codes, codes + len, uint8_t{0});
      } else if (Q8FastPath(mn, scale)) {
        const float inv = 1.0f / scale;
        if (!stochastic_) {
          for (size_t j = 0; j < len; ++j) {
            const float t = (in[j] - mn) * inv;  // in [0, 15 + a few ulps]
            const uint32_t c = Bits(t + 0x1p23f) - 0x4b000000u;  // to nearest even
            codes[j] = static_cast<uint8_t>(std::min(c, kLevels));
          }
        } else {
          const NoiseKey key = MakeNoiseKey(seed_, stream, begin >> 32);
          for (size_t j = 0; j < len; ++j) {
            const float t = (in[j] - mn) * inv;
            const int32_t fl = static_cast<int32_t>(t);  // floor, t >= 0
            const float frac = t - static_cast<float>(fl);
            const uint32_t up = Noise(static_cast<uint32_t>(begin + j), key) < frac ? 1u : 0u;
            codes[j] = static_cast<uint8_t>(std::min(static_cast<uint32_t>(fl) + up, kLevels));
          }
        }
      } else {
        const double dmn = mn, dscale = scale;
        const NoiseKey key = MakeNoiseKey(seed_, stream, begin >> 32);
        for (size_t j = 0; j < len; ++j) {
          const double t = (static_cast<double>(in[j]) - dmn) / dscale;
          double c;
          if (!stochastic_) {
            c = (t + 0x1p52) - 0x1p52;
          } else {
            const double fl = std::floor(t);
            c = fl + (static_cast<double>(Noise(static_cast<uint32_t>(begin + j), key)) < t - fl
                          ? 1
                          : 0);
          }
          codes[j] = static_cast<uint8_t>(std::clamp(c, 0.0, static_cast<double>(kLevels)));
        }
      }
      if (len % 2 != 0) codes[len] = 0;  // the unused high nibble of the last byte
      const size_t bytes = (len + 1) / 2;
      for (size_t j = 0; j < bytes; ++j) {
        out[j] = static_cast<std::byte>(codes[2 * j] | (codes[2 * j + 1] << 4));
      }
      out += bytes;
    });
    return {};
  }

  template <bool kAdd>
  void Run(const std::byte* in, std::span<float> dst) const {
    ForGroups(dst.size(), [&](size_t begin, size_t len) {
      float mn, scale;
      std::memcpy(&mn, in, sizeof(float));
      std::memcpy(&scale, in + sizeof(float), sizeof(float));
      in += kHeaderBytes;
      float* out = dst.data() + begin;
      uint8_t codes[kGroup];  // len <= kGroup: the last index read is 2 * ceil(len/2) - 1 < kGroup
      const size_t bytes = (len + 1) / 2;
      for (size_t j = 0; j < bytes; ++j) {
        const auto b = static_cast<uint8_t>(in[j]);
        codes[2 * j] = b & 0x0fu;
        codes[2 * j + 1] = b >> 4;
      }
      in += bytes;
      if (scale == 0.0f) {
        for (size_t j = 0; j < len; ++j) Put<kAdd>(out, j, mn);
      } else if (Q8FastPath(mn, scale)) {
        for (size_t j = 0; j < len; ++j) Put<kAdd>(out, j, mn + static_cast<float>(codes[j]) * scale);
      } else {
        constexpr double kMax = std::numeric_limits<float>::max();
        for (size_t j = 0; j < len; ++j) {
          const double y = static_cast<double>(mn) + static_cast<double>(codes[j]) * scale;
          Put<kAdd>(out, j, static_cast<float>(std::clamp(y, -kMax, kMax)));
        }
      }
    });
  }

  double ErrorBound(double, double chunk_min, double chunk_max) const override {
    // A group's range lies inside the chunk's, so its scale is at most the chunk's.
    const float scale = MinMaxScale(static_cast<float>(chunk_min), static_cast<float>(chunk_max),
                                    kLevels);
    if (scale == 0.0f) return 0.0;
    const double s = scale;
    const double a = std::max(std::fabs(chunk_min), std::fabs(chunk_max));
    return (stochastic_ ? s : s / 2) + s * 0x1p-12 + a * 0x1p-20 + 0x1p-149;
  }

 private:
  bool stochastic_;
  uint64_t seed_;
};

// ---------------------------------------------------------------------------------------------
// sign1: each element becomes +-scale with scale = mean |x| of its group, the scale that
// minimises the group's squared error among all s * sign(x).

class Sign1Codec final : public GroupCodec<Sign1Codec> {
 public:
  static constexpr size_t kHeaderBytes = sizeof(float);

  explicit Sign1Codec(const CodecOptions& options) : GroupCodec(options) {}

  size_t EncodedBytes(size_t n) const override { return kHeaderBytes * Groups(n) + (n + 7) / 8; }

  EncodeStats Encode(std::span<const float> src, std::span<std::byte> dst,
                     uint64_t /*stream*/) const override {
    PSGD_CHECK_EQ(dst.size(), EncodedBytes(src.size()));
    std::byte* out = dst.data();
    ForGroups(src.size(), [&](size_t begin, size_t len) {
      const float* in = src.data() + begin;
      // Four double lanes: vectorizes, and sums up to 2^29 equal floats exactly.
      constexpr size_t kLanes = 4;
      double sum[kLanes] = {0, 0, 0, 0};
      uint32_t bad = 0;
      uint8_t signs[kGroup + 8] = {};
      size_t j = 0;
      for (; j + kLanes <= len; j += kLanes) {
        for (size_t k = 0; k < kLanes; ++k) {
          const uint32_t b = Bits(in[j + k]);
          bad |= NonFinite(b);
          signs[j + k] = static_cast<uint8_t>(b >> 31);
          sum[k] += static_cast<double>(FromBits(b & 0x7fffffffu));
        }
      }
      for (; j < len; ++j) {
        const uint32_t b = Bits(in[j]);
        bad |= NonFinite(b);
        signs[j] = static_cast<uint8_t>(b >> 31);
        sum[0] += static_cast<double>(FromBits(b & 0x7fffffffu));
      }
      if (bad) ThrowNonFinite(kind(), src, begin);
      const double total = (sum[0] + sum[1]) + (sum[2] + sum[3]);
      const float scale = static_cast<float>(total / static_cast<double>(len));
      std::memcpy(out, &scale, sizeof(float));
      out += kHeaderBytes;
      const size_t bytes = (len + 7) / 8;
      for (size_t b = 0; b < bytes; ++b) {
        const uint8_t* s = signs + 8 * b;
        out[b] = static_cast<std::byte>(s[0] | (s[1] << 1) | (s[2] << 2) | (s[3] << 3) |
                                        (s[4] << 4) | (s[5] << 5) | (s[6] << 6) | (s[7] << 7));
      }
      out += bytes;
    });
    return {};
  }

  template <bool kAdd>
  void Run(const std::byte* in, std::span<float> dst) const {
    ForGroups(dst.size(), [&](size_t begin, size_t len) {
      float scale;
      std::memcpy(&scale, in, sizeof(float));
      in += kHeaderBytes;
      const uint32_t magnitude = Bits(scale);
      float* out = dst.data() + begin;
      for (size_t j = 0; j < len; ++j) {
        const uint32_t sign = (static_cast<uint32_t>(in[j / 8]) >> (j % 8)) & 1u;
        Put<kAdd>(out, j, FromBits(magnitude | (sign << 31)));
      }
      in += (len + 7) / 8;
    });
  }

  double ErrorBound(double x, double chunk_min, double chunk_max) const override {
    // |x - s * sign(x)| = ||x| - s| <= max(|x|, s), and s (a mean of |values|) <= A.
    const double a = std::max(std::fabs(chunk_min), std::fabs(chunk_max));
    return std::max(std::fabs(x), a) * (1 + 0x1p-20) + 0x1p-149;
  }
};

}  // namespace

std::unique_ptr<Codec> MakeQ4Codec(const CodecOptions& options) {
  return std::make_unique<Q4Codec>(options);
}
std::unique_ptr<Codec> MakeSign1Codec(const CodecOptions& options) {
  return std::make_unique<Sign1Codec>(options);
}

}  // namespace pipesgd::codec_internal
