// core/collective/codec: exact bit patterns for trunc16 and fp16 (fp16 against an independent
// double-precision reference at every rounding boundary and exhaustively over all finite
// halves), q8 header and codes, error bounds on random data, exact zeros and constants,
// DecodeAdd == Decode + add bitwise, non-finite input, unaligned buffers.
// Over 600 lines: one block of cases per codec, each with its exact expected bits inline.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/collective/codec.h"
#include "core/base/rng.h"

namespace pipesgd {
namespace {

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
float FromBits(uint32_t b) { return std::bit_cast<float>(b); }

std::vector<std::byte> Encode(const Codec& codec, const std::vector<float>& src,
                              uint64_t stream = 0, EncodeStats* stats = nullptr) {
  std::vector<std::byte> out(codec.EncodedBytes(src.size()));
  EncodeStats s = codec.Encode(src, out, stream);
  if (stats) *stats = s;
  return out;
}

std::vector<float> Decode(const Codec& codec, const std::vector<std::byte>& bytes, size_t n) {
  std::vector<float> out(n, 12345.0f);  // anything Decode must overwrite
  codec.Decode(bytes, out);
  return out;
}

std::vector<uint16_t> Words(const std::vector<std::byte>& bytes) {
  std::vector<uint16_t> w(bytes.size() / 2);
  if (!w.empty()) std::memcpy(w.data(), bytes.data(), bytes.size());
  return w;
}

std::vector<std::byte> FromWords(const std::vector<uint16_t>& words) {
  std::vector<std::byte> b(words.size() * 2);
  if (!b.empty()) std::memcpy(b.data(), words.data(), b.size());
  return b;
}

// Encodes each float alone; returns the uint16 code (trunc16, fp16).
uint16_t Encode16(const Codec& codec, float x, uint64_t* saturated = nullptr) {
  EncodeStats stats;
  std::vector<std::byte> b = Encode(codec, {x}, 0, &stats);
  if (saturated) *saturated = stats.saturated;
  return Words(b)[0];
}

std::unique_ptr<Codec> Make(CodecKind kind, bool rne = false, bool stochastic = false,
                            uint64_t seed = 0) {
  CodecOptions o;
  o.kind = kind;
  o.round_to_nearest_even = rne;
  o.stochastic_rounding = stochastic;
  o.seed = seed;
  return MakeCodec(o);
}

// Every codec configuration, for the properties they all share.
struct Config {
  const char* name;
  CodecOptions options;
};
std::vector<Config> AllConfigs() {
  return {
      {"none", {CodecKind::kNone, false, false, 0}},
      {"trunc16", {CodecKind::kTrunc16, false, false, 0}},
      {"trunc16_rne", {CodecKind::kTrunc16, true, false, 0}},
      {"fp16", {CodecKind::kFp16, false, false, 0}},
      {"q8", {CodecKind::kQ8, false, false, 0}},
      {"q8_stochastic", {CodecKind::kQ8, false, true, 7}},
      {"q4", {CodecKind::kQ4, false, false, 0}},
      {"q4_stochastic", {CodecKind::kQ4, false, true, 7}},
      {"sign1", {CodecKind::kSign1, false, false, 0}},
  };
}

const size_t kLengths[] = {0, 1, 2, 7, 255, 256, 257, 1000};

// Random values of mixed magnitude and sign: most in [-1, 1], some 1e-3 and 1e3 larger.
std::vector<float> RandomData(size_t n, uint64_t seed) {
  pipesgd::Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) {
    const float mag = rng.Below(10) == 0 ? (rng.Below(2) ? 1e3f : 1e-3f) : 1.0f;
    x = rng.Uniform(-mag, mag);
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Names, options, sizes

TEST(CodecKind, NamesRoundTrip) {
  EXPECT_EQ(CodecName(CodecKind::kNone), "none");
  EXPECT_EQ(CodecName(CodecKind::kTrunc16), "trunc16");
  EXPECT_EQ(CodecName(CodecKind::kFp16), "fp16");
  EXPECT_EQ(CodecName(CodecKind::kQ8), "q8");
  EXPECT_EQ(CodecName(CodecKind::kQ4), "q4");
  EXPECT_EQ(CodecName(CodecKind::kSign1), "sign1");
  for (CodecKind k : {CodecKind::kNone, CodecKind::kTrunc16, CodecKind::kFp16, CodecKind::kQ8,
                      CodecKind::kQ4, CodecKind::kSign1}) {
    EXPECT_EQ(ParseCodecKind(CodecName(k)), k);
  }
}

TEST(CodecKind, ParseRejectsUnknownNamesNamingTheValueAndTheChoices) {
  for (const char* bad : {"q2", "", "FP16", "none ", "sign"}) {
    try {
      ParseCodecKind(bad);
      FAIL() << "no throw for '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_EQ(std::string(e.what()),
                "unknown codec \"" + std::string(bad) +
                    "\": expected one of none, trunc16, fp16, q8, q4, sign1");
    }
  }
}

TEST(MakeCodec, RejectsOptionsTheKindDoesNotUse) {
  auto expect_invalid = [](const CodecOptions& o, const std::string& needle) {
    try {
      MakeCodec(o);
      FAIL() << "no throw, expected: " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_invalid({CodecKind::kFp16, true, false, 0}, "round_to_nearest_even");
  expect_invalid({CodecKind::kQ8, true, false, 0}, "round_to_nearest_even");
  expect_invalid({CodecKind::kTrunc16, false, true, 0}, "stochastic_rounding");
  expect_invalid({CodecKind::kNone, false, true, 0}, "stochastic_rounding");
  expect_invalid({CodecKind::kSign1, false, true, 0}, "stochastic_rounding applies to q8 and q4");
  expect_invalid({CodecKind::kQ4, true, false, 0}, "round_to_nearest_even");
  expect_invalid({static_cast<CodecKind>(9), false, false, 0}, "unknown codec kind 9");
  // The seed is never rejected (a job may set it whatever the codec).
  EXPECT_EQ(MakeCodec({CodecKind::kFp16, false, false, 42})->kind(), CodecKind::kFp16);
}

TEST(Codec, EncodedBytesIsAPureFunctionOfTheCount) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1} << 20}) {
    EXPECT_EQ(Make(CodecKind::kNone)->EncodedBytes(n), 4 * n);
    EXPECT_EQ(Make(CodecKind::kTrunc16)->EncodedBytes(n), 2 * n);
    EXPECT_EQ(Make(CodecKind::kTrunc16, true)->EncodedBytes(n), 2 * n);
    EXPECT_EQ(Make(CodecKind::kFp16)->EncodedBytes(n), 2 * n);
    EXPECT_EQ(Make(CodecKind::kQ8)->EncodedBytes(n), 8 + n);
    EXPECT_EQ(Make(CodecKind::kQ8, false, true)->EncodedBytes(n), 8 + n);
    const size_t groups = (n + 255) / 256;
    EXPECT_EQ(Make(CodecKind::kQ4)->EncodedBytes(n), 8 * groups + (n + 1) / 2);
    EXPECT_EQ(Make(CodecKind::kSign1)->EncodedBytes(n), 4 * groups + (n + 7) / 8);
  }
  // By hand: 7 elements are one group; 2^20 are 4096.
  EXPECT_EQ(Make(CodecKind::kQ4)->EncodedBytes(7), 12u);
  EXPECT_EQ(Make(CodecKind::kSign1)->EncodedBytes(7), 5u);
  EXPECT_EQ(Make(CodecKind::kQ4)->EncodedBytes(size_t{1} << 20), 557056u);
  EXPECT_EQ(Make(CodecKind::kSign1)->EncodedBytes(size_t{1} << 20), 147456u);
  EXPECT_EQ(Make(CodecKind::kQ4)->EncodedBytes(0), 0u);
}

// ---------------------------------------------------------------------------------------------
// Properties of every codec

class EveryCodec : public ::testing::TestWithParam<Config> {
 protected:
  std::unique_ptr<Codec> codec_ = MakeCodec(GetParam().options);
};

INSTANTIATE_TEST_SUITE_P(Codecs, EveryCodec, ::testing::ValuesIn(AllConfigs()),
                         [](const auto& p) { return std::string(p.param.name); });

TEST_P(EveryCodec, ZerosRoundTripBitwise) {
  const bool keeps_sign = codec_->kind() != CodecKind::kQ8 && codec_->kind() != CodecKind::kQ4;
  for (size_t n : kLengths) {
    // +0.0 everywhere; then (where the format has a sign per element) alternating +0.0 / -0.0.
    std::vector<float> zeros(n, 0.0f);
    std::vector<float> got = Decode(*codec_, Encode(*codec_, zeros), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(Bits(got[i]), 0u) << "n=" << n << " i=" << i;
    std::vector<float> neg(n, -0.0f);
    got = Decode(*codec_, Encode(*codec_, neg), n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(Bits(got[i]), 0x80000000u) << "n=" << n;
    if (keeps_sign) {
      std::vector<float> mixed(n);
      for (size_t i = 0; i < n; ++i) mixed[i] = i % 2 ? -0.0f : 0.0f;
      got = Decode(*codec_, Encode(*codec_, mixed), n);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(Bits(got[i]), Bits(mixed[i])) << "n=" << n;
    }
  }
}

TEST_P(EveryCodec, RandomDataIsWithinTheDocumentedBound) {
  for (size_t n : kLengths) {
    std::vector<float> src = RandomData(n, 1000 + n);
    double mn = 0, mx = 0;
    if (n > 0) {
      mn = *std::min_element(src.begin(), src.end());
      mx = *std::max_element(src.begin(), src.end());
    }
    EncodeStats stats;
    std::vector<float> got = Decode(*codec_, Encode(*codec_, src, 99, &stats), n);
    EXPECT_EQ(stats.saturated, 0u);
    for (size_t i = 0; i < n; ++i) {
      const double err = std::fabs(static_cast<double>(got[i]) - src[i]);
      ASSERT_LE(err, codec_->ErrorBound(src[i], mn, mx))
          << "n=" << n << " i=" << i << " x=" << src[i] << " got=" << got[i];
    }
  }
}

TEST_P(EveryCodec, DecodeAddIsDecodeThenAddBitwise) {
  for (size_t n : kLengths) {
    std::vector<float> src = RandomData(n, 2000 + n);
    std::vector<float> acc = RandomData(n, 3000 + n);
    std::vector<std::byte> bytes = Encode(*codec_, src, 5);
    std::vector<float> expected = Decode(*codec_, bytes, n);
    for (size_t i = 0; i < n; ++i) expected[i] = acc[i] + expected[i];
    codec_->DecodeAdd(bytes, acc);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(Bits(acc[i]), Bits(expected[i])) << "n=" << n;
  }
}

TEST_P(EveryCodec, EncodingIsDeterministicAndBuffersNeedNoAlignment) {
  const size_t n = 1000;
  std::vector<float> src = RandomData(n, 4000);
  std::vector<std::byte> a = Encode(*codec_, src, 17);
  EXPECT_EQ(Encode(*codec_, src, 17), a);
  // The same bytes at an odd address, decoded from an odd address.
  std::vector<std::byte> buf(a.size() + 1);
  std::span<std::byte> odd = std::span(buf).subspan(1);
  codec_->Encode(src, odd, 17);
  EXPECT_TRUE(std::equal(odd.begin(), odd.end(), a.begin()));
  std::vector<float> from_odd(n), from_aligned = Decode(*codec_, a, n);
  codec_->Decode(std::span<const std::byte>(odd), from_odd);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(Bits(from_odd[i]), Bits(from_aligned[i]));
}

TEST_P(EveryCodec, NonFiniteInputThrowsNamingTheIndexAndValue) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    size_t n, index;
    float value;
    std::string text;
  };
  for (const Case& c : {Case{7, 2, nan, "nan"}, Case{1, 0, inf, "inf"},
                        Case{1000, 999, -inf, "-inf"}, Case{1000, 700, nan, "nan"}}) {
    std::vector<float> src(c.n, 1.5f);
    src[c.index] = c.value;
    if (c.n == 1000) src[998] = 1e30f;  // finite, large: not the culprit
    std::vector<std::byte> dst(codec_->EncodedBytes(c.n));
    try {
      codec_->Encode(src, dst);
      FAIL() << "no throw for " << c.text << " at " << c.index;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNumerical);
      EXPECT_EQ(std::string(e.what()),
                std::string(CodecName(codec_->kind())) + " codec: element " +
                    std::to_string(c.index) + " of a chunk of " + std::to_string(c.n) + " is " +
                    c.text + "; only finite values can be encoded");
    }
  }
}

TEST_P(EveryCodec, SizeMismatchIsAnInvariantViolation) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<float> src(7, 1.0f);
  std::vector<std::byte> too_small(codec_->EncodedBytes(7) - 1);
  std::vector<std::byte> right(codec_->EncodedBytes(7));
  // 9, not 8: q4 and sign1 pack 7 and 8 elements into the same bytes.
  std::vector<float> too_many(9);
  EXPECT_DEATH(codec_->Encode(src, too_small), "invariant violated");
  EXPECT_DEATH(codec_->Decode(right, too_many), "invariant violated");
  EXPECT_DEATH(codec_->DecodeAdd(right, too_many), "invariant violated");
}

TEST(NoneCodec, IsBitwiseExact) {
  auto codec = Make(CodecKind::kNone);
  std::vector<float> src = {1.0f, -0.0f, FromBits(0x00000001), FromBits(0x7f7fffff), 0.1f};
  std::vector<std::byte> bytes = Encode(*codec, src);
  ASSERT_EQ(bytes.size(), 20u);
  EXPECT_EQ(std::memcmp(bytes.data(), src.data(), 20), 0);
  std::vector<float> got = Decode(*codec, bytes, src.size());
  for (size_t i = 0; i < src.size(); ++i) EXPECT_EQ(Bits(got[i]), Bits(src[i]));
}

// ---------------------------------------------------------------------------------------------
// trunc16

TEST(Trunc16, KnownBitPatterns) {
  auto trunc = Make(CodecKind::kTrunc16);
  auto rne = Make(CodecKind::kTrunc16, true);
  struct Case {
    uint32_t in;
    uint16_t truncated, rounded;
  };
  for (const Case& c : {
           Case{0x3f800000, 0x3f80, 0x3f80},  // 1.0
           Case{0x3f80ffff, 0x3f80, 0x3f81},  // above the tie: RNE rounds up
           Case{0x3f808000, 0x3f80, 0x3f80},  // tie, kept LSB even: stays
           Case{0x3f818000, 0x3f81, 0x3f82},  // tie, kept LSB odd: up to even
           Case{0x3f817fff, 0x3f81, 0x3f81},  // below the tie
           Case{0xbf80ffff, 0xbf80, 0xbf81},  // negative: magnitude rounds the same way
           Case{0x3fffffff, 0x3fff, 0x4000},  // carry into the exponent: 2.0
           Case{0x00123456, 0x0012, 0x0012},  // subnormal: upper bits kept
           Case{0x0000ffff, 0x0000, 0x0001},  // subnormal rounds up to the smallest bf16
           Case{0x8000ffff, 0x8000, 0x8001},
           Case{0x007fffff, 0x007f, 0x0080},  // largest subnormal rounds to the smallest normal
           Case{0x00000001, 0x0000, 0x0000},  // smallest subnormal: to +0
           Case{0x7f7f7fff, 0x7f7f, 0x7f7f},  // just below the saturation threshold
       }) {
    uint64_t sat_t = 9, sat_r = 9;
    EXPECT_EQ(Encode16(*trunc, FromBits(c.in), &sat_t), c.truncated) << std::hex << c.in;
    EXPECT_EQ(Encode16(*rne, FromBits(c.in), &sat_r), c.rounded) << std::hex << c.in;
    EXPECT_EQ(sat_t, 0u);
    EXPECT_EQ(sat_r, 0u);
  }
  // Decode shifts left by 16.
  std::vector<float> got = Decode(*trunc, FromWords({0x3f81, 0x8001, 0x7f7f}), 3);
  EXPECT_EQ(Bits(got[0]), 0x3f810000u);
  EXPECT_EQ(Bits(got[1]), 0x80010000u);
  EXPECT_EQ(Bits(got[2]), 0x7f7f0000u);
}

TEST(Trunc16, RoundingNeverMakesAFiniteValueInfinite) {
  auto trunc = Make(CodecKind::kTrunc16);
  auto rne = Make(CodecKind::kTrunc16, true);
  // FLT_MAX, -FLT_MAX, a tie that rounds up to Inf, and two that do not.
  std::vector<float> src = {FromBits(0x7f7fffff), FromBits(0xff7fffff), FromBits(0x7f7f8000),
                            FromBits(0x7f7f7fff), FromBits(0x7f7e8000), 1.0f};
  EncodeStats stats;
  EXPECT_EQ(Words(Encode(*rne, src, 0, &stats)),
            (std::vector<uint16_t>{0x7f7f, 0xff7f, 0x7f7f, 0x7f7f, 0x7f7e, 0x3f80}));
  EXPECT_EQ(stats.saturated, 3u);
  EXPECT_EQ(Words(Encode(*trunc, src, 0, &stats)),
            (std::vector<uint16_t>{0x7f7f, 0xff7f, 0x7f7f, 0x7f7f, 0x7f7e, 0x3f80}));
  EXPECT_EQ(stats.saturated, 0u);
  // The saturated value is within the documented bound.
  const float max = FromBits(0x7f7fffff);
  EXPECT_LE(static_cast<double>(max) - static_cast<double>(FromBits(0x7f7f0000)),
            rne->ErrorBound(max, 0, 0));
}

// Against a reference that picks the nearer of the two bf16 neighbours in double precision.
TEST(Trunc16, MatchesAReferenceOnRandomBitPatterns) {
  auto trunc = Make(CodecKind::kTrunc16);
  auto rne = Make(CodecKind::kTrunc16, true);
  pipesgd::Rng rng(11);
  std::vector<float> src;
  while (src.size() < 200000) {
    uint32_t b = static_cast<uint32_t>(rng.NextU64());
    if (rng.Below(4) == 0) b = (b & 0xffff0000u) | 0x8000u;  // many exact ties
    if ((b & 0x7f800000u) == 0x7f800000u) continue;             // finite only
    src.push_back(FromBits(b));
  }
  EncodeStats stats;
  std::vector<uint16_t> t = Words(Encode(*trunc, src));
  std::vector<uint16_t> r = Words(Encode(*rne, src, 0, &stats));
  uint64_t saturated = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    const uint32_t b = Bits(src[i]);
    const uint16_t down = static_cast<uint16_t>(b >> 16);
    ASSERT_EQ(t[i], down);
    const double x = std::fabs(static_cast<double>(src[i]));
    const double lo = std::fabs(static_cast<double>(FromBits(uint32_t{down} << 16)));
    // The next bf16 up in magnitude, as a real number (2^128 past the largest finite).
    const uint16_t mag = down & 0x7fff;
    const double hi = mag == 0x7f7f ? std::ldexp(1.0, 128)
                                    : static_cast<double>(FromBits(uint32_t(mag + 1) << 16));
    uint16_t want = (x - lo < hi - x || (x - lo == hi - x && (down & 1) == 0)) ? down
                                                                                : down + 1;
    if ((want & 0x7f80) == 0x7f80) {
      want = down;  // saturate
      ++saturated;
    }
    ASSERT_EQ(r[i], want) << std::hex << b;
  }
  EXPECT_EQ(stats.saturated, saturated);
}

// ---------------------------------------------------------------------------------------------
// fp16

// Reference fp16 value of bits h, straight from the definition.
double RefHalfValue(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}

// Reference fp32 -> fp16: round to nearest even in double arithmetic, saturate at 65504.
uint16_t RefToHalf(float x, uint64_t* saturated) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 65520.0) {
    ++*saturated;
    return sign | 0x7bff;
  }
  if (a < 0x1p-14) return sign | static_cast<uint16_t>(std::nearbyint(a * 0x1p24));
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  int exp = e - 1;
  double k = std::nearbyint(std::ldexp(a, 10 - exp));  // in [1024, 2048]
  if (k == 2048) {
    k = 1024;
    ++exp;
  }
  return sign | static_cast<uint16_t>(((exp + 15) << 10) | (static_cast<int>(k) - 1024));
}

TEST(Fp16, KnownValues) {
  auto fp16 = Make(CodecKind::kFp16);
  struct Case {
    float in;
    uint16_t out;
    uint64_t saturated;
  };
  for (const Case& c : {
           Case{1.0f, 0x3c00, 0}, Case{-2.0f, 0xc000, 0},
           Case{65504.0f, 0x7bff, 0},           // largest finite: exact
           Case{65519.0f, 0x7bff, 0},           // rounds down to 65504: not saturated
           Case{65519.996f, 0x7bff, 0},         // the largest float below the tie
           Case{65520.0f, 0x7bff, 1},           // tie to even would be Inf: saturated
           Case{1e5f, 0x7bff, 1}, Case{-1e5f, 0xfbff, 1},
           Case{FromBits(0x7f7fffff), 0x7bff, 1},
           Case{0x1p-24f, 0x0001, 0},           // smallest subnormal: exact
           Case{0x1p-25f, 0x0000, 0},           // tie between 0 and 2^-24: to even, 0
           Case{-0x1p-25f, 0x8000, 0},          // ... keeping the sign
           Case{0x1.000002p-25f, 0x0001, 0},    // just above the tie
           Case{3 * 0x1p-26f, 0x0001, 0},       // 0.75 * 2^-24 -> 2^-24
           Case{3 * 0x1p-25f, 0x0002, 0},       // 1.5 * 2^-24: tie to even, 2
           Case{0x1p-14f, 0x0400, 0},           // smallest normal
           Case{0x1.ff8p-15f, 0x03ff, 0},       // largest subnormal (1023 * 2^-24)
           Case{0x1.ffcp-15f, 0x0400, 0},       // 1023.5 * 2^-24: tie, up to even = normal
           Case{1.0f + 0x1p-11f, 0x3c00, 0},    // tie, even: down
           Case{1.0f + 3 * 0x1p-11f, 0x3c02, 0},  // tie, odd: up
           Case{FromBits(0x00000001), 0x0000, 0},  // fp32 subnormal: flushes to +0
           Case{FromBits(0x80000001), 0x8000, 0},
           Case{0.1f, 0x2e66, 0},
       }) {
    uint64_t sat = 9;
    EXPECT_EQ(Encode16(*fp16, c.in, &sat), c.out) << c.in;
    EXPECT_EQ(sat, c.saturated) << c.in;
  }
  std::vector<float> got = Decode(*fp16, FromWords({0x7bff, 0xfbff, 0x0001, 0x8001, 0x03ff}), 5);
  EXPECT_EQ(got[0], 65504.0f);
  EXPECT_EQ(got[1], -65504.0f);
  EXPECT_EQ(got[2], 0x1p-24f);
  EXPECT_EQ(got[3], -0x1p-24f);
  EXPECT_EQ(got[4], 0x1.ff8p-15f);
  // Inf and NaN codes never come from Encode but decode to Inf and NaN.
  got = Decode(*fp16, FromWords({0x7c00, 0xfc00, 0x7e00}), 3);
  EXPECT_EQ(got[0], std::numeric_limits<float>::infinity());
  EXPECT_EQ(got[1], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(got[2]));
}

TEST(Fp16, SaturationIsCountedPerElement) {
  auto fp16 = Make(CodecKind::kFp16);
  EncodeStats stats;
  std::vector<float> src = {65504.0f, 65519.0f, 65520.0f, 1e5f, -1e5f, FromBits(0xff7fffff), 1.0f};
  EXPECT_EQ(Words(Encode(*fp16, src, 0, &stats)),
            (std::vector<uint16_t>{0x7bff, 0x7bff, 0x7bff, 0x7bff, 0xfbff, 0xfbff, 0x3c00}));
  EXPECT_EQ(stats.saturated, 4u);
  EXPECT_EQ(fp16->ErrorBound(1e5, 0, 0), 1e5 - 65504);
}

// Every finite half: decodes to its exact value, and that value encodes back to the same bits.
TEST(Fp16, EveryFiniteHalfRoundTripsExhaustively) {
  auto fp16 = Make(CodecKind::kFp16);
  std::vector<uint16_t> halves;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) != 0x7c00) halves.push_back(static_cast<uint16_t>(h));
  }
  ASSERT_EQ(halves.size(), 63488u);
  std::vector<float> values = Decode(*fp16, FromWords(halves), halves.size());
  for (size_t i = 0; i < halves.size(); ++i) {
    ASSERT_EQ(static_cast<double>(values[i]), RefHalfValue(halves[i])) << std::hex << halves[i];
    ASSERT_EQ(std::signbit(values[i]), (halves[i] & 0x8000) != 0);
  }
  EncodeStats stats;
  EXPECT_EQ(Words(Encode(*fp16, values, 0, &stats)), halves);
  EXPECT_EQ(stats.saturated, 0u);
}

// At and around every rounding boundary (each half, each midpoint between neighbours, one fp32
// ulp either side of both), plus random fp32 bit patterns: identical to the reference.
TEST(Fp16, MatchesAReferenceRoundingAtEveryBoundary) {
  auto fp16 = Make(CodecKind::kFp16);
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> src;
  for (uint32_t h = 0; h <= 0x7bff; ++h) {
    const double v = RefHalfValue(static_cast<uint16_t>(h));
    const double next = h == 0x7bff ? 65536.0 : RefHalfValue(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((v + next) / 2);  // exact: 12 significant bits
    ASSERT_EQ(static_cast<double>(mid), (v + next) / 2);
    for (float x : {static_cast<float>(v), mid}) {
      for (float y : {x, std::nextafter(x, inf), std::nextafter(x, -inf)}) {
        src.push_back(y);
        src.push_back(-y);
      }
    }
  }
  pipesgd::Rng rng(12);
  for (int i = 0; i < 400000; ++i) {
    uint32_t b = static_cast<uint32_t>(rng.NextU64());
    if (i % 2) {  // exponents around the fp16 range (2^-27 .. 2^18)
      b = (b & 0x807fffffu) | ((100 + static_cast<uint32_t>(rng.Below(46))) << 23);
    }
    if ((b & 0x7f800000u) == 0x7f800000u) continue;
    src.push_back(FromBits(b));
  }
  EncodeStats stats;
  std::vector<uint16_t> got = Words(Encode(*fp16, src, 0, &stats));
  uint64_t saturated = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(got[i], RefToHalf(src[i], &saturated)) << std::hexfloat << src[i];
  }
  EXPECT_EQ(stats.saturated, saturated);
  EXPECT_GT(saturated, 0u);
}

// ---------------------------------------------------------------------------------------------
// q8

struct Q8Header {
  float min, scale;
};
Q8Header Header(const std::vector<std::byte>& bytes) {
  Q8Header h;
  std::memcpy(&h.min, bytes.data(), 4);
  std::memcpy(&h.scale, bytes.data() + 4, 4);
  return h;
}
std::vector<uint8_t> Codes(const std::vector<std::byte>& bytes) {
  std::vector<uint8_t> c(bytes.size() - 8);
  if (!c.empty()) std::memcpy(c.data(), bytes.data() + 8, c.size());
  return c;
}

TEST(Q8, LayoutCodesAndRoundHalfToEven) {
  auto q8 = Make(CodecKind::kQ8);
  // min 0, max 63.75: scale = 63.75 / 255 = 0.25 exactly; 0.625 -> t 2.5 -> 2, 0.875 -> 3.5 -> 4.
  std::vector<float> src = {0.0f, 63.75f, 0.625f, 0.875f, 10.1f, 63.7f};
  std::vector<std::byte> bytes = Encode(*q8, src, 1234);
  ASSERT_EQ(bytes.size(), 14u);
  EXPECT_EQ(Header(bytes).min, 0.0f);
  EXPECT_EQ(Header(bytes).scale, 0.25f);
  EXPECT_EQ(Codes(bytes), (std::vector<uint8_t>{0, 255, 2, 4, 40, 255}));
  EXPECT_EQ(Decode(*q8, bytes, 6), (std::vector<float>{0.0f, 63.75f, 0.5f, 1.0f, 10.0f, 63.75f}));
  // A ramp over 0..255 maps onto the codes themselves; the stream does not matter here.
  std::vector<float> ramp(256);
  for (int i = 0; i < 256; ++i) ramp[i] = static_cast<float>(255 - i) - 100.0f;
  bytes = Encode(*q8, ramp, 0);
  EXPECT_EQ(Encode(*q8, ramp, 77), bytes);
  EXPECT_EQ(Header(bytes).min, -100.0f);
  EXPECT_EQ(Header(bytes).scale, 1.0f);
  std::vector<uint8_t> codes = Codes(bytes);
  for (int i = 0; i < 256; ++i) ASSERT_EQ(codes[i], 255 - i);
  EXPECT_EQ(Decode(*q8, bytes, 256), ramp);
}

TEST(Q8, HeaderHoldsTheChunkMinAndTheSmallestScaleThatCoversTheRange) {
  auto q8 = Make(CodecKind::kQ8);
  for (size_t n : kLengths) {
    if (n < 2) continue;
    for (uint64_t seed = 0; seed < 20; ++seed) {
      std::vector<float> src = RandomData(n, 5000 + seed);
      const float mn = *std::min_element(src.begin(), src.end());
      const float mx = *std::max_element(src.begin(), src.end());
      const Q8Header h = Header(Encode(*q8, src));
      ASSERT_EQ(h.min, mn) << "n=" << n;
      const double range = static_cast<double>(mx) - mn;
      ASSERT_GE(static_cast<double>(h.scale) * 255, range);
      ASSERT_LT(static_cast<double>(std::nextafter(h.scale, 0.0f)) * 255, range);
    }
  }
}

TEST(Q8, EmptyChunkIsAnEightByteHeader) {
  for (bool stochastic : {false, true}) {
    auto q8 = Make(CodecKind::kQ8, false, stochastic);
    std::vector<std::byte> bytes = Encode(*q8, {});
    ASSERT_EQ(bytes.size(), 8u);
    EXPECT_EQ(Bits(Header(bytes).min), 0u);
    EXPECT_EQ(Bits(Header(bytes).scale), 0u);
    std::vector<float> none;
    q8->Decode(bytes, none);
    q8->DecodeAdd(bytes, none);
  }
}

TEST(Q8, ConstantChunksRoundTripExactly) {
  for (bool stochastic : {false, true}) {
    auto q8 = Make(CodecKind::kQ8, false, stochastic, 3);
    for (float c : {0.0f, -0.0f, 1.0f, -3.25f, 0.1f, 1e30f, -1e-30f, FromBits(0x00000001),
                    FromBits(0x7f7fffff), FromBits(0xff7fffff)}) {
      for (size_t n : kLengths) {
        std::vector<float> src(n, c);
        std::vector<std::byte> bytes = Encode(*q8, src, 5);
        if (n > 0) {
          EXPECT_EQ(Bits(Header(bytes).min), Bits(c));
          EXPECT_EQ(Header(bytes).scale, 0.0f);
        }
        std::vector<float> got = Decode(*q8, bytes, n);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(Bits(got[i]), Bits(c)) << c << " n=" << n;
        EXPECT_EQ(q8->ErrorBound(c, c, c), 0.0);
      }
    }
  }
  // Mixed +0.0 and -0.0 is a constant chunk too: every element comes back as a zero (its sign
  // is that of the zero the min search kept).
  auto q8 = Make(CodecKind::kQ8);
  std::vector<float> mixed(100, 0.0f);
  for (size_t i = 0; i < mixed.size(); i += 3) mixed[i] = -0.0f;
  std::vector<std::byte> bytes = Encode(*q8, mixed);
  EXPECT_EQ(Header(bytes).scale, 0.0f);
  for (float g : Decode(*q8, bytes, mixed.size())) EXPECT_EQ(g, 0.0f);
}

// Ranges that take the float fast path and ranges that take the double path (subnormal scale,
// near-overflow range, large offset): every element within ErrorBound, and (deterministic) the
// worst error close to scale/2, so the bound is not vacuous.
TEST(Q8, ErrorIsWithinTheBoundOnRandomData) {
  struct Range {
    float lo, hi;
    bool tight = true;
  };
  const float max = std::numeric_limits<float>::max();
  for (bool stochastic : {false, true}) {
    auto q8 = Make(CodecKind::kQ8, false, stochastic, 21);
    for (Range r : {Range{-1e-3f, 1e-3f}, Range{0.0f, 1.0f}, Range{-1e6f, 1e6f},
                    Range{1e6f, 1e6f + 1.0f, false}, Range{-1e-40f, 1e-40f, false},
                    Range{0.0f, 3e-43f, false},
                    Range{-max, max}, Range{0.5f * max, max}, Range{-1e38f, -1e37f}}) {
      pipesgd::Rng rng(31);
      std::vector<float> src(4096);
      for (float& x : src) {
        x = static_cast<float>(r.lo + (static_cast<double>(r.hi) - r.lo) * rng.NextUnitFloat());
      }
      src[0] = r.lo;
      src[1] = r.hi;
      std::vector<std::byte> bytes = Encode(*q8, src, 8);
      const double scale = Header(bytes).scale;
      EXPECT_EQ(Header(bytes).min, r.lo);
      // scale is (hi - lo) / 255 rounded up to a float.
      EXPECT_GE(scale * 255, static_cast<double>(r.hi) - r.lo);
      EXPECT_LT(static_cast<double>(std::nextafter(Header(bytes).scale, 0.0f)) * 255,
                static_cast<double>(r.hi) - r.lo);
      std::vector<float> got = Decode(*q8, bytes, src.size());
      double worst = 0;
      for (size_t i = 0; i < src.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i]));
        const double err = std::fabs(static_cast<double>(got[i]) - src[i]);
        worst = std::max(worst, err);
        ASSERT_LE(err, q8->ErrorBound(src[i], r.lo, r.hi))
            << "range [" << r.lo << ", " << r.hi << "] i=" << i << " x=" << src[i]
            << " got=" << got[i];
      }
      // Where the floats are dense compared with scale (not [1e6, 1e6 + 1], whose 17 floats
      // all decode back exactly, nor the subnormal ranges).
      if (!stochastic && r.tight) {
        EXPECT_GT(worst, 0.45 * scale) << r.lo;
      }
    }
  }
}

// Stochastic rounding is unbiased: the mean decoded value of x over many elements (each with
// its own noise) and several streams converges to x. 8 x 65534 samples; one sample's standard
// deviation is at most scale/2 = 1/510, so the mean's is <= 2.8e-6; tolerance 1.5e-5 (> 5
// sigma). Deterministic rounding is off by up to scale/2 ~ 2e-3 for the same x.
TEST(Q8, StochasticRoundingIsUnbiased) {
  auto q8 = Make(CodecKind::kQ8, false, true, 2024);
  auto det = Make(CodecKind::kQ8);
  const size_t n = 1 << 16;
  for (float x : {0.3f, 0.0123f, 0.9876f, 0.5f / 255}) {
    std::vector<float> src(n, x);
    src[0] = 0.0f;  // min 0, max 1: scale ~ 1/255
    src[1] = 1.0f;
    double sum = 0;
    size_t count = 0;
    for (uint64_t stream = 0; stream < 8; ++stream) {
      std::vector<float> got = Decode(*q8, Encode(*q8, src, stream), n);
      for (size_t i = 2; i < n; ++i) {
        ASSERT_LE(std::fabs(static_cast<double>(got[i]) - x), q8->ErrorBound(x, 0, 1));
        sum += got[i];
        ++count;
      }
    }
    EXPECT_NEAR(sum / count, x, 1.5e-5) << x;
    const double det_err =
        std::fabs(static_cast<double>(Decode(*det, Encode(*det, src), n)[2]) - x);
    if (x == 0.3f) {
      EXPECT_GT(det_err, 1e-3);  // t = 76.5: the worst case for round-to-nearest
    }
  }
}

TEST(Q8, StochasticNoiseIsReproducibleAndKeyedBySeedAndStream) {
  std::vector<float> src = RandomData(1000, 55);
  auto a = Make(CodecKind::kQ8, false, true, 1);
  auto a2 = Make(CodecKind::kQ8, false, true, 1);
  auto b = Make(CodecKind::kQ8, false, true, 2);
  const std::vector<std::byte> ref = Encode(*a, src, 10);
  EXPECT_EQ(Encode(*a, src, 10), ref);   // same codec, same stream
  EXPECT_EQ(Encode(*a2, src, 10), ref);  // another instance with the same seed
  EXPECT_NE(Encode(*a, src, 11), ref);   // another stream
  EXPECT_NE(Encode(*b, src, 10), ref);   // another seed
  // Each code is the floor or the ceiling of the deterministic t.
  auto det = Make(CodecKind::kQ8);
  std::vector<uint8_t> d = Codes(Encode(*det, src)), s = Codes(ref);
  const Q8Header h = Header(ref);
  size_t differ = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    const double t = (static_cast<double>(src[i]) - h.min) / h.scale;
    ASSERT_GE(s[i], std::floor(t) - 1e-3) << i;
    ASSERT_LE(s[i], std::ceil(t) + 1e-3) << i;
    differ += s[i] != d[i];
  }
  EXPECT_GT(differ, 100u);  // about half of them round the other way
}

}  // namespace
}  // namespace pipesgd
