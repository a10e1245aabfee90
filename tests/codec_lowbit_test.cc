// q4 and sign1 (core/collective/codec_lowbit.cc): exact bytes of hand-computed groups, group
// boundaries (one outlier sets the step of its own group only), constants and zeros exact,
// stochastic q4 unbiased; the properties every codec shares are in codec_test.cc.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/collective/codec.h"
#include "core/base/rng.h"

namespace pipesgd {
namespace {

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }

std::unique_ptr<Codec> Make(CodecKind kind, bool stochastic = false, uint64_t seed = 0) {
  CodecOptions o;
  o.kind = kind;
  o.stochastic_rounding = stochastic;
  o.seed = seed;
  return MakeCodec(o);
}

std::vector<std::byte> Encode(const Codec& codec, const std::vector<float>& src,
                              uint64_t stream = 0) {
  std::vector<std::byte> out(codec.EncodedBytes(src.size()));
  codec.Encode(src, out, stream);
  return out;
}

std::vector<float> Decode(const Codec& codec, const std::vector<std::byte>& bytes, size_t n) {
  std::vector<float> out(n, 12345.0f);
  codec.Decode(bytes, out);
  return out;
}

float FloatAt(const std::vector<std::byte>& b, size_t offset) {
  float f;
  std::memcpy(&f, b.data() + offset, sizeof(float));
  return f;
}

std::vector<uint8_t> U8(const std::vector<std::byte>& b, size_t from) {
  std::vector<uint8_t> out;
  for (size_t i = from; i < b.size(); ++i) out.push_back(static_cast<uint8_t>(b[i]));
  return out;
}

TEST(Q4, KnownGroupBytesWithRoundToNearestEven) {
  auto q4 = Make(CodecKind::kQ4);
  // min 0, max 15: scale exactly 1. 7.5 rounds to 8 (even), 8.5 to 8 (even), 2.49 to 2.
  const std::vector<float> src = {0.0f, 15.0f, 7.0f, 7.5f, 8.5f, 2.49f, 14.6f};
  const auto bytes = Encode(*q4, src);
  ASSERT_EQ(bytes.size(), 8u + 4u);
  EXPECT_EQ(FloatAt(bytes, 0), 0.0f);
  EXPECT_EQ(FloatAt(bytes, 4), 1.0f);
  // Codes 0 15 7 8 8 2 15, low nibble first; the last byte's high nibble is zero.
  EXPECT_EQ(U8(bytes, 8), (std::vector<uint8_t>{0xf0, 0x87, 0x28, 0x0f}));
  EXPECT_EQ(Decode(*q4, bytes, src.size()),
            (std::vector<float>{0.0f, 15.0f, 7.0f, 8.0f, 8.0f, 2.0f, 15.0f}));
}

TEST(Q4, EachGroupOf256HasItsOwnScale) {
  auto q4 = Make(CodecKind::kQ4);
  // Group 0: 256 values in [-1, 1] on the q4 grid of [-1, 1]; group 1: one outlier, 1000.
  std::vector<float> src(257);
  for (size_t i = 0; i < 256; ++i) src[i] = -1.0f + static_cast<float>(i % 16) * (2.0f / 15.0f);
  src[15] = 1.0f;  // the top of the grid, exactly
  src[256] = 1000.0f;
  const auto bytes = Encode(*q4, src);
  ASSERT_EQ(bytes.size(), 8u + 128u + 8u + 1u);
  EXPECT_EQ(FloatAt(bytes, 0), -1.0f);
  EXPECT_EQ(FloatAt(bytes, 136), 1000.0f);  // the second group's min: a constant group
  EXPECT_EQ(FloatAt(bytes, 140), 0.0f);     // and its scale
  const auto got = Decode(*q4, bytes, src.size());
  const double step = FloatAt(bytes, 4);
  for (size_t i = 0; i < 256; ++i) {
    ASSERT_LE(std::fabs(got[i] - src[i]), step * 1e-5) << i;  // on the grid, up to rounding
  }
  EXPECT_EQ(got[256], 1000.0f);
  // With one scale for the whole chunk (as q8 has), the step would be 1001/15 = 66.7, and
  // every element of group 0 would decode to -1 or 65.7.
}

TEST(Q4, ConstantAndZeroGroupsAreExact) {
  auto q4 = Make(CodecKind::kQ4);
  for (float c : {0.0f, -0.0f, 0.3f, -1e-30f, 3e38f}) {
    std::vector<float> src(300, c);
    const auto got = Decode(*q4, Encode(*q4, src), src.size());
    for (float g : got) ASSERT_EQ(Bits(g), Bits(c)) << c;
  }
}

TEST(Q4, StochasticRoundingIsUnbiased) {
  auto q4 = Make(CodecKind::kQ4, true, 11);
  // 0.3 of the way between codes 4 and 5 on the grid of [0, 15].
  std::vector<float> src = {0.0f, 15.0f, 4.3f};
  double sum = 0;
  const int trials = 20000;
  for (int t = 0; t < trials; ++t) sum += Decode(*q4, Encode(*q4, src, t), 3)[2];
  // Bernoulli(0.3) in {4, 5}: the mean's standard error is sqrt(0.21 / 20000) = 0.0032.
  EXPECT_NEAR(sum / trials, 4.3, 0.02);
  // Round to nearest even always gives 4.
  auto det = Make(CodecKind::kQ4);
  EXPECT_EQ(Decode(*det, Encode(*det, src), 3)[2], 4.0f);
}

TEST(Sign1, KnownGroupBytes) {
  auto s1 = Make(CodecKind::kSign1);
  // mean |x| = (1 + 3 + 0.5 + 0.5 + 0 + 1) / 6 = 1; signs 0 1 0 1 1 (the -0.0) 0.
  const std::vector<float> src = {1.0f, -3.0f, 0.5f, -0.5f, -0.0f, 1.0f};
  const auto bytes = Encode(*s1, src);
  ASSERT_EQ(bytes.size(), 4u + 1u);
  EXPECT_EQ(FloatAt(bytes, 0), 1.0f);
  EXPECT_EQ(U8(bytes, 4), (std::vector<uint8_t>{0b011010}));
  EXPECT_EQ(Decode(*s1, bytes, src.size()),
            (std::vector<float>{1.0f, -1.0f, 1.0f, -1.0f, -1.0f, 1.0f}));
}

TEST(Sign1, ScaleIsTheMeanMagnitudePerGroupOf256) {
  auto s1 = Make(CodecKind::kSign1);
  std::vector<float> src(600);
  pipesgd::Rng rng(5);
  for (float& x : src) x = rng.Uniform(-2.0f, 2.0f);
  const auto bytes = Encode(*s1, src);
  ASSERT_EQ(bytes.size(), 3 * 4u + 75u);
  const size_t group_bytes = 4 + 32;
  for (size_t g = 0; g < 3; ++g) {
    const size_t begin = 256 * g, len = std::min<size_t>(256, 600 - begin);
    double sum = 0;
    for (size_t j = 0; j < len; ++j) sum += std::fabs(static_cast<double>(src[begin + j]));
    EXPECT_EQ(FloatAt(bytes, g * group_bytes), static_cast<float>(sum / len)) << g;
  }
  const auto got = Decode(*s1, bytes, src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(std::signbit(got[i]), std::signbit(src[i])) << i;
    ASSERT_EQ(std::fabs(got[i]), FloatAt(bytes, (i / 256) * group_bytes)) << i;
  }
}

TEST(Sign1, ConstantAndZeroGroupsAreExact) {
  auto s1 = Make(CodecKind::kSign1);
  for (float c : {0.0f, -0.0f, 0.3f, -0.1f, 1e-30f, 3e38f}) {
    std::vector<float> src(300, c);
    const auto got = Decode(*s1, Encode(*s1, src), src.size());
    for (float g : got) ASSERT_EQ(Bits(g), Bits(c)) << c;
  }
}

}  // namespace
}  // namespace pipesgd
