// Compression inside the ring AllReduce, across real processes on loopback TCP: every rank ends
// with bitwise the same result, within the codec's error bound times the number of encodes of
// the exact sum; fp16 saturates instead of producing inf; error feedback transmits what one
// step cannot; per-call options (warm-up, exact tail, minimum size) and mismatched codecs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/base/error.h"
#include "core/collective/codec.h"
#include "core/collective/ring_allreduce.h"
#include "core/base/rng.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"

namespace pipesgd {
namespace {

using collective::AllReduceOptions;
using collective::CommunicatorOptions;
using collective::ReduceOp;
using testing::PackFloats;
using testing::RankContext;
using testing::RunRanks;
using testing::UnpackFloats;

// Rank r's element i: uniform in [-1, 1), a pure function of (r, i).
float Input(int rank, uint64_t i) {
  pipesgd::Rng rng((static_cast<uint64_t>(rank) << 40) ^ (i * 0x9E3779B97F4A7C15ull) ^ 0x5eed);
  return rng.Uniform(-1.0f, 1.0f);
}

struct CodecCase {
  const char* name;
  CodecOptions codec;
};

CodecOptions Codec(CodecKind kind, bool rne = false, bool stochastic = false) {
  CodecOptions o;
  o.kind = kind;
  o.round_to_nearest_even = rne;
  o.stochastic_rounding = stochastic;
  o.seed = 7;
  return o;
}

const CodecCase kCodecs[] = {
    {"trunc16", Codec(CodecKind::kTrunc16)},
    {"trunc16_rne", Codec(CodecKind::kTrunc16, true)},
    {"fp16", Codec(CodecKind::kFp16)},
    {"q8", Codec(CodecKind::kQ8)},
    {"q8_stochastic", Codec(CodecKind::kQ8, false, true)},
    {"q4", Codec(CodecKind::kQ4)},
    {"q4_stochastic", Codec(CodecKind::kQ4, false, true)},
    {"sign1", Codec(CodecKind::kSign1)},
};
constexpr int kNumCodecs = sizeof(kCodecs) / sizeof(kCodecs[0]);

class CompressedRing : public ::testing::TestWithParam<std::tuple<int, int>> {};

// Bit-identical replicas and the error bound, for sum and average, at several counts and with
// chunks small enough that every block has many of them.
TEST_P(CompressedRing, ReplicasAreIdenticalAndWithinBound) {
  const int world = std::get<0>(GetParam());
  const CodecCase& codec_case = kCodecs[std::get<1>(GetParam())];
  const std::vector<uint64_t> counts = {1, 7, 1023, 100003};
  CommunicatorOptions options;
  options.chunk_bytes = 4096;
  options.codec = codec_case.codec;
  auto results = RunRanks(world, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx, options);
    std::string out;
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
      for (uint64_t count : counts) {
        std::vector<float> data(count);
        for (uint64_t i = 0; i < count; ++i) data[i] = Input(ctx.rank, i);
        comm->AllReduce(data, op, Deadline::After(60));
        if (!comm->last_wire_stats().compressed) Throw(ErrorCode::kInternal, "not compressed");
        out += PackFloats(data.data(), data.size());
      }
    }
    return out;
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
  }
  // Every rank's bytes are the same: no replica drifts.
  for (int r = 1; r < world; ++r) {
    ASSERT_TRUE(results[r].output == results[0].output) << "rank " << r << " differs from rank 0";
  }
  const std::vector<float> all = UnpackFloats(results[0].output);
  auto codec = MakeCodec(codec_case.codec);
  size_t at = 0;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    for (uint64_t count : counts) {
      // Every partial sum lies within +-M, M = the sum over ranks of each rank's largest |input|
      // (a decoded value never leaves its chunk's [min, max], or for sign1 its +-max |x|),
      // grown by 10% for float rounding, so each of the N encodes (N-1 hops, one all-gather) is
      // off by at most ErrorBound(M, -M, M); an average divides it by N. For sign1 that bound
      // is M itself: one call alone can lose everything, which error feedback gives back later
      // (CompressedRingErrorFeedback below).
      double m = 0;
      for (int r = 0; r < world; ++r) {
        double largest = 0;
        for (uint64_t i = 0; i < count; ++i) largest = std::max(largest, std::fabs(double{Input(r, i)}));
        m += largest;
      }
      m *= 1.1;
      double bound = world * codec->ErrorBound(m, -m, m);
      if (op == ReduceOp::kAverage) bound /= world;
      for (uint64_t i = 0; i < count; ++i) {
        double exact = 0;
        for (int r = 0; r < world; ++r) exact += Input(r, i);
        if (op == ReduceOp::kAverage) exact /= world;
        const float got = all[at + i];
        ASSERT_LE(std::fabs(got - exact), bound)
            << codec_case.name << " world " << world << " op " << static_cast<int>(op)
            << " count " << count << " element " << i << ": got " << got << ", exact " << exact;
      }
      at += count;
    }
  }
  EXPECT_EQ(at, all.size());
}

INSTANTIATE_TEST_SUITE_P(WorldsAndCodecs, CompressedRing,
                         ::testing::Combine(::testing::Values(2, 3, 4, 5, 8),
                                            ::testing::Range(0, kNumCodecs)),
                         [](const auto& param_info) {
                           return fmt::format("world{}_{}", std::get<0>(param_info.param),
                                              kCodecs[std::get<1>(param_info.param)].name);
                         });

TEST(CompressedRingFp16, SumAboveRangeSaturatesNeverInf) {
  // 40000 + 60000 = 100000 > 65504: each input fits fp16, the sum does not. Policy: partial
  // sums stay float32, the encode clamps to +-65504 and counts it; no rank ever sees inf.
  CommunicatorOptions options;
  options.codec.kind = CodecKind::kFp16;
  auto results = RunRanks(2, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx, options);
    std::vector<float> data = {ctx.rank == 0 ? 40000.0f : 60000.0f,
                               ctx.rank == 0 ? -40000.0f : -60000.0f, 1.0f, 2048.0f};
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(30));
    return fmt::format("{} {} {} {} saturated {}", data[0], data[1], data[2], data[3],
                       comm->last_wire_stats().saturated);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output.substr(0, results[r].output.find(" saturated")),
              "65504 -65504 2 4096");
  }
  // The block owner's encode of the sum clamped both elements of its chunk (one rank owns
  // the block holding elements 0 and 1; 4 elements over 2 ranks: elements 0-1 are block 0).
  EXPECT_EQ(results[0].output.substr(results[0].output.find("saturated")) + "|" +
                results[1].output.substr(results[1].output.find("saturated")),
            "saturated 0|saturated 2");
}

// Rank 0 sends [1, -1, v, 0, ...]: v is below half a q8 step (2/255), so q8 rounds it to the
// grid every time. With error feedback the transmitted values add up to the true total within
// one step; without it, they drift away.
std::string EfTransmittedSum(const RankContext& ctx, bool error_feedback, int steps, float v) {
  CommunicatorOptions options;
  options.codec.kind = CodecKind::kQ8;
  options.error_feedback = error_feedback;
  auto comm = testing::ConnectRing(ctx, options);
  double transmitted = 0;
  for (int step = 0; step < steps; ++step) {
    // Rank 1 adds zeros: its chunks are constant (exact), so the ring carries rank 0's encoded
    // values unchanged and the result is exactly what rank 0 transmitted.
    std::vector<float> data(8, 0.0f);
    if (ctx.rank == 0) {
      data[0] = 1.0f;
      data[1] = -1.0f;
      data[2] = v;
    }
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(30));
    transmitted += data[2];
  }
  return fmt::format("{:.9g}", transmitted);
}

TEST(CompressedRingErrorFeedback, SubStepValueIsTransmittedInTotal) {
  const int steps = 1000;
  const float v = 0.001f;
  const double step = 2.0 / 255;  // q8 step for a chunk spanning [-1, 1]
  for (bool ef : {true, false}) {
    auto results = RunRanks(2, [&](const RankContext& ctx) {
      return EfTransmittedSum(ctx, ef, steps, v);
    });
    ASSERT_EQ(results[0].exit_code, 0) << results[0].error;
    ASSERT_EQ(results[1].exit_code, 0) << results[1].error;
    EXPECT_EQ(results[0].output, results[1].output);
    const double total = std::stod(results[0].output);
    const double truth = static_cast<double>(v) * steps;
    if (ef) {
      EXPECT_LE(std::fabs(total - truth), step) << "with error feedback: " << total << " vs " << truth;
    } else {
      // Without feedback every step rounds v to the same grid point: far off after 1000 steps.
      EXPECT_GT(std::fabs(total - truth), 100 * step) << "without error feedback: " << total;
    }
  }
}

// Error feedback at every encode: each rank encodes each element once per call, so over T calls
// the results add up to the exact sums less the ranks' current residuals (kSum), or less their
// sum over N (kAverage: residuals are kept in summed units). Before, only a rank's own
// contribution was fed back, and the losses of the re-encoded partial sums at every later hop
// were lost for good: for sign1 that is most of the gradient.
class CompressedRingFeedback : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};

TEST_P(CompressedRingFeedback, ResultsAddUpToTheExactSumsLessTheResiduals) {
  const int world = std::get<0>(GetParam());
  const CodecCase& codec_case = kCodecs[std::get<1>(GetParam())];
  const bool average = std::get<2>(GetParam());
  const ReduceOp op = average ? ReduceOp::kAverage : ReduceOp::kSum;
  const uint64_t count = 1500;
  const int steps = 40;
  CommunicatorOptions options;
  options.chunk_bytes = 1024;  // several chunks, and groups, per block
  options.codec = codec_case.codec;
  options.error_feedback = true;
  auto input = [](int rank, int step, uint64_t i) {
    return Input(rank, static_cast<uint64_t>(step) * 100000 + i);
  };
  auto results = RunRanks(world, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx, options);
    std::vector<double> total(count, 0.0);
    std::string replicas;  // every call's result, for the bitwise comparison across ranks
    for (int step = 0; step < steps; ++step) {
      std::vector<float> data(count);
      for (uint64_t i = 0; i < count; ++i) data[i] = input(ctx.rank, step, i);
      comm->AllReduce(data, op, Deadline::After(60));
      for (uint64_t i = 0; i < count; ++i) total[i] += data[i];
      replicas += PackFloats(data.data(), data.size());
    }
    std::vector<float> out(2 * count);
    for (uint64_t i = 0; i < count; ++i) {
      out[i] = static_cast<float>(total[i]);
      out[count + i] = comm->residual()[i];
    }
    return PackFloats(out.data(), out.size()) + replicas;
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].error;
  }
  const size_t head = 2 * count * sizeof(float);
  for (int r = 1; r < world; ++r) {
    ASSERT_TRUE(results[r].output.substr(head) == results[0].output.substr(head))
        << "rank " << r << " differs from rank 0";
  }
  std::vector<std::vector<float>> got(world);
  for (int r = 0; r < world; ++r) got[r] = UnpackFloats(results[r].output.substr(0, head));
  double worst = 0, worst_residual = 0;
  for (uint64_t i = 0; i < count; ++i) {
    double exact = 0;
    for (int step = 0; step < steps; ++step) {
      for (int r = 0; r < world; ++r) exact += input(r, step, i);
    }
    double residuals = 0;
    for (int r = 0; r < world; ++r) {
      residuals += got[r][count + i];
      worst_residual = std::max(worst_residual, std::fabs(double{got[r][count + i]}));
    }
    if (average) {
      exact /= world;
      residuals /= world;
    }
    worst = std::max(worst, std::fabs(got[0][i] + residuals - exact));
  }
  // Float rounding only: per call a few roundings of values below ~2N per rank and hop, so
  // 40 calls stay far below 1e-3 * N. The residuals themselves are up to a codec step
  // (sign1: about the size of a partial sum).
  EXPECT_LE(worst, 1e-3 * world) << codec_case.name << " world " << world
                                 << ", largest residual " << worst_residual;
}

INSTANTIATE_TEST_SUITE_P(WorldsAndCodecs, CompressedRingFeedback,
                         ::testing::Combine(::testing::Values(2, 3, 4, 8),
                                            ::testing::Values(3, 5, 7),  // q8, q4, sign1
                                            ::testing::Bool()),
                         [](const auto& param_info) {
                           return fmt::format("world{}_{}_{}", std::get<0>(param_info.param),
                                              kCodecs[std::get<1>(param_info.param)].name,
                                              std::get<2>(param_info.param) ? "average" : "sum");
                         });

TEST(CompressedRingErrorFeedback, ResidualResetsWhenTheCountChanges) {
  CommunicatorOptions options;
  options.codec.kind = CodecKind::kQ8;
  options.error_feedback = true;
  auto results = RunRanks(2, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx, options);
    std::vector<float> data(100, 0.0f);
    data[0] = 1.0f;
    data[1] = 0.001f;
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(30));
    const size_t first = comm->residual().size();
    const float kept = comm->residual()[1];
    std::vector<float> other(50, 0.5f);
    comm->AllReduce(other, ReduceOp::kSum, Deadline::After(30));
    // A constant chunk is exact: the fresh residual is all zeros.
    float max_abs = 0;
    for (float e : comm->residual()) max_abs = std::max(max_abs, std::fabs(e));
    return fmt::format("{} {} {} {}", first, kept != 0.0f, comm->residual().size(), max_abs);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "100 true 50 0");
  }
}

TEST(CompressedRingOptions, WarmupMinBytesAndExactTail) {
  CommunicatorOptions options;
  options.codec.kind = CodecKind::kQ8;
  options.compression_min_bytes = 4096;
  auto results = RunRanks(3, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx, options);
    std::string out;
    // Integer inputs whose q8 encoding is not exact: 0..1000 spans a step of 1000/255.
    auto fill = [&](std::vector<float>& data) {
      for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>((i * 7 + ctx.rank) % 1001);
    };
    auto exact = [&](const std::vector<float>& data, size_t i) {
      float s = 0;
      for (int r = 0; r < 3; ++r) s += static_cast<float>((i * 7 + r) % 1001);
      return data[i] == s;
    };
    // compress = false (a warm-up step): float32 on the wire, exact.
    std::vector<float> data(5000);
    fill(data);
    AllReduceOptions warmup;
    warmup.compress = false;
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(30), nullptr, warmup);
    bool all_exact = true;
    for (size_t i = 0; i < data.size(); ++i) all_exact &= exact(data, i);
    out += fmt::format("warmup compressed={} exact={} ratio={};", comm->last_wire_stats().compressed,
                       all_exact, comm->last_wire_stats().compression_ratio());
    // 1000 elements = 4000 bytes < min_bytes: uncompressed, exact.
    std::vector<float> small(1000);
    fill(small);
    comm->AllReduce(small, ReduceOp::kSum, Deadline::After(30));
    all_exact = true;
    for (size_t i = 0; i < small.size(); ++i) all_exact &= exact(small, i);
    out += fmt::format("small compressed={} exact={};", comm->last_wire_stats().compressed, all_exact);
    // Compressed with an exact tail of 3: the head is approximate, the tail exact.
    fill(data);
    AllReduceOptions tail;
    tail.exact_tail = 3;
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(30), nullptr, tail);
    size_t head_exact = 0;
    for (size_t i = 0; i + 3 < data.size(); ++i) head_exact += exact(data, i);
    out += fmt::format("tail compressed={} tail_exact={}{}{} head_mostly_inexact={}",
                       comm->last_wire_stats().compressed, exact(data, 4997), exact(data, 4998),
                       exact(data, 4999), head_exact < 4997 / 2);
    return out;
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output,
              "warmup compressed=false exact=true ratio=1;small compressed=false exact=true;"
              "tail compressed=true tail_exact=truetruetrue head_mostly_inexact=true");
  }
}

TEST(CompressedRingStats, Trunc16HalvesThePayload) {
  CommunicatorOptions options;
  options.codec.kind = CodecKind::kTrunc16;
  options.chunk_bytes = 4096;
  auto results = RunRanks(4, [&](const RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx, options);
    std::vector<float> data(1 << 16, 1.0f);
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(30));
    const auto& s = comm->last_wire_stats();
    // Each rank sends 2(N-1)/N of the buffer: 6/4 * 2^16 floats = 98304 floats.
    return fmt::format("{} {} {} {}", s.raw_payload_bytes, s.payload_bytes,
                       s.compression_ratio(), data[12345]);
  });
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(results[r].exit_code, 0) << results[r].error;
    EXPECT_EQ(results[r].output, "393216 196608 2 4");
  }
}

TEST(CompressedRingMismatch, DifferentCodecsFailByName) {
  auto results = RunRanks(2, [](const RankContext& ctx) {
    CommunicatorOptions options;
    options.codec.kind = ctx.rank == 0 ? CodecKind::kQ8 : CodecKind::kNone;
    auto comm = testing::ConnectRing(ctx, options);
    std::vector<float> data(1000, 1.0f);
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(20));
    return std::string("no error");
  }, 40);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].exit_code, 1) << "rank " << r << ": " << results[r].output;
    EXPECT_NE(results[r].error.find("compression of chunk 0"), std::string::npos) << results[r].error;
    EXPECT_NE(results[r].error.find("= q8"), std::string::npos) << results[r].error;
    EXPECT_NE(results[r].error.find("= none"), std::string::npos) << results[r].error;
  }
}

TEST(CompressedRingNumerical, NonFiniteInputNamesTheElement) {
  auto results = RunRanks(2, [](const RankContext& ctx) {
    CommunicatorOptions options;
    options.codec.kind = CodecKind::kTrunc16;
    auto comm = testing::ConnectRing(ctx, options);
    std::vector<float> data(1000, 1.0f);
    if (ctx.rank == 1) data[777] = std::numeric_limits<float>::infinity();
    comm->AllReduce(data, ReduceOp::kSum, Deadline::After(10));
    return std::string("no error");
  }, 40);
  EXPECT_NE(results[1].exit_code, 0);
  EXPECT_NE(results[1].error.find("rank 1: compressing elements"), std::string::npos)
      << results[1].error;
  EXPECT_NE(results[1].error.find("inf"), std::string::npos) << results[1].error;
  // Rank 0 loses its neighbour and fails too, within its deadline.
  EXPECT_NE(results[0].exit_code, 0);
}

}  // namespace
}  // namespace pipesgd
