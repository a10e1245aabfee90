// core/train/probe_fit.h: every rank's probe measurements in, the model's inputs out. The ranks'
// AllReduces here are made by the timing model itself, so the fit must give its terms back.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/train/probe_fit.h"

namespace pipesgd::train {
namespace {

constexpr double kModelBytes = 4e6;
constexpr uint64_t kChunks[] = {4096, 65536, 16u << 20};
const char* const kCodecs[] = {"q8", "sign1"};

TimingInputs Truth() {
  TimingInputs in;
  in.workers = 3;
  in.model_bytes = kModelBytes;
  in.latency_s = 1e-4;
  in.bandwidth_Bps = 1.25e8;
  in.reduce_s_per_byte = 1e-9;
  in.chunk_overhead_s = 3e-5;
  in.contention = 0.4;
  return in;
}

void Timed(probe::TimedAllReduce* t, uint64_t chunk, double seconds, double cpu_s) {
  t->set_chunk_bytes(chunk);
  t->set_seconds(seconds);
  t->set_cpu_s(cpu_s);
}

// Rank r of three: its own latency, bandwidths, compute and CPU numbers; the AllReduces the
// truth gives, rank 1's `slower` times longer.
probe::RankProbe Rank(int r, double slower = 1.0) {
  const TimingInputs truth = Truth();
  probe::RankProbe p;
  p.set_rank(r);
  p.set_compute_s(0.010 + 0.001 * r);  // rank 2 computes slowest
  p.set_compute_cpu_share(0.5 + 0.1 * r);
  p.set_overlap_cpu_share(0.9 - 0.1 * r);
  p.set_update_s(0.001 * (3 - r));
  p.set_pipelined_update_s(0.002);
  p.set_reduce_s_per_byte(r == 0 ? 0.5e-9 : r == 1 ? 1e-9 : 3e-9);  // median: the truth's
  p.set_latency_s(r == 0 ? 1e-4 : 0.5e-4 * r);  // the slowest: the truth's
  p.set_bandwidth_bps(1e8 * (3 - r));
  p.set_chunk_overhead_s(1e-5 * (1 + r));
  p.set_ring_bandwidth_bps(9e7 + 1e6 * r);
  p.set_exchange_cpu_s_per_byte(1e-10 * (1 + r));
  p.set_loopback(r != 1);
  p.set_host_cpus(2 + r);
  for (const uint64_t chunk : kChunks) {
    const double s = RingAllReduceTime(truth, CodecCost{}, static_cast<double>(chunk));
    Timed(p.add_allreduce(), chunk, r == 1 ? s * slower : s, 1e-3 * (1 + r));
  }
  for (const char* name : kCodecs) {
    auto* codec = p.add_codec();
    codec->set_codec(name);
    Timed(codec->add_timed(), 65536, 0.02 + 0.001 * r, 0.010);
    Timed(codec->add_timed(), 16u << 20, 0.015 + 0.001 * r, 0.008);
    auto* alone = p.add_codec_alone();
    alone->set_codec(name);
    alone->set_ratio(r == 0 ? 4.0 : 99.0);  // rank 0's counts
    alone->set_encode_decode_s_per_byte(1e-9);
  }
  p.set_overlap_compute_s(0.012);
  p.set_overlap_allreduce_s(0.05);
  p.set_step_chunk_bytes(16u << 20);
  p.set_other_chunk_bytes(65536);
  p.set_sync_step_s(0.05 + 0.001 * r);
  p.set_pipe_step_s(0.04 + 0.001 * r);
  p.set_fast_codec(1);
  p.set_fast_sync_step_s(0.03);
  p.set_fast_pipe_step_s(0.02);
  p.set_fast_other_sync_step_s(0.035);
  p.set_fast_other_pipe_step_s(0.025);
  p.set_ps_sync_step_s(r == 0 ? 0 : 0.1 * r);
  p.set_ps_async_step_s(r == 0 ? 0 : 0.05 * r);
  p.set_ps_sync_cpu_share(0.25);
  p.set_ps_async_cpu_share(0.5);
  return p;
}

TEST(ProbeFit, GivesBackTheTermsThatMadeTheAllReduces) {
  const ProbeFit f = FitProbe({Rank(0), Rank(1), Rank(2)}, kModelBytes);
  EXPECT_EQ(f.world_size, 3);
  EXPECT_NEAR(f.inputs.bandwidth_Bps / 1.25e8, 1.0, 1e-6);
  EXPECT_NEAR(f.inputs.chunk_overhead_s, 3e-5, 1e-9);
  EXPECT_NEAR(f.ring.contention, 0.4, 1e-6);
  EXPECT_TRUE(f.ring.bandwidth_fitted);
  for (const auto& t : f.allreduce) EXPECT_NEAR(t.modelled_s / t.seconds, 1.0, 1e-6);
  // The slowest link and rank; medians of what is a property of the machines.
  EXPECT_EQ(f.inputs.latency_s, 1e-4);
  EXPECT_EQ(f.link_alone_Bps, 1e8);
  EXPECT_EQ(f.ring_exchange_Bps, 9e7);
  EXPECT_EQ(f.stream_chunk_overhead_s, 2e-5);
  EXPECT_EQ(f.inputs.reduce_s_per_byte, 1e-9);
  EXPECT_EQ(f.compute_s, 0.012);
  EXPECT_EQ(f.update_s, 0.003);
  EXPECT_EQ(f.compute_cpu_share, 0.7);  // rank 2's: it computes slowest
  EXPECT_EQ(f.cpu_share, 0.7);
  EXPECT_EQ(f.big_message_cpu_s_per_byte, 2e-10);
  EXPECT_FALSE(f.loopback);  // rank 1's connections are not on loopback
  EXPECT_EQ(f.host_cpus, 2);
  EXPECT_EQ(f.ps_sync_step_s, 0.2);
  EXPECT_EQ(f.ps_sync_cpus, 0.75);
  EXPECT_EQ(f.ps_async_cpus, 1.5);
  // Each AllReduce over ranks: the slowest wall time, the median CPU time.
  EXPECT_EQ(f.allreduce[0].cpu_s, 2e-3);
  ASSERT_EQ(f.codecs.size(), 2u);
  EXPECT_EQ(f.codecs[0].ratio, 4.0);
  EXPECT_EQ(f.codecs[1].timed[1].seconds, Rank(2).codec(1).timed(1).seconds());
  EXPECT_EQ(f.codecs[1].timed[1].cpu_s, 0.008);
  // The steps: sigma beyond the AllReduce as timed at the steps' chunk size, with sign1 (the
  // fast codec every rank agreed on).
  EXPECT_EQ(f.plain.allreduce_s, f.allreduce[2].seconds);
  EXPECT_EQ(f.fast_steps.allreduce_s, Rank(2).codec(1).timed(1).seconds());
  EXPECT_EQ(f.fast_other.allreduce_s, Rank(2).codec(1).timed(0).seconds());
  EXPECT_EQ(f.plain.sync_step_s, Rank(2).sync_step_s());
  EXPECT_EQ(f.compute_factor, 1.0);  // 12 ms at once: no slower than alone
  EXPECT_NEAR(f.allreduce_factor, 0.05 / f.allreduce[2].seconds, 1e-12);
}

TEST(ProbeFit, TheSlowestRanksAllReduceCounts) {
  const ProbeFit f = FitProbe({Rank(0), Rank(1, 1.5), Rank(2)}, kModelBytes);
  for (size_t i = 0; i < f.allreduce.size(); ++i) {
    EXPECT_EQ(f.allreduce[i].seconds, Rank(1, 1.5).allreduce(static_cast<int>(i)).seconds());
  }
}

TEST(ProbeFit, OneRankHasNoRingTerms) {
  probe::RankProbe only = Rank(0);
  only.clear_allreduce();
  only.clear_codec();
  const ProbeFit f = FitProbe({only}, kModelBytes);
  EXPECT_EQ(f.world_size, 1);
  EXPECT_EQ(f.inputs.bandwidth_Bps, 3e8);  // the link alone
  EXPECT_EQ(f.inputs.chunk_overhead_s, 1e-5);
  EXPECT_EQ(f.compute_cpu_share, 0.0);
  EXPECT_FALSE(f.loopback);
  EXPECT_EQ(f.fast, -1);
  ASSERT_EQ(f.codecs.size(), 2u);
  EXPECT_EQ(f.codecs[1].encode_decode_s_per_byte, 1e-9);
}

std::string ErrorOf(const std::vector<probe::RankProbe>& ranks) {
  try {
    (void)FitProbe(ranks, kModelBytes);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    return e.what();
  }
  return "no error";
}

TEST(ProbeFit, MeasurementsThatDoNotFitAreNamed) {
  EXPECT_NE(ErrorOf({}).find("no rank's measurements"), std::string::npos);
  EXPECT_NE(ErrorOf({Rank(0), Rank(2), Rank(1)}).find("measurements 1 are rank 2's, expected rank 1's"),
            std::string::npos);
  probe::RankProbe odd = Rank(1);
  odd.mutable_allreduce(1)->set_chunk_bytes(8192);
  EXPECT_NE(ErrorOf({Rank(0), odd, Rank(2)})
                .find("rank 1 timed its AllReduce 1 at 8192 B, rank 0 at 65536 B"),
            std::string::npos);
  probe::RankProbe fewer = Rank(2);
  fewer.mutable_codec()->RemoveLast();
  EXPECT_NE(ErrorOf({Rank(0), Rank(1), fewer}).find("rank 2 timed 3 AllReduces and 1 codecs"),
            std::string::npos);
  // What is read by position is checked first: a corrupt or foreign rank's list is refused by
  // name, never read past its end.
  probe::RankProbe short_codec = Rank(1);
  short_codec.mutable_codec(1)->mutable_timed()->RemoveLast();
  EXPECT_NE(ErrorOf({Rank(0), short_codec, Rank(2)})
                .find("rank 1 timed 1 sign1 AllReduce, rank 0 2"),
            std::string::npos)
      << ErrorOf({Rank(0), short_codec, Rank(2)});
  probe::RankProbe other_chunk = Rank(2);
  other_chunk.mutable_codec(0)->mutable_timed(1)->set_chunk_bytes(4096);
  EXPECT_NE(ErrorOf({Rank(0), Rank(1), other_chunk})
                .find("rank 2 timed its q8 AllReduce 1 at 4096 B, rank 0 at 16777216 B"),
            std::string::npos);
  probe::RankProbe renamed = Rank(1);
  renamed.mutable_codec(0)->set_codec("q4");
  EXPECT_NE(ErrorOf({Rank(0), renamed, Rank(2)}).find("rank 1's codec 0 is q4 (alone: q8), rank 0's q8"),
            std::string::npos);
  probe::RankProbe no_alone = Rank(0);
  no_alone.mutable_codec_alone()->RemoveLast();
  EXPECT_NE(ErrorOf({no_alone, Rank(1), Rank(2)})
                .find("rank 0 timed 2 codecs in the ring and 1 alone"),
            std::string::npos);
  probe::RankProbe bad_fast = Rank(0);
  bad_fast.set_fast_codec(7);
  EXPECT_NE(ErrorOf({bad_fast, Rank(1), Rank(2)}).find("fast codec 7: expected an index below 2"),
            std::string::npos);
}

}  // namespace
}  // namespace pipesgd::train
