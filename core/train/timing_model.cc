#include "core/train/timing_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "core/base/check.h"

namespace pipesgd::train {

RingTerms RingAllReduceTerms(const TimingInputs& in, const CodecCost& codec, double chunk_bytes) {
  PSGD_CHECK_GE(in.workers, 1);
  PSGD_CHECK(codec.ratio >= 1 && chunk_bytes > 0);
  RingTerms t;
  // One rank has no link to measure: its probe has no bandwidth, and needs none.
  if (in.workers == 1 || in.model_bytes <= 0) return t;
  PSGD_CHECK(in.bandwidth_Bps > 0);
  const double w = in.workers;
  const double steps = 2 * (w - 1);
  const double block = in.model_bytes / w;
  t.chunks_per_block = ChunksPerBlock(in, chunk_bytes);
  const double s = block / t.chunks_per_block;
  const double cpu_per_byte = in.reduce_s_per_byte + codec.s_per_byte;
  t.latency_s = steps * in.latency_s;
  t.link_s = steps * block / (codec.ratio * in.bandwidth_Bps);
  t.cpu_s = steps * (block * cpu_per_byte +
                     t.chunks_per_block * (in.chunk_overhead_s + codec.s_per_chunk));
  // The fill is the chunk's work that no transfer hides; where nothing overlaps (gamma 1) P
  // already holds it, and adding it again charged one chunk per block twice (a whole block at
  // 16 MiB chunks, which the fit then took back from B).
  t.tail_s = (1 - in.contention) * steps * s * cpu_per_byte;
  t.total_s = t.latency_s + std::max(t.link_s, t.cpu_s) +
              in.contention * std::min(t.link_s, t.cpu_s) + t.tail_s;
  return t;
}

double RingAllReduceTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes) {
  return RingAllReduceTerms(in, codec, chunk_bytes).total_s;
}

namespace {

// Where the non-decreasing f crosses `target` in [lo, hi]: lo if f(lo) >= target, hi if
// f(hi) <= target, else bisection to an interval of 1e-12.
template <typename F>
double Crossing(F f, double lo, double hi, double target) {
  if (f(lo) >= target) return lo;
  if (f(hi) <= target) return hi;
  for (int i = 0; i < 200 && hi - lo > 1e-12; ++i) {
    const double mid = (lo + hi) / 2;
    (f(mid) < target ? lo : hi) = mid;
  }
  return (lo + hi) / 2;
}

// RingAllReduceTime without a codec as `field` of `in` varies.
auto TimeAsFieldVaries(const TimingInputs& in, double TimingInputs::*field, double chunk_bytes) {
  return [t = in, field, chunk_bytes](double v) mutable {
    t.*field = v;
    return RingAllReduceTime(t, CodecCost{}, chunk_bytes);
  };
}

}  // namespace

double FitChunkOverhead(const TimingInputs& in, double chunk_bytes, double measured_s) {
  return Crossing(TimeAsFieldVaries(in, &TimingInputs::chunk_overhead_s, chunk_bytes), 0, 10e-3,
                  measured_s);
}

double FitBandwidth(const TimingInputs& in, double chunk_bytes, double measured_s) {
  auto at = TimeAsFieldVaries(in, &TimingInputs::bandwidth_Bps, chunk_bytes);
  const double lo = std::log(1e3), hi = std::log(1e12);
  if (at(std::exp(hi)) > measured_s || at(std::exp(lo)) < measured_s) return 0;
  // The time falls as B grows: its negative rises with log B.
  return std::exp(Crossing([&](double log_b) { return -at(std::exp(log_b)); }, lo, hi,
                           -measured_s));
}

double FitContention(const TimingInputs& in, double chunk_bytes, double measured_s) {
  // T is linear in gamma, T(0) + gamma (min(L, P) - fill), and falls as gamma grows where the fill
  // is the larger (a fast link, one chunk per block): solved, not searched for a rising crossing.
  auto at = TimeAsFieldVaries(in, &TimingInputs::contention, chunk_bytes);
  const double t0 = at(0), slope = at(1) - t0;
  if (slope == 0) return 0;
  return std::clamp((measured_s - t0) / slope, 0.0, 1.0);
}

RingFit FitRing(const TimingInputs& in, TimedAllReduce small, TimedAllReduce mid,
                TimedAllReduce large) {
  TimingInputs t = in;
  bool fitted = true;
  // Coordinate-wise: converges linearly; microseconds per round. Once no B places the large
  // AllReduce (the overhead fitted since raised its floor above it), B goes back to the given
  // one and stays: a B from an earlier round fits nothing the final o and gamma give.
  for (int round = 0; round < 2000; ++round) {
    const TimingInputs before = t;
    if (fitted) {
      const double b = FitBandwidth(t, large.chunk_bytes, large.seconds);
      fitted = b > 0;
      t.bandwidth_Bps = fitted ? b : in.bandwidth_Bps;
    }
    t.chunk_overhead_s = FitChunkOverhead(t, small.chunk_bytes, small.seconds);
    t.contention = FitContention(t, mid.chunk_bytes, mid.seconds);
    if (std::abs(t.bandwidth_Bps - before.bandwidth_Bps) <= 1e-13 * t.bandwidth_Bps &&
        std::abs(t.chunk_overhead_s - before.chunk_overhead_s) <= 1e-16 &&
        std::abs(t.contention - before.contention) <= 1e-13) {
      break;
    }
  }
  return {t.bandwidth_Bps, t.chunk_overhead_s, t.contention, fitted};
}

namespace {

// rho and kappa are wall times, taken on every rank at once as C is: at the compute share s_c,
// their CPU is that much of them (as the PS bound has always counted them). Taken as CPU, a rank
// at half a core paid the reduction and the codec twice in the ring's bound, which then ranked
// the codecs below no compression on loopback, where q8 and q4 measured 11-22% faster.
double CpuOfWall(const TimingInputs& in) {
  // s_c counts every thread (a BLAS pool can take it above 1); these loops run on one.
  return in.compute_cpu_share > 0 ? std::min(1.0, in.compute_cpu_share) : 1.0;
}

}  // namespace

double RingAllReduceCpuTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes) {
  const RingTerms t = RingAllReduceTerms(in, codec, chunk_bytes);
  if (in.workers == 1 || in.model_bytes <= 0) return 0;
  const double steps = 2.0 * (in.workers - 1), block = in.model_bytes / in.workers;
  const double codec_cpu = codec.cpu_s_per_byte.value_or(codec.s_per_byte * CpuOfWall(in));
  return steps * (block * (in.reduce_s_per_byte * CpuOfWall(in) + codec_cpu) +
                  block / codec.ratio * in.transport_cpu_s_per_byte +
                  t.chunks_per_block *
                      (in.transport_cpu_s_per_message + codec.cpu_s_per_chunk));
}

double UpdateTime(const TimingInputs& in, int width) {
  // Width >= 2's update does width 1's and more (the prediction, the kept gradient): a U_K
  // measured below U is noise between two timings, and it used to hand one worker, with
  // nothing to overlap, a "faster" width 2.
  return width >= 2 && in.pipelined_update_s > 0 ? std::max(in.update_s, in.pipelined_update_s)
                                                 : in.update_s;
}

namespace {

// max(s, s_c): the CPU a rank gets; 0 where the shares are not known (no CPU bound).
double RankCpu(const TimingInputs& in) {
  return in.compute_cpu_share > 0 ? std::max(in.cpu_share, in.compute_cpu_share) : 0;
}

// X: the transport's CPU for one push, on each end: one gradient in and one model out (or the
// reverse), a message each.
double PsPushCpu(const TimingInputs& in, const CodecCost& codec) {
  const double per_byte = in.big_message_cpu_s_per_byte > 0 ? in.big_message_cpu_s_per_byte
                                                            : in.transport_cpu_s_per_byte;
  return in.model_bytes / codec.ratio * per_byte + 2 * in.transport_cpu_s_per_message;
}

// No link between the ranks, and the CPU they get is known: the PS schemes' bytes cost CPU.
bool PsOverLoopback(const TimingInputs& in) { return in.loopback && RankCpu(in) > 0; }

}  // namespace

double CpuBoundTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes,
                    int width) {
  const double share = RankCpu(in);
  if (share <= 0) return 0;
  return ((in.compute_s + UpdateTime(in, width)) * in.compute_cpu_share +
          RingAllReduceCpuTime(in, codec, chunk_bytes)) /
         share;
}

TransportCpu FitTransportCpu(const TimingInputs& in, TimedCpu small, TimedCpu large) {
  PSGD_CHECK(small.chunk_bytes > 0 && large.chunk_bytes > 0);
  if (in.workers == 1 || in.model_bytes <= 0) return {};
  const double steps = 2.0 * (in.workers - 1), block = in.model_bytes / in.workers;
  const auto messages = [&](double chunk) { return steps * std::ceil(block / chunk); };
  // What the transport took: the measured CPU less the reduction's.
  const double reduce = steps * block * in.reduce_s_per_byte * CpuOfWall(in);
  const double y_small = std::max(0.0, small.cpu_s - reduce);
  const double y_large = std::max(0.0, large.cpu_s - reduce);
  const double n_small = messages(small.chunk_bytes), n_large = messages(large.chunk_bytes);
  const double bytes = steps * block;  // sent in either
  TransportCpu fit;
  if (n_small > n_large) fit.s_per_message = (y_small - y_large) / (n_small - n_large);
  fit.s_per_byte = (y_large - fit.s_per_message * n_large) / bytes;
  if (fit.s_per_message < 0) {
    fit = {(y_small + y_large) / (2 * bytes), 0};
  } else if (fit.s_per_byte < 0) {
    fit = {0, (y_small + y_large) / (n_small + n_large)};
  }
  return fit;
}

CodecCost FitCodec(const TimingInputs& in, const std::string& name, double ratio,
                   const std::vector<TimedCodec>& timed) {
  PSGD_CHECK(ratio >= 1);
  CodecCost fit{name, ratio, 0, 0.0};
  if (in.workers == 1 || in.model_bytes <= 0 || timed.empty()) return fit;
  const double steps = 2.0 * (in.workers - 1), block = in.model_bytes / in.workers;
  const auto chunks = [&](const TimedCodec& t) {
    PSGD_CHECK(t.chunk_bytes > 0);
    return std::ceil(block / t.chunk_bytes);
  };
  // Not a structured binding: clang 14 (the fuzz build) cannot capture one in a lambda.
  const auto few_many = std::minmax_element(
      timed.begin(), timed.end(),
      [&](const TimedCodec& a, const TimedCodec& b) { return chunks(a) < chunks(b); });
  const auto few = few_many.first, many = few_many.second;
  const double m_few = chunks(*few), m_many = chunks(*many);
  const auto with = [&](double kappa, double per_chunk) {
    CodecCost c = fit;
    c.s_per_byte = kappa;
    c.s_per_chunk = per_chunk;
    return c;
  };
  // kappa at which RingAllReduceTime meets `t` with o_c = per_chunk: the time grows with kappa
  // (the CPU term and the fill do; nothing falls). In ns/B, so that Crossing's 1e-12 is far
  // below any kappa.
  const auto kappa_at = [&](const TimedCodec& t, double per_chunk) {
    const double ns = Crossing(
        [&](double k) { return RingAllReduceTime(in, with(k * 1e-9, per_chunk), t.chunk_bytes); },
        -in.reduce_s_per_byte * 1e9, 1000, t.seconds);
    // Back from ns/B, -rho x 1e9 x 1e-9 can round below -rho.
    return std::max(-in.reduce_s_per_byte, ns * 1e-9);
  };
  // Its CPU: what each AllReduce took beyond the ring's without the codec's costs; linear in
  // kappa_cpu and o_c,cpu.
  const auto beyond = [&](const TimedCodec& t) {
    return t.cpu_s - RingAllReduceCpuTime(in, {name, ratio, 0, 0.0}, t.chunk_bytes);
  };
  const double kappa_cpu_floor = -in.reduce_s_per_byte * CpuOfWall(in);
  const double chunk_cpu_floor = -in.transport_cpu_s_per_message;
  if (m_few == m_many) {
    double kappa = 0, kappa_cpu = 0;
    for (const TimedCodec& t : timed) {
      kappa += kappa_at(t, 0);
      kappa_cpu += std::max(kappa_cpu_floor, beyond(t) / (steps * block));
    }
    fit.s_per_byte = kappa / static_cast<double>(timed.size());
    fit.cpu_s_per_byte = kappa_cpu / static_cast<double>(timed.size());
    return fit;
  }
  // With o_c set, kappa fits the few-chunk time; the many-chunk time then grows with o_c (each
  // chunk weighs more there than the kappa it takes back from the few), so o_c is where it meets.
  fit.s_per_chunk = Crossing(
      [&](double per_chunk) {
        return RingAllReduceTime(in, with(kappa_at(*few, per_chunk), per_chunk),
                                 many->chunk_bytes);
      },
      -in.chunk_overhead_s, 10e-3, many->seconds);
  fit.s_per_byte = kappa_at(*few, fit.s_per_chunk);
  // Two equations: beyond = 2(W-1) (block kappa_cpu + m o_c,cpu) at each size.
  const double y_few = beyond(*few) / steps, y_many = beyond(*many) / steps;
  double per_chunk = (y_many - y_few) / (m_many - m_few);
  double per_byte = (y_few - m_few * per_chunk) / block;
  if (per_chunk < chunk_cpu_floor) {
    per_chunk = chunk_cpu_floor;
    per_byte = (y_few + y_many - (m_few + m_many) * per_chunk) / (2 * block);
  }
  if (per_byte < kappa_cpu_floor) {
    per_byte = kappa_cpu_floor;
    per_chunk = std::max(chunk_cpu_floor,
                         (y_few + y_many - 2 * block * per_byte) / (m_few + m_many));
  }
  fit.cpu_s_per_byte = per_byte;
  fit.cpu_s_per_chunk = per_chunk;
  return fit;
}

double OverheadAt(const TimingInputs& in, int width, double t_ar_s) {
  const bool sync = width == 1;
  double t1 = in.overhead_allreduce_s, t2 = in.fast_allreduce_s;
  double s1 = sync ? in.sync_overhead_s : in.pipe_overhead_s;
  double s2 = sync ? in.fast_sync_overhead_s : in.fast_pipe_overhead_s;
  if (!(t1 > 0 && t2 > 0) || t1 == t2) return s1;
  if (t1 > t2) {
    std::swap(t1, t2);
    std::swap(s1, s2);
  }
  const double t = std::clamp(t_ar_s, t1, t2);
  return s1 + (s2 - s1) * (1 / t1 - 1 / t) / (1 / t1 - 1 / t2);
}

double ChunksPerBlock(const TimingInputs& in, double chunk_bytes) {
  return std::ceil(in.model_bytes / in.workers / chunk_bytes);
}

double ChunkOverhead(const TimingInputs& in, int width, double chunk_bytes) {
  if (in.overhead_chunks_per_block <= 0 || in.workers <= 1) return 0;
  const double per_chunk = width == 1 ? in.sync_overhead_per_chunk_s : in.pipe_overhead_per_chunk_s;
  return (ChunksPerBlock(in, chunk_bytes) - in.overhead_chunks_per_block) * per_chunk;
}

double FitChunkOverhead(double m_few, double sigma_few, double m_many, double sigma_many) {
  if (m_many == m_few) return 0;
  return std::max(0.0, (sigma_many - sigma_few) / (m_many - m_few));
}

namespace {

// Width 1 without sigma, at an AllReduce time t_ar.
double SyncBase(const TimingInputs& in, const CodecCost& codec, double chunk_bytes, double t_ar) {
  return std::max(in.compute_s + in.update_s + t_ar, CpuBoundTime(in, codec, chunk_bytes, 1));
}

// Width >= 2 without sigma_2, at an AllReduce time b.
double PipeBase(const TimingInputs& in, const CodecCost& codec, double chunk_bytes, int width,
                double b) {
  PSGD_CHECK(in.overlap_compute_factor >= 1 && in.overlap_allreduce_factor >= 1);
  const double a = in.compute_s + UpdateTime(in, width);
  const double fc = in.overlap_compute_factor, fa = in.overlap_allreduce_factor;
  const double overlapped = a * fc <= b * fa ? a * fc + b - a * fc / fa : b * fa + a - b * fa / fc;
  return std::max(overlapped, CpuBoundTime(in, codec, chunk_bytes, width));
}

}  // namespace

double RingSyncTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes) {
  const double t_ar = RingAllReduceTime(in, codec, chunk_bytes);
  if (in.workers == 1) return SyncBase(in, codec, chunk_bytes, t_ar);  // it waits for no AllReduce
  return std::max(SyncBase(in, codec, chunk_bytes, t_ar) + OverheadAt(in, 1, t_ar) +
                      ChunkOverhead(in, 1, chunk_bytes),
                  std::max(in.compute_s + in.update_s, t_ar));
}

double FitSyncOverhead(const TimingInputs& in, const CodecCost& codec, double chunk_bytes,
                       double measured_allreduce_s, double measured_step_s) {
  return measured_step_s - SyncBase(in, codec, chunk_bytes, measured_allreduce_s);
}

double PipeTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes, int width) {
  PSGD_CHECK_GE(width, 1);
  if (width == 1) return RingSyncTime(in, codec, chunk_bytes);
  const double b = RingAllReduceTime(in, codec, chunk_bytes);
  const double base = PipeBase(in, codec, chunk_bytes, width, b);
  if (in.workers == 1) return base;
  return std::max(base + OverheadAt(in, width, b) + ChunkOverhead(in, width, chunk_bytes),
                  std::max(in.compute_s + UpdateTime(in, width), b));
}

double FitPipeOverhead(const TimingInputs& in, const CodecCost& codec, double chunk_bytes,
                       double measured_allreduce_s, double measured_step_s) {
  return measured_step_s - PipeBase(in, codec, chunk_bytes, 2, measured_allreduce_s);
}

double PsScale(const TimingInputs& in, double busy_cpus) {
  PSGD_CHECK(in.ps_probe_workers > 0 && in.workers >= 1);
  const double n = in.ps_probe_workers, w = in.workers;
  double scale = w / n;
  if (in.loopback && in.host_cpus > 0 && busy_cpus > 0) {
    const double k = in.host_cpus;
    scale *= std::max(1.0, busy_cpus * (w + 1) / ((n + 1) * k)) / std::max(1.0, busy_cpus / k);
  }
  return scale;
}

double PsSyncTime(const TimingInputs& in, const CodecCost& codec) {
  PSGD_CHECK(in.bandwidth_Bps > 0 && codec.ratio >= 1);
  if (in.ps_probe_workers > 0) {
    return in.compute_s + in.ps_sync_beyond_compute_s * PsScale(in, in.ps_sync_busy_cpus);
  }
  const double w = in.workers, m = in.model_bytes;
  const double server_bytes = PsOverLoopback(in)
                                  ? w * PsPushCpu(in, codec) / RankCpu(in)
                                  : 2 * w * m / (codec.ratio * in.bandwidth_Bps);
  return in.compute_s + 2 * in.latency_s + server_bytes + w * m * in.reduce_s_per_byte +
         in.update_s + 2 * m * codec.s_per_byte + w * m * codec.s_per_byte;
}

double PsAsyncTime(const TimingInputs& in, const CodecCost& codec) {
  PSGD_CHECK(in.bandwidth_Bps > 0 && codec.ratio >= 1);
  if (in.ps_probe_workers > 0) {
    return in.compute_s + in.ps_async_beyond_compute_s * PsScale(in, in.ps_async_busy_cpus);
  }
  const double w = in.workers, m = in.model_bytes;
  const bool loopback = PsOverLoopback(in);
  const double push_bytes = loopback ? PsPushCpu(in, codec) / RankCpu(in)
                                     : 2 * m / (codec.ratio * in.bandwidth_Bps);
  const double worker = in.compute_s + 2 * in.latency_s + push_bytes + m * in.reduce_s_per_byte +
                        in.update_s + 2 * m * codec.s_per_byte;
  const double server_link = loopback ? 0 : w * m / (codec.ratio * in.bandwidth_Bps);
  const double server_cpu = w * (m * in.reduce_s_per_byte + in.update_s + m * codec.s_per_byte);
  return std::max({worker, server_link, server_cpu, PsAsyncCpuBoundTime(in, codec)});
}

double PsAsyncCpuBoundTime(const TimingInputs& in, const CodecCost& codec) {
  const double share = RankCpu(in);
  if (share <= 0 || in.ps_probe_workers > 0) return 0;
  const double w = in.workers, m = in.model_bytes, s_c = in.compute_cpu_share;
  const double transport = PsPushCpu(in, codec);
  const double server =
      w * ((m * in.reduce_s_per_byte + in.update_s + m * codec.s_per_byte) * s_c + transport);
  const double worker = (in.compute_s + 2 * m * codec.s_per_byte) * s_c + transport + server / w;
  return std::max(worker, server) / share;
}

double BestChunkBytes(const TimingInputs& in, const CodecCost& codec,
                      const std::vector<double>& chunk_sizes) {
  PSGD_CHECK(!chunk_sizes.empty());
  double best = chunk_sizes[0];
  double best_t = RingAllReduceTime(in, codec, best);
  for (double s : chunk_sizes) {
    const double t = RingAllReduceTime(in, codec, s);
    if (t < best_t * (1 - 1e-12)) {
      best = s;
      best_t = t;
    }
  }
  return best;
}

std::vector<double> DefaultChunkSizes() {
  std::vector<double> sizes;
  for (double s = 4096; s <= 16.0 * (1 << 20); s *= 2) sizes.push_back(s);
  return sizes;
}

namespace {

// The chunk among `chunk_sizes` whose time is lowest, and that time; `first` wins ties (a
// later chunk must be faster by more than rounding).
template <typename TimeOf>
std::pair<double, double> FastestChunk(const std::vector<double>& chunk_sizes, double first,
                                       TimeOf time_of) {
  double chunk = first;
  double best_t = time_of(first);
  for (double c : chunk_sizes) {
    const double t = time_of(c);
    if (t < best_t * (1 - 1e-12)) {
      chunk = c;
      best_t = t;
    }
  }
  return {chunk, best_t};
}

}  // namespace

TimingInputs OuterRoundInputs(const TimingInputs& in, int local_steps) {
  PSGD_CHECK_GE(local_steps, 1);
  if (local_steps == 1) return in;
  TimingInputs round = in;
  round.compute_s = local_steps * in.compute_s + (local_steps - 1) * in.update_s;
  round.update_s = UpdateTime(in, 2);
  round.pipelined_update_s = round.update_s;
  return round;
}

double OuterStepTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes,
                     int local_steps, bool overlap) {
  PSGD_CHECK_GE(local_steps, 1);
  if (local_steps == 1 && !overlap) return RingSyncTime(in, codec, chunk_bytes);
  const TimingInputs round = OuterRoundInputs(in, local_steps);
  const double round_s =
      overlap ? PipeTime(round, codec, chunk_bytes, 2) : RingSyncTime(round, codec, chunk_bytes);
  return round_s / local_steps;
}

std::vector<SchemePrediction> PredictOuter(const TimingInputs& in,
                                           const std::vector<CodecCost>& codecs,
                                           const std::vector<double>& chunk_sizes,
                                           const std::vector<int>& local_steps) {
  PSGD_CHECK(!chunk_sizes.empty());
  std::vector<SchemePrediction> rows;
  if (in.workers == 1) return rows;
  for (int h : local_steps) {
    PSGD_CHECK_GE(h, 1);
    const TimingInputs round = OuterRoundInputs(in, h);
    for (bool overlap : {false, true}) {
      if (h == 1 && overlap) continue;  // that is width 2, a row of PredictAll already
      for (const CodecCost& codec : codecs) {
        const auto [chunk, best_t] =
            FastestChunk(chunk_sizes, chunk_sizes.front(),
                         [&](double c) { return OuterStepTime(in, codec, c, h, overlap); });
        const RingTerms terms = RingAllReduceTerms(in, codec, chunk);
        const int width = overlap ? 2 : 1;
        rows.push_back({fmt::format("outer_h{}{}", h, overlap ? "_ov" : ""), codec.name, chunk,
                        best_t, (round.compute_s + UpdateTime(round, width)) / h,
                        terms.total_s / h, CpuBoundTime(round, codec, chunk, width) / h, terms});
      }
    }
  }
  return rows;
}

ModelReport PredictAll(const TimingInputs& in, const std::vector<CodecCost>& codecs,
                       const std::vector<double>& chunk_sizes) {
  ModelReport report;
  const double compute = in.compute_s + in.update_s;
  for (const CodecCost& codec : codecs) {
    // One worker sends nothing: a codec changes no time, and a server's link was not measured.
    if (in.workers == 1 && codec.name != "none") continue;
    // The PS modes send float32 (they ignore comm.compression): no rows they cannot run.
    if (codec.name == "none" && in.workers > 1) {
      const double sync = PsSyncTime(in, codec), async = PsAsyncTime(in, codec);
      report.rows.push_back({"ps_sync", codec.name, 0, sync, compute,
                             std::max(0.0, sync - compute), 0, {}});
      report.rows.push_back({"ps_async", codec.name, 0, async, compute,
                             std::max(0.0, async - compute), PsAsyncCpuBoundTime(in, codec), {}});
    }
    // Each scheme at the chunk size it is fastest with (the CPU bound can favour another than
    // the AllReduce alone does); among equals (width 2 hiding the AllReduce), the fastest
    // AllReduce.
    for (int width : {1, 2}) {
      const auto [chunk, best_t] =
          FastestChunk(chunk_sizes, BestChunkBytes(in, codec, chunk_sizes),
                       [&](double c) { return PipeTime(in, codec, c, width); });
      const RingTerms terms = RingAllReduceTerms(in, codec, chunk);
      // One worker has no ring, so no chunk to advise.
      report.rows.push_back({width == 1 ? "ring_sync" : "pipe_k2", codec.name,
                             in.workers > 1 ? chunk : 0, best_t,
                             in.compute_s + UpdateTime(in, width), terms.total_s,
                             CpuBoundTime(in, codec, chunk, width), terms});
    }
  }
  PSGD_CHECK(!report.rows.empty());
  report.best = *std::min_element(
      report.rows.begin(), report.rows.end(),
      [](const SchemePrediction& a, const SchemePrediction& b) { return a.iteration_s < b.iteration_s; });
  // Width 2 reaches max(C + U, T_AR); it is the best width unless the AllReduce is free (then
  // width 1 ties and has no staleness).
  report.best_width = report.best.scheme == "pipe_k2" ? 2 : 1;
  if (report.best.scheme == "ring_sync") report.best_width = 1;
  return report;
}

}  // namespace pipesgd::train
