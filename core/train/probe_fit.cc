#include "core/train/probe_fit.h"

#include <algorithm>
#include <cstddef>
#include <string>

#include "core/base/error.h"
#include "core/base/measure.h"

namespace pipesgd::train {
namespace {

using probe::RankProbe;

double MaxOf(const std::vector<RankProbe>& ranks, double (RankProbe::*field)() const) {
  double v = 0;
  for (const auto& r : ranks) v = std::max(v, (r.*field)());
  return v;
}

double MedianOf(const std::vector<RankProbe>& ranks, double (RankProbe::*field)() const) {
  std::vector<double> v;
  for (const auto& r : ranks) v.push_back((r.*field)());
  return Median(v);
}

// A rank's chunk sizes of a list of timed AllReduces, against the first rank's, or a clear error
// naming both ranks and the list.
void CheckTimedAlike(const RankProbe& r, const RankProbe& first,
                     const google::protobuf::RepeatedPtrField<probe::TimedAllReduce>& mine,
                     const google::protobuf::RepeatedPtrField<probe::TimedAllReduce>& theirs,
                     const std::string& what) {
  if (mine.size() != theirs.size()) {
    Throw(ErrorCode::kInvalidArgument, "probe: rank {} timed {} {}, rank {} {}", r.rank(),
          mine.size(), what, first.rank(), theirs.size());
  }
  for (int i = 0; i < mine.size(); ++i) {
    if (mine[i].chunk_bytes() != theirs[i].chunk_bytes()) {
      Throw(ErrorCode::kInvalidArgument, "probe: rank {} timed its {} {} at {} B, rank {} at {} B",
            r.rank(), what, i, mine[i].chunk_bytes(), first.rank(), theirs[i].chunk_bytes());
    }
  }
}

// The same AllReduces, chunk sizes and codecs on every rank (each codec also timed alone), or a
// clear error naming the rank: what a rank sends is read by position only after this.
void CheckAlike(const std::vector<RankProbe>& ranks) {
  const RankProbe& first = ranks.front();
  for (const auto& r : ranks) {
    if (r.allreduce_size() != first.allreduce_size() || r.codec_size() != first.codec_size()) {
      Throw(ErrorCode::kInvalidArgument,
            "probe: rank {} timed {} AllReduces and {} codecs, rank {} {} and {}", r.rank(),
            r.allreduce_size(), r.codec_size(), first.rank(), first.allreduce_size(),
            first.codec_size());
    }
    if (r.codec_size() > 0 && r.codec_alone_size() != r.codec_size()) {
      Throw(ErrorCode::kInvalidArgument,
            "probe: rank {} timed {} codecs in the ring and {} alone: expected the same ones",
            r.rank(), r.codec_size(), r.codec_alone_size());
    }
    CheckTimedAlike(r, first, r.allreduce(), first.allreduce(), "AllReduce");
    for (int c = 0; c < r.codec_size(); ++c) {
      const std::string& name = first.codec(c).codec();
      if (r.codec(c).codec() != name || r.codec_alone(c).codec() != name) {
        Throw(ErrorCode::kInvalidArgument, "probe: rank {}'s codec {} is {} (alone: {}), rank {}'s {}",
              r.rank(), c, r.codec(c).codec(), r.codec_alone(c).codec(), first.rank(), name);
      }
      CheckTimedAlike(r, first, r.codec(c).timed(), first.codec(c).timed(), name + " AllReduce");
    }
  }
}

// The timed AllReduce `i` of `timed_of(rank)` over ranks: the slowest wall time, the median CPU.
template <typename TimedOf>
AllReduceOverRanks OverRanks(const std::vector<RankProbe>& ranks, TimedOf timed_of) {
  AllReduceOverRanks out;
  std::vector<double> cpu;
  for (const auto& r : ranks) {
    const probe::TimedAllReduce& t = timed_of(r);
    out.chunk_bytes = static_cast<double>(t.chunk_bytes());
    out.seconds = std::max(out.seconds, t.seconds());
    cpu.push_back(t.cpu_s());
  }
  out.cpu_s = Median(cpu);
  return out;
}

const AllReduceOverRanks& AtChunk(const std::vector<AllReduceOverRanks>& timed, double chunk) {
  for (const auto& t : timed) {
    if (t.chunk_bytes == chunk) return t;
  }
  Throw(ErrorCode::kInvalidArgument, "probe: no AllReduce timed at {} B chunks", chunk);
}

// The slowest link and rank, the medians of the per-byte rates, the CPU shares of the rank
// that computes slowest (they go with its C).
void Aggregate(const std::vector<RankProbe>& ranks, ProbeFit& f) {
  TimingInputs& in = f.inputs;
  in.workers = f.world_size;
  in.model_bytes = f.model_bytes;
  in.latency_s = MaxOf(ranks, &RankProbe::latency_s);
  f.link_alone_Bps = ranks.front().bandwidth_bps();
  f.ring_exchange_Bps = ranks.front().ring_bandwidth_bps();
  size_t slowest = 0;
  f.loopback = f.world_size > 1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const RankProbe& r = ranks[i];
    f.link_alone_Bps = std::min(f.link_alone_Bps, r.bandwidth_bps());
    f.ring_exchange_Bps = std::min(f.ring_exchange_Bps, r.ring_bandwidth_bps());
    if (r.compute_s() > ranks[slowest].compute_s()) slowest = i;
    f.compute_by_rank.push_back(r.compute_s());
    f.loopback = f.loopback && r.loopback();
    f.ps_sync_cpus += r.ps_sync_cpu_share();
    f.ps_async_cpus += r.ps_async_cpu_share();
  }
  // Per-byte CPU rates are properties of the machines, alike on every node: the median over
  // ranks, so one rank preempted while it measured (a shared host) does not set them.
  f.stream_chunk_overhead_s = MedianOf(ranks, &RankProbe::chunk_overhead_s);
  in.chunk_overhead_s = f.stream_chunk_overhead_s;
  in.reduce_s_per_byte = MedianOf(ranks, &RankProbe::reduce_s_per_byte);
  f.big_message_cpu_s_per_byte = MedianOf(ranks, &RankProbe::exchange_cpu_s_per_byte);
  f.compute_s = MaxOf(ranks, &RankProbe::compute_s);
  f.update_s = MaxOf(ranks, &RankProbe::update_s);
  f.pipelined_update_s = MaxOf(ranks, &RankProbe::pipelined_update_s);
  f.compute_cpu_share = f.world_size > 1 ? ranks[slowest].compute_cpu_share() : 0.0;
  f.cpu_share = f.world_size > 1 ? ranks[slowest].overlap_cpu_share() : 0.0;
  f.overlap_compute_s = MaxOf(ranks, &RankProbe::overlap_compute_s);
  f.overlap_allreduce_s = MaxOf(ranks, &RankProbe::overlap_allreduce_s);
  f.ps_sync_step_s = MaxOf(ranks, &RankProbe::ps_sync_step_s);
  f.ps_async_step_s = MaxOf(ranks, &RankProbe::ps_async_step_s);
  f.host_cpus = ranks.front().host_cpus();
  for (int i = 0; i < ranks.front().allreduce_size(); ++i) {
    f.allreduce.push_back(OverRanks(ranks, [i](const RankProbe& r) -> const auto& {
      return r.allreduce(i);
    }));
  }
  for (const auto& alone : ranks.front().codec_alone()) {
    f.codecs.push_back({alone.codec(), alone.ratio(), alone.encode_decode_s_per_byte(), {}, {}});
  }
}

// B and o fitted so that the model's AllReduce of this model is the one measured, with few
// chunks (B) and with many (o). One link alone, or a stream of messages on it, read B ~2x too
// high and o ~7x too low on loopback, and `pipesgd model` then advised 4 KiB chunks that ran
// 3.3x slower than the default. One rank has no link at all.
void FitLinks(ProbeFit& f) {
  TimingInputs& in = f.inputs;
  in.bandwidth_Bps = f.world_size > 1 ? f.ring_exchange_Bps : f.link_alone_Bps;
  if (f.world_size == 1) return;
  if (f.allreduce.size() != 3) {
    Throw(ErrorCode::kInvalidArgument, "probe: {} AllReduce chunk sizes timed, expected 3",
          f.allreduce.size());
  }
  f.ring = FitRing(in, {f.allreduce[0].chunk_bytes, f.allreduce[0].seconds},
                   {f.allreduce[1].chunk_bytes, f.allreduce[1].seconds},
                   {f.allreduce[2].chunk_bytes, f.allreduce[2].seconds});
  in.bandwidth_Bps = f.ring.bandwidth_Bps;
  in.chunk_overhead_s = f.ring.chunk_overhead_s;
  in.contention = f.ring.contention;
  for (auto& t : f.allreduce) t.modelled_s = RingAllReduceTime(in, CodecCost{}, t.chunk_bytes);
}

// The transport's CPU per byte sent and per message, from the AllReduce's CPU time with many
// chunks and with few; then each codec's cost in the ring from its AllReduces.
void FitCpuAndCodecs(const std::vector<RankProbe>& ranks, ProbeFit& f) {
  TimingInputs& in = f.inputs;
  in.compute_cpu_share = f.compute_cpu_share;  // the reduction's CPU is s_c of its wall time
  f.transport_cpu = FitTransportCpu(in, {f.allreduce.front().chunk_bytes, f.allreduce.front().cpu_s},
                                    {f.allreduce.back().chunk_bytes, f.allreduce.back().cpu_s});
  in.transport_cpu_s_per_byte = f.transport_cpu.s_per_byte;
  in.transport_cpu_s_per_message = f.transport_cpu.s_per_message;
  for (int c = 0; c < ranks.front().codec_size(); ++c) {
    CodecOverRanks& codec = f.codecs.at(static_cast<size_t>(c));
    if (codec.name != ranks.front().codec(c).codec()) {
      Throw(ErrorCode::kInvalidArgument, "probe: codec {} timed in the ring, {} alone",
            ranks.front().codec(c).codec(), codec.name);
    }
    std::vector<TimedCodec> timed;
    for (int i = 0; i < ranks.front().codec(c).timed_size(); ++i) {
      codec.timed.push_back(OverRanks(ranks, [c, i](const RankProbe& r) -> const auto& {
        return r.codec(c).timed(i);
      }));
      timed.push_back({codec.timed.back().chunk_bytes, codec.timed.back().seconds,
                       codec.timed.back().cpu_s});
    }
    codec.fit = FitCodec(in, codec.name, codec.ratio, timed);
    for (auto& t : codec.timed) t.modelled_s = RingAllReduceTime(in, codec.fit, t.chunk_bytes);
  }
}

// sigma and sigma_2: the slowest rank's width-1 and width-2 steps beyond C + U + the AllReduce
// as timed (or the CPU bound), and beyond the overlap formula.
void FitSync(ProbeFit::Steps& s, const TimingInputs& in, const CodecCost& codec) {
  s.sync_overhead_s = FitSyncOverhead(in, codec, s.chunk_bytes, s.allreduce_s, s.sync_step_s);
}
void FitPipe(ProbeFit::Steps& s, const TimingInputs& in, const CodecCost& codec) {
  s.pipe_overhead_s = FitPipeOverhead(in, codec, s.chunk_bytes, s.allreduce_s, s.pipe_step_s);
}

void FitSteps(const std::vector<RankProbe>& ranks, ProbeFit& f) {
  TimingInputs& in = f.inputs;
  const RankProbe& first = ranks.front();
  const double step_chunk = static_cast<double>(first.step_chunk_bytes());
  const double other_chunk = static_cast<double>(first.other_chunk_bytes());
  f.plain = {step_chunk, ChunksPerBlock(in, step_chunk), 0, MaxOf(ranks, &RankProbe::sync_step_s),
             MaxOf(ranks, &RankProbe::pipe_step_s)};
  f.fast_steps = {step_chunk, f.plain.chunks_per_block, 0,
                  MaxOf(ranks, &RankProbe::fast_sync_step_s),
                  MaxOf(ranks, &RankProbe::fast_pipe_step_s)};
  f.fast_other = {other_chunk, ChunksPerBlock(in, other_chunk), 0,
                  MaxOf(ranks, &RankProbe::fast_other_sync_step_s),
                  MaxOf(ranks, &RankProbe::fast_other_pipe_step_s)};
  if (f.world_size == 1) return;
  f.fast = first.fast_codec();
  if (f.fast < 0 || f.fast >= static_cast<int>(f.codecs.size())) {
    Throw(ErrorCode::kInvalidArgument, "probe: fast codec {}: expected an index below {}", f.fast,
          f.codecs.size());
  }
  const CodecOverRanks& fast = f.codecs[static_cast<size_t>(f.fast)];
  in.compute_s = f.compute_s;
  in.update_s = f.update_s;
  in.cpu_share = f.cpu_share;
  f.plain.allreduce_s = AtChunk(f.allreduce, step_chunk).seconds;
  f.fast_steps.allreduce_s = AtChunk(fast.timed, step_chunk).seconds;
  f.fast_other.allreduce_s = AtChunk(fast.timed, other_chunk).seconds;
  FitSync(f.plain, in, CodecCost{});
  FitSync(f.fast_steps, in, fast.fit);
  FitSync(f.fast_other, in, fast.fit);
  f.sync_per_chunk_s = FitChunkOverhead(f.fast_steps.chunks_per_block, f.fast_steps.sync_overhead_s,
                                        f.fast_other.chunks_per_block, f.fast_other.sync_overhead_s);
  // How much each thread slows the other where they run at once (1: not at all).
  const double large_s = f.allreduce.back().seconds;
  f.overlap_chunk_bytes = f.allreduce.back().chunk_bytes;
  f.compute_factor = f.compute_s > 0 ? std::max(1.0, f.overlap_compute_s / f.compute_s) : 1.0;
  f.allreduce_factor = large_s > 0 ? std::max(1.0, f.overlap_allreduce_s / large_s) : 1.0;
  in.pipelined_update_s = f.pipelined_update_s;
  in.overlap_compute_factor = f.compute_factor;
  in.overlap_allreduce_factor = f.allreduce_factor;
  FitPipe(f.plain, in, CodecCost{});
  FitPipe(f.fast_steps, in, fast.fit);
  FitPipe(f.fast_other, in, fast.fit);
  f.pipe_per_chunk_s = FitChunkOverhead(f.fast_steps.chunks_per_block, f.fast_steps.pipe_overhead_s,
                                        f.fast_other.chunks_per_block, f.fast_other.pipe_overhead_s);
}

}  // namespace

ProbeFit FitProbe(const std::vector<probe::RankProbe>& ranks, double model_bytes) {
  if (ranks.empty()) Throw(ErrorCode::kInvalidArgument, "probe: no rank's measurements");
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i].rank() != static_cast<int>(i)) {
      Throw(ErrorCode::kInvalidArgument, "probe: measurements {} are rank {}'s, expected rank {}'s",
            i, ranks[i].rank(), i);
    }
  }
  CheckAlike(ranks);
  ProbeFit f;
  f.world_size = static_cast<int>(ranks.size());
  f.model_bytes = model_bytes;
  Aggregate(ranks, f);
  FitLinks(f);
  if (f.world_size > 1) FitCpuAndCodecs(ranks, f);
  FitSteps(ranks, f);
  return f;
}

}  // namespace pipesgd::train
