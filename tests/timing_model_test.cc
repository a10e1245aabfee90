// The timing models (core/train/timing_model.h) against values computed by hand from the
// equations in docs/timing_models.md.
#include <gtest/gtest.h>

#include "core/train/timing_model.h"

namespace pipesgd::train {
namespace {

// W = 4, M = 4 MB, alpha = 100 us, B = 125 MB/s (1 Gbit/s), C = 10 ms, U = 1 ms,
// rho = 1 ns/B, o = 10 us.
TimingInputs Lab() {
  TimingInputs in;
  in.workers = 4;
  in.model_bytes = 4e6;
  in.latency_s = 1e-4;
  in.bandwidth_Bps = 1.25e8;
  in.compute_s = 0.01;
  in.update_s = 0.001;
  in.reduce_s_per_byte = 1e-9;
  in.chunk_overhead_s = 1e-5;
  return in;
}

const CodecCost kNone{"none", 1, 0};

TEST(TimingModel, RingAllReduceByHand) {
  // Block 1e6 B, one chunk of 1e6 B: 6 alpha + max(6 * 1e6 / 1.25e8, 6 (1e6 * 1e-9 + 1e-5))
  // + 6 * 1e6 * 1e-9 = 0.0006 + 0.048 + 0.006.
  EXPECT_NEAR(RingAllReduceTime(Lab(), kNone, 1e6), 0.0546, 1e-12);
  // Chunks of 250 kB: m = 4, s = 250 kB: the fill term drops to 6 * 2.5e5 * 1e-9 = 0.0015.
  EXPECT_NEAR(RingAllReduceTime(Lab(), kNone, 2.5e5), 0.0501, 1e-12);
  // q8 (r = 4, kappa = 2 ns/B): the link term 0.012 is now below the CPU term
  // 6 (1e6 * 3e-9 + 1e-5) = 0.01806; fill 6 * 1e6 * 3e-9 = 0.018.
  EXPECT_NEAR(RingAllReduceTime(Lab(), {"q8", 4, 2e-9}, 1e6), 0.03666, 1e-12);
  TimingInputs one = Lab();
  one.workers = 1;
  EXPECT_EQ(RingAllReduceTime(one, kNone, 1e6), 0.0);
}

TEST(TimingModel, SchemesByHand) {
  const TimingInputs in = Lab();
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.01 + 0.001 + 0.0546, 1e-12);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 1), 0.0656, 1e-12);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.0546, 1e-12);  // communication-bound
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 4), 0.0546, 1e-12);  // wider is no faster
  // C + 2 alpha + 2 W M / B + W M rho + U = 0.01 + 0.0002 + 0.256 + 0.016 + 0.001.
  EXPECT_NEAR(PsSyncTime(in, kNone), 0.2832, 1e-12);
  // max(worker 0.01 + 0.0002 + 0.064 + 0.004 + 0.001, server link 0.128, server CPU 0.02).
  EXPECT_NEAR(PsAsyncTime(in, kNone), 0.128, 1e-12);
  TimingInputs compute_bound = in;
  compute_bound.compute_s = 0.1;
  EXPECT_NEAR(PipeTime(compute_bound, kNone, 1e6, 2), 0.101, 1e-12);
  // Async PS: now the worker's own cycle is the slowest: 0.1 + 0.0002 + 0.064 + 0.004 + 0.001.
  EXPECT_NEAR(PsAsyncTime(compute_bound, kNone), 0.1692, 1e-12);
  // Codec on the PS: 2 W M / (r B) with r = 2, plus 2 M kappa + W M kappa at kappa = 1 ns/B.
  EXPECT_NEAR(PsSyncTime(in, {"trunc16", 2, 1e-9}),
              0.01 + 0.0002 + 0.128 + 0.016 + 0.001 + 0.008 + 0.016, 1e-12);
}

TEST(TimingModel, BestChunkIsInteriorWhenCpuBound) {
  // An infinitely fast link: T_AR = 6 alpha + 6 (1e-3 + m o) + 6 (1e6 / m) rho, smallest near
  // m = 10. Among powers of two: 64 KiB (m = 16: 2.225e-4), 128 KiB (m = 8: 2.05e-4),
  // 256 KiB (m = 4: 2.9e-4) -> 128 KiB.
  TimingInputs in = Lab();
  in.bandwidth_Bps = 1e15;
  EXPECT_EQ(BestChunkBytes(in, kNone, DefaultChunkSizes()), 131072.0);
  EXPECT_NEAR(RingAllReduceTime(in, kNone, 131072), 6e-4 + 6 * (1e-3 + 8e-5) + 6 * 1.25e-4,
              1e-9);
  // Link-bound (1 Gbit/s): the smallest chunk wins (the fill shrinks, the CPU stays hidden).
  EXPECT_EQ(BestChunkBytes(Lab(), kNone, DefaultChunkSizes()), 4096.0);
}

// The overhead fitted to an AllReduce time is the one that produced it, and it is 0 when the
// model is already slower than what was measured.
TEST(TimingModel, FitChunkOverheadRecoversTheOverhead) {
  TimingInputs in = Lab();
  in.chunk_overhead_s = 30e-6;
  const double measured = RingAllReduceTime(in, kNone, 4096);
  TimingInputs blind = in;
  blind.chunk_overhead_s = 0;
  ASSERT_LT(RingAllReduceTime(blind, kNone, 4096), measured);  // the overhead shows at 4 KiB
  EXPECT_NEAR(FitChunkOverhead(blind, 4096, measured), 30e-6, 1e-10);
  EXPECT_EQ(FitChunkOverhead(blind, 4096, RingAllReduceTime(blind, kNone, 4096) * 0.5), 0.0);
  EXPECT_EQ(FitChunkOverhead(blind, 4096, 1e6), 10e-3);  // capped
}

// Three timed AllReduces made by the model itself give back its B, o and gamma.
TEST(TimingModel, FitRingRecoversBandwidthOverheadAndContention) {
  TimingInputs truth = Lab();
  truth.chunk_overhead_s = 30e-6;
  truth.bandwidth_Bps = 2e8;
  truth.contention = 0.6;
  const TimedAllReduce small{4096, RingAllReduceTime(truth, kNone, 4096)};
  const TimedAllReduce mid{65536, RingAllReduceTime(truth, kNone, 65536)};
  const TimedAllReduce large{16 << 20, RingAllReduceTime(truth, kNone, 16 << 20)};
  TimingInputs guess = truth;
  guess.bandwidth_Bps = 5e7;
  guess.chunk_overhead_s = 1e-6;
  guess.contention = 0;
  const RingFit fit = FitRing(guess, small, mid, large);
  EXPECT_NEAR(fit.bandwidth_Bps / 2e8, 1.0, 1e-6);
  EXPECT_NEAR(fit.chunk_overhead_s, 30e-6, 1e-9);
  EXPECT_NEAR(fit.contention, 0.6, 1e-6);
  EXPECT_TRUE(fit.bandwidth_fitted);
  // A large AllReduce timed below the latency and reduction floor: B stays the guess and the
  // fit says it could not place it.
  const RingFit floor = FitRing(guess, small, mid, {16 << 20, 1e-9});
  EXPECT_FALSE(floor.bandwidth_fitted);
  EXPECT_EQ(floor.bandwidth_Bps, 5e7);
  // Contention adds the shorter term: at gamma = 1 the link and the CPU are serial.
  TimingInputs serial = truth;
  serial.contention = 1;
  TimingInputs overlapped = truth;
  overlapped.contention = 0;
  const double link = 6 * 1e6 / 2e8, cpu = 6 * (1e6 * 1e-9 + 30e-6);
  EXPECT_NEAR(RingAllReduceTime(serial, kNone, 16 << 20) -
                  RingAllReduceTime(overlapped, kNone, 16 << 20),
              std::min(link, cpu), 1e-12);
  EXPECT_NEAR(FitBandwidth(truth, 16 << 20, large.seconds) / 2e8, 1.0, 1e-9);
  EXPECT_EQ(FitBandwidth(truth, 16 << 20, 1e-9), 0.0);  // faster than any link: latency-bound
}

TEST(TimingModel, RingTermsAddUpToTheTime) {
  TimingInputs in = Lab();
  in.contention = 0.5;
  const RingTerms t = RingAllReduceTerms(in, {"q8", 4, 2e-9}, 2.5e5);
  // m = 4 chunks of 250 kB; L = 6 x 1e6 / (4 x 1.25e8) = 0.012; P = 6 (1e6 x 3e-9 + 4 x 1e-5)
  // = 0.01824; fill 6 x 2.5e5 x 3e-9 = 0.0045.
  EXPECT_EQ(t.chunks_per_block, 4.0);
  EXPECT_NEAR(t.latency_s, 6e-4, 1e-15);
  EXPECT_NEAR(t.link_s, 0.012, 1e-15);
  EXPECT_NEAR(t.cpu_s, 0.01824, 1e-15);
  EXPECT_NEAR(t.tail_s, 0.0045, 1e-15);
  EXPECT_NEAR(t.total_s, 6e-4 + 0.01824 + 0.5 * 0.012 + 0.0045, 1e-15);
  EXPECT_EQ(t.total_s, RingAllReduceTime(in, {"q8", 4, 2e-9}, 2.5e5));
}

TEST(TimingModel, WidthTwoOverlapSlowsByTheMeasuredFactors) {
  TimingInputs in = Lab();  // a = C + U = 0.011, b = T_AR = 0.0546 at 1 MB chunks
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.0546, 1e-12);  // factors 1: max(a, b)
  in.overlap_compute_factor = 2;
  in.overlap_allreduce_factor = 2;
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.011 + 0.0546, 1e-12);  // one core: a + b
  // Compute 1.5x slower while the AllReduce runs, the AllReduce 4x: compute ends at 0.0165, by
  // when the AllReduce has done 0.0165 / 4 of its 0.0546 and does the rest at full speed.
  in.overlap_compute_factor = 1.5;
  in.overlap_allreduce_factor = 4;
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.0165 + 0.0546 - 0.0165 / 4, 1e-12);
  // Compute the longer: the AllReduce (0.0546 x 1.1) ends first, compute goes on alone.
  in.compute_s = 0.2;
  in.overlap_compute_factor = 1.2;
  in.overlap_allreduce_factor = 1.1;
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.0546 * 1.1 + 0.201 - 0.0546 * 1.1 / 1.2, 1e-12);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 1), 0.201 + 0.0546, 1e-12);  // width 1: no overlap
}

TEST(TimingModel, PredictAllPicksTheFastest) {
  const ModelReport report =
      PredictAll(Lab(), {kNone, {"q8", 4, 2e-9}}, std::vector<double>{1e6});
  ASSERT_EQ(report.rows.size(), 6u);  // ps_sync, ps_async (none only), ring_sync and pipe_k2 x 2
  for (const SchemePrediction& row : report.rows) {
    if (row.scheme.rfind("ps_", 0) == 0) {
      EXPECT_EQ(row.codec, "none") << row.scheme;
    }
  }
  // pipe_k2 with q8: max(0.011, 0.03666).
  EXPECT_EQ(report.best.scheme, "pipe_k2");
  EXPECT_EQ(report.best.codec, "q8");
  EXPECT_EQ(report.best_width, 2);
  EXPECT_NEAR(report.best.iteration_s, 0.03666, 1e-12);
}

}  // namespace
}  // namespace pipesgd::train
