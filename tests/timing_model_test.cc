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
  // Placeable with the guessed overhead (1 us: a floor of 6 x 15 us + 6 x 1 us = 96 us below
  // the 200 us measured), not with the one the small chunks then fit (~57 us: a 432 us floor).
  // The fit went on with the first round's B and reported it not fitted (a loaded CI machine);
  // B must be the guess whenever it says not fitted.
  TimingInputs loaded = guess;
  loaded.model_bytes = 940584;
  loaded.latency_s = 15e-6;
  loaded.reduce_s_per_byte = 0;
  const RingFit late = FitRing(loaded, {4096, 0.020}, {65536, 0.003}, {16 << 20, 200e-6});
  EXPECT_FALSE(late.bandwidth_fitted);
  EXPECT_EQ(late.bandwidth_Bps, 5e7);
  // Contention adds the shorter term: at gamma = 1 the link and the CPU are serial, L + P and
  // no fill (P holds the chunk's work already; it was counted twice); at gamma = 0 the longer
  // term and the fill (16 MiB chunks: one chunk, the whole 1 MB block, 6 x 1e6 x 1 ns).
  TimingInputs serial = truth;
  serial.contention = 1;
  TimingInputs overlapped = truth;
  overlapped.contention = 0;
  const double link = 6 * 1e6 / 2e8, cpu = 6 * (1e6 * 1e-9 + 30e-6), fill = 6 * 1e6 * 1e-9;
  EXPECT_NEAR(RingAllReduceTime(serial, kNone, 16 << 20), 6e-4 + link + cpu, 1e-12);
  EXPECT_NEAR(RingAllReduceTime(overlapped, kNone, 16 << 20), 6e-4 + link + fill, 1e-12);
  EXPECT_NEAR(FitBandwidth(truth, 16 << 20, large.seconds) / 2e8, 1.0, 1e-9);
  EXPECT_EQ(FitBandwidth(truth, 16 << 20, 1e-9), 0.0);  // faster than any link: latency-bound
}

// Where the fill outweighs the shorter term (a fast link, one chunk per block), T falls as gamma
// grows: the fit used to search for a rising crossing and returned 0 for every such time.
TEST(TimingModel, FitContentionWhereTheTimeFallsWithGamma) {
  TimingInputs in = Lab();
  in.bandwidth_Bps = 1e11;  // L = 6 x 1e6 / 1e11 = 60 us; fill at 16 MiB = 6 x 1e6 x 1 ns = 6 ms
  in.contention = 0.3;
  const double measured = RingAllReduceTime(in, kNone, 16 << 20);
  in.contention = 0;
  ASSERT_LT(measured, RingAllReduceTime(in, kNone, 16 << 20));
  EXPECT_NEAR(FitContention(in, 16 << 20, measured), 0.3, 1e-9);
  EXPECT_EQ(FitContention(in, 16 << 20, 1.0), 0.0);  // slower than any gamma gives: clamped
  EXPECT_EQ(FitContention(in, 16 << 20, 0.0), 1.0);
}

// s_c above 1 (a BLAS thread pool during the compute) does not scale the one-thread reduction
// and codec up.
TEST(TimingModel, ComputeShareAboveOneCountsTheReductionWhole) {
  TimingInputs in = Lab();
  in.compute_cpu_share = 4;
  EXPECT_NEAR(RingAllReduceCpuTime(in, kNone, 1e6), 6 * 1e6 * 1e-9, 1e-15);  // no transport CPU
}

TEST(TimingModel, RingTermsAddUpToTheTime) {
  TimingInputs in = Lab();
  in.contention = 0.5;
  const RingTerms t = RingAllReduceTerms(in, {"q8", 4, 2e-9}, 2.5e5);
  // m = 4 chunks of 250 kB; L = 6 x 1e6 / (4 x 1.25e8) = 0.012; P = 6 (1e6 x 3e-9 + 4 x 1e-5)
  // = 0.01824; fill 6 x 2.5e5 x 3e-9 = 0.0045, half of which gamma = 0.5 leaves.
  EXPECT_EQ(t.chunks_per_block, 4.0);
  EXPECT_NEAR(t.latency_s, 6e-4, 1e-15);
  EXPECT_NEAR(t.link_s, 0.012, 1e-15);
  EXPECT_NEAR(t.cpu_s, 0.01824, 1e-15);
  EXPECT_NEAR(t.tail_s, 0.5 * 0.0045, 1e-15);  // the fill that overlaps nothing: 1 - gamma of it
  EXPECT_NEAR(t.total_s, 6e-4 + 0.01824 + 0.5 * 0.012 + 0.5 * 0.0045, 1e-15);
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

TEST(TimingModel, CpuBoundByHand) {
  // Lab() on cores it shares: half a core while computing and while both threads run
  // (s_c = s = 0.5); the transport takes 1 ns per byte sent and 10 us per message.
  TimingInputs in = Lab();
  in.compute_cpu_share = 0.5;
  in.cpu_share = 0.5;
  in.transport_cpu_s_per_byte = 1e-9;
  in.transport_cpu_s_per_message = 1e-5;
  // 1 MB chunks (m = 1): 6 (1e6 rho s_c + 1e6 x 1 ns + 1 x 10 us) = 0.00906 s of CPU per
  // AllReduce (rho, a wall time taken at s_c as C is, is half CPU; counted whole, 0.01206).
  EXPECT_NEAR(RingAllReduceCpuTime(in, kNone, 1e6), 0.00906, 1e-12);
  // q8 (r = 4, kappa = 2 ns/B), 250 kB chunks (m = 4): 6 (1e6 x 3 ns + 2.5e5 x 1 ns + 4 x 10 us).
  EXPECT_NEAR(RingAllReduceCpuTime(in, {"q8", 4, 2e-9}, 2.5e5),
              6 * (1.5e-3 + 2.5e-4 + 4e-5), 1e-12);
  // The codec's own CPU where the probe measured it (3 ns/B, 2 us per chunk) is taken as it is,
  // not at s_c: 6 (1e6 x (1 ns x 0.5 + 3 ns) + 2.5e5 x 1 ns + 4 x (10 + 2) us).
  EXPECT_NEAR(RingAllReduceCpuTime(in, {"q8", 4, 2e-9, 3e-9, 0, 2e-6}, 2.5e5),
              6 * (3.5e-3 + 2.5e-4 + 4.8e-5), 1e-12);
  // (C + U) s_c + CPU of the AllReduce, over s: (0.011 x 0.5 + 0.00906) / 0.5 = 0.02912, above
  // width 1's C + U + T_AR = 0.0656 only when the link is fast: at 1e12 B/s T_AR = 0.0126.
  EXPECT_NEAR(CpuBoundTime(in, kNone, 1e6, 1), 0.02912, 1e-12);
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.011 + 0.0546, 1e-12);  // the link still bounds
  in.bandwidth_Bps = 1e12;
  const double t_ar = RingAllReduceTime(in, kNone, 1e6);
  EXPECT_NEAR(t_ar, 0.0006 + 0.00606 + 0.006, 1e-12);  // the 6 us link hides (gamma 0)
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.02912, 1e-12);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.02912, 1e-12);  // overlap cannot beat the CPU
  // Width 2's update with its staleness compensation, U_K = 3 ms against U = 1 ms: width 2's
  // bound is (0.013 x 0.5 + 0.00906) / 0.5 = 0.03112, width 1's stays.
  in.pipelined_update_s = 0.003;
  EXPECT_NEAR(CpuBoundTime(in, kNone, 1e6, 2), 0.03112, 1e-12);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.03112, 1e-12);
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.02912, 1e-12);
  EXPECT_NEAR(UpdateTime(in, 1), 0.001, 1e-15);
  in.pipelined_update_s = 0;  // not known: U
  EXPECT_NEAR(UpdateTime(in, 2), 0.001, 1e-15);
  // Measured below U (noise: it does U's work and more): U, so that width 2 does not win on it.
  in.pipelined_update_s = 0.0006;
  EXPECT_NEAR(UpdateTime(in, 2), 0.001, 1e-15);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.02912, 1e-12);
  in.pipelined_update_s = 0;
  // A rank with CPU to spare (s = 2 cores while both threads run): (0.0055 + 0.00906) / 2,
  // below both widths' times, which stand.
  in.cpu_share = 2;
  EXPECT_NEAR(CpuBoundTime(in, kNone, 1e6, 1), 0.00728, 1e-12);
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.011 + t_ar, 1e-12);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), t_ar, 1e-12);
  // No shares (a probe that did not measure them, or the command line): no bound.
  in.cpu_share = 0.5;
  in.compute_cpu_share = 0;
  EXPECT_EQ(CpuBoundTime(in, kNone, 1e6, 1), 0.0);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), t_ar, 1e-12);
  EXPECT_EQ(PsAsyncCpuBoundTime(in, kNone), 0.0);
}

TEST(TimingModel, FitCodecFromItsAllReduce) {
  // Lab() (gamma 0), q8 (r = 4) with kappa = 2 ns/B and o_c = 5 us per chunk: T = 6 alpha +
  // max(L = 0.012, P) + fill, P = 6 (1e6 (rho + kappa) + m (o + o_c)), fill = 6 s (rho + kappa).
  //   1 MB chunks (m = 1):   P = 6 (3e-3 + 15e-6) = 0.01809, fill 0.018:  T = 0.03669
  //   250 kB chunks (m = 4): P = 6 (3e-3 + 60e-6) = 0.01836, fill 0.0045: T = 0.02346
  // Its CPU (no shares: rho counted whole; no transport CPU) with kappa_cpu = 3 ns/B and
  // o_c,cpu = 4 us: 6e6 rho + 6 (1e6 kappa_cpu + m o_c,cpu) = 0.024024 and 0.024096.
  const TimingInputs in = Lab();
  CodecCost q8{"q8", 4, 2e-9, std::nullopt, 5e-6, 0};
  EXPECT_NEAR(RingAllReduceTime(in, q8, 1e6), 0.03669, 1e-12);
  EXPECT_NEAR(RingAllReduceTime(in, q8, 2.5e5), 0.02346, 1e-12);
  CodecCost fit = FitCodec(in, "q8", 4, {{1e6, 0.03669, 0.024024}, {2.5e5, 0.02346, 0.024096}});
  EXPECT_EQ(fit.name, "q8");
  EXPECT_EQ(fit.ratio, 4);
  EXPECT_NEAR(fit.s_per_byte, 2e-9, 1e-15);
  EXPECT_NEAR(fit.s_per_chunk, 5e-6, 1e-11);
  ASSERT_TRUE(fit.cpu_s_per_byte.has_value());
  EXPECT_NEAR(*fit.cpu_s_per_byte, 3e-9, 1e-15);
  EXPECT_NEAR(fit.cpu_s_per_chunk, 4e-6, 1e-12);
  // One size: no o_c; kappa where the time meets (0.01266 + 1.2e7 kappa at m = 1 and o_c = 0:
  // 0.03666 -> 2 ns/B), kappa_cpu from (0.024 - 0.006) / 6e6.
  fit = FitCodec(in, "q8", 4, {{1e6, 0.03666, 0.024}});
  EXPECT_NEAR(fit.s_per_byte, 2e-9, 1e-15);
  EXPECT_EQ(fit.s_per_chunk, 0.0);
  EXPECT_NEAR(*fit.cpu_s_per_byte, 3e-9, 1e-15);
  EXPECT_EQ(fit.cpu_s_per_chunk, 0.0);
  // Faster than the float32 path: the decode adds in the same pass, cheaper than rho. At
  // kappa = -0.5 ns/B, P = 6 (1e6 x 0.5 ns + 10 us) = 0.00306 falls below L = 0.012: T = 0.0006
  // + 0.012 + fill 6e6 x 0.5 ns = 0.0156 s; CPU 6e6 x 0.5 ns = 0.003 s.
  fit = FitCodec(in, "q8", 4, {{1e6, 0.0156, 0.003}});
  EXPECT_NEAR(fit.s_per_byte, -0.5e-9, 1e-15);
  EXPECT_NEAR(*fit.cpu_s_per_byte, -0.5e-9, 1e-15);
  // Faster than even that allows (below the latency and the link): -rho, where the reduction
  // costs nothing; never below. Its CPU: (0.001 - 0.006) / 6e6.
  fit = FitCodec(in, "q8", 4, {{1e6, 0.010, 0.001}});
  EXPECT_NEAR(fit.s_per_byte, -1e-9, 1e-15);
  EXPECT_NEAR(*fit.cpu_s_per_byte, -0.005 / 6e6, 1e-15);
  // More chunks took less CPU (0.0234 s at m = 4 against 0.024 at m = 1): o_c,cpu would be
  // negative beyond the transport's per-message CPU (0 here), so it stays at that floor and
  // kappa_cpu is fitted to both: (0.003 + 0.0029) / 2e6 = 2.95 ns/B.
  fit = FitCodec(in, "q8", 4, {{1e6, 0.03669, 0.024}, {2.5e5, 0.02346, 0.0234}});
  EXPECT_EQ(fit.cpu_s_per_chunk, 0.0);
  EXPECT_NEAR(*fit.cpu_s_per_byte, 2.95e-9, 1e-15);
  // With the shares known, the reduction's CPU is rho s_c, and the transport's is counted: at
  // s_c = 0.5 and 1 ns per byte sent, 6 (1e6 x 0.5 ns + 2.5e5 x 1 ns + 10 us) = 0.00456 s of
  // it; 0.02256 s measured leaves 0.018 s: kappa_cpu 3 ns/B.
  TimingInputs shared = in;
  shared.compute_cpu_share = 0.5;
  shared.cpu_share = 0.5;
  shared.transport_cpu_s_per_byte = 1e-9;
  shared.transport_cpu_s_per_message = 1e-5;
  fit = FitCodec(shared, "q8", 4, {{1e6, 0.03666, 0.02256}});
  EXPECT_NEAR(*fit.cpu_s_per_byte, 3e-9, 1e-15);
  // Less CPU than the transport alone takes (0.001 s against 0.00156): -rho's CPU, 0.5 ns/B.
  fit = FitCodec(shared, "q8", 4, {{1e6, 0.03666, 0.001}});
  EXPECT_NEAR(*fit.cpu_s_per_byte, -0.5e-9, 1e-15);
  // At the floor, exactly -rho: a rho whose -rho x 1e9 x 1e-9 rounds below it (the search runs
  // in ns/B) gave a kappa that `pipesgd model` then refused as below -reduce_s_per_byte.
  TimingInputs odd = in;
  odd.reduce_s_per_byte = 3.0672136320582264e-10;
  fit = FitCodec(odd, "trunc16", 2, {{1e6, 0.001, 0.001}});
  EXPECT_GE(fit.s_per_byte, -odd.reduce_s_per_byte);
  EXPECT_EQ(fit.s_per_byte, -odd.reduce_s_per_byte);
  // One worker, or nothing timed: nothing to fit.
  TimingInputs one = in;
  one.workers = 1;
  EXPECT_EQ(FitCodec(one, "q8", 4, {{1e6, 0.03666, 0.024}}).s_per_byte, 0.0);
  EXPECT_EQ(FitCodec(in, "q8", 4, {}).s_per_byte, 0.0);
}

TEST(TimingModel, SyncOverheadAddsToWidthOneOnly) {
  // Lab() at 1 MB chunks: width 1 0.0656 (C + U = 0.011, T_AR = 0.0546), width 2 0.0546
  // (SchemesByHand). A width-1 step timed at 0.0700 with its AllReduce timed at 0.0546 leaves
  // sigma = 0.0044.
  TimingInputs in = Lab();
  EXPECT_NEAR(FitSyncOverhead(in, kNone, 1e6, 0.0546, 0.0700), 0.0044, 1e-12);
  // sigma is what the step adds to the AllReduce as timed, not as modelled: timed at 0.0600,
  // the same step leaves -0.001 (a late rank's lag hidden in a long AllReduce).
  EXPECT_NEAR(FitSyncOverhead(in, kNone, 1e6, 0.0600, 0.0700), -0.001, 1e-12);
  in.sync_overhead_s = 0.0044;
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.0700, 1e-12);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 1), 0.0700, 1e-12);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.0546, 1e-12);  // hidden behind the AllReduce
  // Fitted from inputs that already hold a sigma: the same sigma, not the sum.
  EXPECT_NEAR(FitSyncOverhead(in, kNone, 1e6, 0.0546, 0.0700), 0.0044, 1e-12);
  // A negative sigma takes from the step, never below the longer of C + U and T_AR.
  in.sync_overhead_s = -0.0056;
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.0600, 1e-12);
  in.sync_overhead_s = -0.02;
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.0546, 1e-12);
  // On top of the CPU bound where that bounds (CpuBoundByHand: 0.02912 at 1e12 B/s).
  in.sync_overhead_s = 0.0044;
  in.bandwidth_Bps = 1e12;
  in.compute_cpu_share = 0.5;
  in.cpu_share = 0.5;
  in.transport_cpu_s_per_byte = 1e-9;
  in.transport_cpu_s_per_message = 1e-5;
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.02912 + 0.0044, 1e-12);
  EXPECT_NEAR(FitSyncOverhead(in, kNone, 1e6, 0.0126, 0.0300), 0.0300 - 0.02912, 1e-12);
}

TEST(TimingModel, OverheadBetweenTwoAllReduceTimes) {
  // As on the 1 Gbit/s lab: sigma -0.3 ms where the AllReduce takes 12 ms (no codec), +1 ms
  // where it takes 1.6 ms (the fastest codec). At 3 ms, linear in 1 / T_AR:
  // 1e-3 + (-1.3e-3) (625 - 333.33) / (625 - 83.33) = 1e-3 - 0.7e-3 = 0.3 ms.
  TimingInputs in = Lab();
  in.overhead_allreduce_s = 0.012;
  in.sync_overhead_s = -0.0003;
  in.fast_allreduce_s = 0.0016;
  in.fast_sync_overhead_s = 0.001;
  in.pipe_overhead_s = 0.002;
  in.fast_pipe_overhead_s = 0.004;
  EXPECT_NEAR(OverheadAt(in, 1, 0.003), 0.0003, 1e-15);
  EXPECT_NEAR(OverheadAt(in, 1, 0.0016), 0.001, 1e-15);
  EXPECT_NEAR(OverheadAt(in, 1, 0.012), -0.0003, 1e-15);
  // Beyond the two points: the nearer one's.
  EXPECT_NEAR(OverheadAt(in, 1, 0.001), 0.001, 1e-15);
  EXPECT_NEAR(OverheadAt(in, 1, 0.05), -0.0003, 1e-15);
  // Width 2 has its own pair: 0.004 - 0.002 x 0.538462 at 3 ms.
  EXPECT_NEAR(OverheadAt(in, 2, 0.003), 0.004 - 0.002 * (625 - 1000.0 / 3) / (625 - 1000.0 / 12),
              1e-15);
  // The schemes take sigma at their own T_AR: Lab()'s 0.0546 is beyond 12 ms, -0.3 ms.
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.0656 - 0.0003, 1e-12);
  // One point only (no fast time): its value everywhere.
  in.fast_allreduce_s = 0;
  EXPECT_NEAR(OverheadAt(in, 1, 0.003), -0.0003, 1e-15);
  EXPECT_NEAR(OverheadAt(in, 2, 0.003), 0.002, 1e-15);
  in.overhead_allreduce_s = 0;  // an earlier probe: no times at all
  in.fast_allreduce_s = 0.0016;
  EXPECT_NEAR(OverheadAt(in, 1, 0.003), -0.0003, 1e-15);
}

TEST(TimingModel, PipeOverheadAddsToWidthTwoOnly) {
  // Lab() at 1 MB chunks: width 2 0.0546 (the AllReduce bounds). A width-2 step timed at 0.0600
  // with its AllReduce timed at 0.0546 leaves sigma_2 = 0.0054.
  TimingInputs in = Lab();
  EXPECT_NEAR(FitPipeOverhead(in, kNone, 1e6, 0.0546, 0.0600), 0.0054, 1e-12);
  EXPECT_NEAR(FitPipeOverhead(in, kNone, 1e6, 0.0546, 0.0500), -0.0046, 1e-12);
  in.pipe_overhead_s = 0.0054;
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.0600, 1e-12);
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 1), 0.011 + 0.0546, 1e-12);  // width 1 has its own sigma
  EXPECT_NEAR(FitPipeOverhead(in, kNone, 1e6, 0.0546, 0.0600), 0.0054, 1e-12);  // not the sum
  // Negative: never below max(C + U_K, T_AR).
  in.pipe_overhead_s = -0.0046;
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.0546, 1e-12);
  in.pipe_overhead_s = 0.0054;
  // On top of the CPU bound where that bounds (CpuBoundByHand: 0.02912 at 1e12 B/s).
  in.bandwidth_Bps = 1e12;
  in.compute_cpu_share = 0.5;
  in.cpu_share = 0.5;
  in.transport_cpu_s_per_byte = 1e-9;
  in.transport_cpu_s_per_message = 1e-5;
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.02912 + 0.0054, 1e-12);
  // One worker waits for no AllReduce: no sigma_2.
  in.workers = 1;
  EXPECT_NEAR(PipeTime(in, kNone, 1e6, 2), 0.011, 1e-12);
}

TEST(TimingModel, PsAsyncCpuBoundByHand) {
  // Half a core per rank, 1 ns per byte and 10 us per message in the transport, a fast link.
  TimingInputs in = Lab();
  in.bandwidth_Bps = 1e12;
  in.compute_cpu_share = 0.5;
  in.cpu_share = 0.5;
  in.transport_cpu_s_per_byte = 1e-9;
  in.transport_cpu_s_per_message = 1e-5;
  // A push sends 4e6 B and receives as many, in 2 messages: X = 0.004 + 0.00002. Server:
  // S = 4 ((4e6 x 1e-9 + 0.001) x 0.5 + X) = 0.02608; a worker: 0.01 x 0.5 + X + S / 4 =
  // 0.01554; over s = 0.5: 0.05216.
  EXPECT_NEAR(PsAsyncCpuBoundTime(in, kNone), 0.05216, 1e-12);
  // Without it: max(worker 0.01 + 2e-4 + 8e-6 + 0.004 + 0.001, server link 1.6e-5, server CPU
  // 4 x 0.005) = 0.02.
  EXPECT_NEAR(PsAsyncTime(in, kNone), 0.05216, 1e-12);
  in.compute_cpu_share = 0;
  EXPECT_NEAR(PsAsyncTime(in, kNone), 0.02, 1e-12);
  // q8 (r = 4, kappa = 2 ns/B): X = 0.001 + 0.00002; S = 4 ((0.004 + 0.001 + 0.008) 0.5 + X) =
  // 0.03008 above a worker's (0.01 + 0.016) 0.5 + X + S / 4 = 0.02154.
  in.compute_cpu_share = 0.5;
  EXPECT_NEAR(PsAsyncCpuBoundTime(in, {"q8", 4, 2e-9}), 0.03008 / 0.5, 1e-12);
  // Whole-model messages at 3 ns per byte and a 0.1 s compute: X = 0.01202, S = 0.05808, a
  // worker 0.05 + X + S / 4 = 0.07654, which bounds.
  in.big_message_cpu_s_per_byte = 3e-9;
  in.compute_s = 0.1;
  EXPECT_NEAR(PsAsyncCpuBoundTime(in, kNone), 0.07654 / 0.5, 1e-12);
}

TEST(TimingModel, ChunkOverheadAddsPerChunkBeyondTheMeasuredCount) {
  TimingInputs in = Lab();  // a ring block of 1e6 B
  in.overhead_chunks_per_block = 1;
  in.sync_overhead_per_chunk_s = 50e-6;
  in.pipe_overhead_per_chunk_s = 20e-6;
  // 250 kB chunks: m = 4, three chunks per block beyond the one the sigmas were measured at.
  EXPECT_NEAR(ChunkOverhead(in, 1, 2.5e5), 150e-6, 1e-15);
  EXPECT_NEAR(ChunkOverhead(in, 2, 2.5e5), 60e-6, 1e-15);
  EXPECT_EQ(ChunkOverhead(in, 1, 1e6), 0.0);
  // C + U + T_AR (0.0501 at 250 kB chunks) + the three chunks; width 2: max(a, b) + its own.
  EXPECT_NEAR(RingSyncTime(in, kNone, 2.5e5), 0.01 + 0.001 + 0.0501 + 150e-6, 1e-12);
  EXPECT_NEAR(PipeTime(in, kNone, 2.5e5, 2), 0.0501 + 60e-6, 1e-12);
  EXPECT_NEAR(RingSyncTime(in, kNone, 1e6), 0.0656, 1e-12);
  in.overhead_chunks_per_block = 0;  // not measured: nothing
  EXPECT_EQ(ChunkOverhead(in, 1, 2.5e5), 0.0);
  // The fit: the slope between two chunk counts, either order, never below 0.
  EXPECT_NEAR(FitChunkOverhead(1, 0.2e-3, 4, 0.5e-3), 0.1e-3, 1e-15);
  EXPECT_NEAR(FitChunkOverhead(4, 0.5e-3, 1, 0.2e-3), 0.1e-3, 1e-15);
  EXPECT_EQ(FitChunkOverhead(1, 0.5e-3, 4, 0.2e-3), 0.0);
  EXPECT_EQ(FitChunkOverhead(2, 0.5e-3, 2, 0.2e-3), 0.0);
}

TEST(TimingModel, PsOverLoopbackByHand) {
  // Ranks on one host: the server's bytes cost its CPU (X per push, at the share it gets), not
  // the ring's B, here a slow 125 MB/s that would put the server link at 0.256 s.
  TimingInputs in = Lab();
  in.loopback = true;
  in.compute_cpu_share = 0.5;
  in.cpu_share = 0.4;
  in.transport_cpu_s_per_byte = 1e-9;
  in.transport_cpu_s_per_message = 1e-5;
  in.big_message_cpu_s_per_byte = 0.5e-9;
  // X = 4e6 x 0.5e-9 + 2e-5 = 0.00202; W X / max(0.4, 0.5) = 0.01616 in place of 2 W M / B:
  // C + 2 alpha + 0.01616 + W M rho + U = 0.01 + 0.0002 + 0.01616 + 0.016 + 0.001.
  EXPECT_NEAR(PsSyncTime(in, kNone), 0.04336, 1e-12);
  // q8 (r = 4, kappa = 2 ns/B): X = 1e6 x 0.5e-9 + 2e-5 = 0.00052, 4 X / 0.5 = 0.00416; the
  // codec adds 2 M kappa + W M kappa = 0.016 + 0.032.
  EXPECT_NEAR(PsSyncTime(in, {"q8", 4, 2e-9}),
              0.01 + 0.0002 + 0.00416 + 0.016 + 0.001 + 0.048, 1e-12);
  // Async: a worker's cycle 0.01 + 0.0002 + X / 0.5 + 0.004 + 0.001 = 0.01924, the server's CPU
  // 4 (0.004 + 0.001) = 0.02, no link term (0.128 with B); the CPU bound: S = 4 ((0.004 +
  // 0.001) 0.5 + X) = 0.01808, a worker 0.005 + X + S / 4 = 0.01154; S / 0.5 = 0.03616 bounds.
  EXPECT_NEAR(PsAsyncCpuBoundTime(in, kNone), 0.03616, 1e-12);
  EXPECT_NEAR(PsAsyncTime(in, kNone), 0.03616, 1e-12);
  // Without the shares the CPU is not known: the link terms hold, as for a probe with links.
  in.compute_cpu_share = 0;
  EXPECT_NEAR(PsSyncTime(in, kNone), 0.2832, 1e-12);
  EXPECT_NEAR(PsAsyncTime(in, kNone), 0.128, 1e-12);
  in.compute_cpu_share = 0.5;
  in.loopback = false;
  EXPECT_NEAR(PsSyncTime(in, kNone), 0.2832, 1e-12);
}

TEST(TimingModel, PsFromTheProbesStepsByHand) {
  // The probe's 4 ranks: rank 0 served 3 workers, whose steps took 2.7 ms (sync) and 2.2 ms
  // (async) beyond C = 10 ms, and kept 1.9 and 1.6 CPUs busy. The job has W = 4 workers and a
  // server.
  TimingInputs in = Lab();
  in.ps_probe_workers = 3;
  in.ps_sync_beyond_compute_s = 2.7e-3;
  in.ps_async_beyond_compute_s = 2.2e-3;
  in.ps_sync_busy_cpus = 1.9;
  in.ps_async_busy_cpus = 1.6;
  // Nodes of their own: the server takes 4 pushes where it took 3.
  EXPECT_NEAR(PsScale(in, 1.9), 4.0 / 3, 1e-15);
  EXPECT_NEAR(PsSyncTime(in, kNone), 0.01 + 2.7e-3 * 4 / 3, 1e-15);
  EXPECT_NEAR(PsAsyncTime(in, kNone), 0.01 + 2.2e-3 * 4 / 3, 1e-15);
  // The formulas' CPU bound is not added to a measured step.
  in.compute_cpu_share = 0.5;
  in.cpu_share = 0.4;
  EXPECT_EQ(PsAsyncCpuBoundTime(in, kNone), 0.0);
  // One host of 2 CPUs (loopback): the job's 5 processes would ask 1.9 x 5/4 = 2.375 CPUs of
  // the 2, x 1.1875; async 1.6 x 5/4 = 2.0, x 1 (no more than the host has).
  in.loopback = true;
  in.host_cpus = 2;
  EXPECT_NEAR(PsScale(in, 1.9), 4.0 / 3 * 1.1875, 1e-15);
  EXPECT_NEAR(PsSyncTime(in, kNone), 0.01 + 2.7e-3 * 4 / 3 * 1.1875, 1e-15);
  EXPECT_NEAR(PsAsyncTime(in, kNone), 0.01 + 2.2e-3 * 4 / 3, 1e-15);
  // 8 CPUs: room for every process either way; only the pushes scale.
  in.host_cpus = 8;
  EXPECT_NEAR(PsScale(in, 1.9), 4.0 / 3, 1e-15);
  // A probe that already had its host busy (a quota read below what it used): relative to it.
  in.host_cpus = 1.5;
  EXPECT_NEAR(PsScale(in, 1.9), 4.0 / 3 * (2.375 / 1.5) / (1.9 / 1.5), 1e-12);
  // Asked for 8 workers (`model --workers 8`) on 2 CPUs: 8/3 pushes, 1.9 x 9/4 = 4.275 CPUs.
  in.host_cpus = 2;
  in.workers = 8;
  EXPECT_NEAR(PsScale(in, 1.9), 8.0 / 3 * 4.275 / 2, 1e-12);
  // Busy CPUs not known (0): the pushes alone.
  EXPECT_NEAR(PsScale(in, 0), 8.0 / 3, 1e-15);
  // Not measured: the formulas (the loopback CPU ones, with the shares).
  in.workers = 4;
  in.ps_probe_workers = 0;
  in.big_message_cpu_s_per_byte = 0.5e-9;
  in.transport_cpu_s_per_message = 1e-5;
  EXPECT_NEAR(PsSyncTime(in, kNone), 0.04336, 1e-12);
}

TEST(TimingModel, FitTransportCpuRecoversPerByteAndPerMessage) {
  TimingInputs in = Lab();
  in.transport_cpu_s_per_byte = 0.4e-9;
  in.transport_cpu_s_per_message = 12e-6;
  const double small = RingAllReduceCpuTime(in, kNone, 4096);
  const double large = RingAllReduceCpuTime(in, kNone, 16e6);
  const TransportCpu fit = FitTransportCpu(in, {4096, small}, {16e6, large});
  EXPECT_NEAR(fit.s_per_byte, 0.4e-9, 1e-18);
  EXPECT_NEAR(fit.s_per_message, 12e-6, 1e-15);
  // At half a core the reduction's CPU is half its wall time (6 x 1e6 x 1 ns x 0.5 = 3 ms): the
  // rest is the transport's, recovered the same.
  TimingInputs shared = in;
  shared.compute_cpu_share = 0.5;
  const TransportCpu half =
      FitTransportCpu(shared, {4096, RingAllReduceCpuTime(shared, kNone, 4096)},
                      {16e6, RingAllReduceCpuTime(shared, kNone, 16e6)});
  EXPECT_NEAR(half.s_per_byte, 0.4e-9, 1e-18);
  EXPECT_NEAR(half.s_per_message, 12e-6, 1e-15);
  // 4 ms of CPU at either size: 1 ms per 6e6 bytes sent (none had the 6 ms been taken whole).
  EXPECT_NEAR(FitTransportCpu(shared, {4096, 0.004}, {16e6, 0.004}).s_per_byte, 1e-3 / 6e6, 1e-18);
  // Noise that makes many chunks cheaper than few: no negative per-message cost; the per-byte
  // cost is the mean of the two over the bytes sent (6 x 1e6) after the reduction (6 ms).
  const TransportCpu noisy = FitTransportCpu(in, {4096, 0.007}, {16e6, 0.009});
  EXPECT_EQ(noisy.s_per_message, 0.0);
  EXPECT_NEAR(noisy.s_per_byte, (0.001 + 0.003) / 2 / 6e6, 1e-18);
  // Less than the reduction alone: nothing left for the transport.
  const TransportCpu none = FitTransportCpu(in, {4096, 0.001}, {16e6, 0.001});
  EXPECT_EQ(none.s_per_byte, 0.0);
  EXPECT_EQ(none.s_per_message, 0.0);
  in.workers = 1;
  EXPECT_EQ(FitTransportCpu(in, {4096, 1}, {16e6, 1}).s_per_byte, 0.0);
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

// One worker: no link was measured (the probe of one rank has B = 0), none is needed; the
// rows are C + U alone, no codec (nothing is sent), no PS (it needs 2 ranks) and no chunk.
TEST(TimingModel, OneWorkerNeedsNoLink) {
  TimingInputs in = Lab();
  in.workers = 1;
  in.bandwidth_Bps = 0;
  in.latency_s = 0;
  in.sync_overhead_s = 1e-3;  // measured on more ranks: one worker waits for no AllReduce
  EXPECT_EQ(RingAllReduceTime(in, kNone, 1e6), 0);
  const ModelReport report = PredictAll(in, {kNone, {"q8", 4, 2e-9}}, std::vector<double>{1e6});
  ASSERT_EQ(report.rows.size(), 2u);
  EXPECT_EQ(report.rows[0].scheme, "ring_sync");
  EXPECT_EQ(report.rows[1].scheme, "pipe_k2");
  for (const SchemePrediction& row : report.rows) {
    EXPECT_EQ(row.codec, "none");
    EXPECT_NEAR(row.iteration_s, 0.011, 1e-15) << row.scheme;
    EXPECT_EQ(row.comm_s, 0) << row.scheme;
    EXPECT_EQ(row.chunk_bytes, 0) << row.scheme;
  }
  EXPECT_EQ(report.best.scheme, "ring_sync");  // ties with width 2, which adds staleness
  EXPECT_EQ(report.best_width, 1);
}

// The outer loop: a round of H steps is one ring step whose compute is H C + (H - 1) U and whose
// update is U_K (here U = 1 ms), with T_AR = 54.6 ms at 1 MB chunks (RingAllReduceByHand).
TEST(TimingModel, OuterLoopByHand) {
  TimingInputs in = Lab();
  // H = 1 blocking is width 1 itself.
  EXPECT_EQ(OuterStepTime(in, kNone, 1e6, 1, false), RingSyncTime(in, kNone, 1e6));
  // H = 16 blocking: (160 + 15 + 1 + 54.6) / 16 ms; overlapped: max(176, 54.6) / 16 = C + U.
  EXPECT_NEAR(OuterStepTime(in, kNone, 1e6, 16, false), 0.2306 / 16, 1e-12);
  EXPECT_NEAR(OuterStepTime(in, kNone, 1e6, 16, true), 0.011, 1e-12);
  // H = 4 overlapped: the round's 44 ms of compute hide behind the 54.6 ms AllReduce.
  EXPECT_NEAR(OuterStepTime(in, kNone, 1e6, 4, true), 0.0546 / 4, 1e-12);
  // A step's sigma is paid once per round, not once per inner step.
  in.sync_overhead_s = 1.6e-3;
  EXPECT_NEAR(OuterStepTime(in, kNone, 1e6, 16, false), (0.2306 + 1.6e-3) / 16, 1e-12);
  in.sync_overhead_s = 0;
  // The compensation's update U_K stands for the outer step's passes.
  in.pipelined_update_s = 3e-3;
  EXPECT_NEAR(OuterStepTime(in, kNone, 1e6, 16, false), 0.2326 / 16, 1e-12);

  const std::vector<SchemePrediction> rows =
      PredictOuter(Lab(), {kNone, {"q8", 4, 2e-9}}, std::vector<double>{1e6}, {1, 4});
  ASSERT_EQ(rows.size(), 6u);  // H = 1 blocking, H = 4 blocking and overlapped; 2 codecs each
  EXPECT_EQ(rows[0].scheme, "outer_h1");
  EXPECT_EQ(rows[2].scheme, "outer_h4");
  EXPECT_EQ(rows[4].scheme, "outer_h4_ov");
  EXPECT_EQ(rows[5].codec, "q8");
  // q8's AllReduce is 36.66 ms (RingAllReduceByHand): behind H = 4's 44 ms of compute.
  EXPECT_NEAR(rows[5].iteration_s, 0.011, 1e-12);
  EXPECT_NEAR(rows[5].comm_s, 0.03666 / 4, 1e-12);
  EXPECT_NEAR(rows[5].compute_s, 0.011, 1e-12);
  TimingInputs one = Lab();
  one.workers = 1;
  EXPECT_TRUE(PredictOuter(one, {kNone}, std::vector<double>{1e6}, {16}).empty());
}

}  // namespace
}  // namespace pipesgd::train
