#include "core/train/autotune.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/measure.h"

namespace pipesgd::train {
namespace {

using Clock = std::chrono::steady_clock;

// An uncompressed ring on the job ring's first connection: the tuning's own small collectives.
std::unique_ptr<collective::Communicator> ControlRing(collective::Communicator& comm) {
  collective::CommunicatorOptions exact;
  exact.streams = 1;
  std::vector<transport::Connection*> left, right;
  if (!comm.left_connections().empty()) {
    left = {comm.left_connections()[0]};
    right = {comm.right_connections()[0]};
  }
  return collective::Communicator::CreateOnConnections(comm.shared_transport(), comm.rank(),
                                                       comm.world_size(), left, right, exact);
}

// The job ring's options (or `options`) with another chunk size and stream count, on its
// connections.
std::unique_ptr<collective::Communicator> RingWith(collective::Communicator& comm,
                                                   uint64_t chunk_bytes, int streams,
                                                   collective::CommunicatorOptions options) {
  options.chunk_bytes = chunk_bytes;
  options.streams = streams;
  std::vector<transport::Connection*> left, right;
  if (!comm.left_connections().empty()) {
    PSGD_CHECK_LE(static_cast<size_t>(streams), comm.left_connections().size());
    left.assign(comm.left_connections().begin(), comm.left_connections().begin() + streams);
    right.assign(comm.right_connections().begin(), comm.right_connections().begin() + streams);
  }
  return collective::Communicator::CreateOnConnections(comm.shared_transport(), comm.rank(),
                                                       comm.world_size(), left, right, options);
}
std::unique_ptr<collective::Communicator> RingWith(collective::Communicator& comm,
                                                   uint64_t chunk_bytes, int streams) {
  return RingWith(comm, chunk_bytes, streams, comm.options());
}

// The median of `reps` AllReduces of `gradient` on `ring`, after one untimed.
double TimeAllReduce(collective::Communicator& ring, std::span<float> gradient, int reps,
                     double timeout_s) {
  ring.AllReduce(gradient, collective::ReduceOp::kAverage, Deadline::After(timeout_s));
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    ring.AllReduce(gradient, collective::ReduceOp::kAverage, Deadline::After(timeout_s));
    times.push_back(SecondsSince(t0));
  }
  return Median(times);
}

template <typename T>
T PreferredOrFirst(const std::vector<T>& candidates, T preferred) {
  return std::find(candidates.begin(), candidates.end(), preferred) != candidates.end()
             ? preferred
             : candidates[0];
}

// Every rank's `mine` (the same length on every rank), slowest rank's value per entry, the
// same floats on every rank: one exact AllReduce of a rank-major table, then a max.
std::vector<double> SlowestRank(collective::Communicator& control, const std::vector<double>& mine,
                                double timeout_s) {
  const size_t n = mine.size(), w = static_cast<size_t>(control.world_size());
  std::vector<float> table(n * w, 0.0f);
  for (size_t i = 0; i < n; ++i) table[static_cast<size_t>(control.rank()) * n + i] = static_cast<float>(mine[i]);
  control.AllReduce(table, collective::ReduceOp::kSum, Deadline::After(timeout_s));
  std::vector<double> out(n, 0.0);
  for (size_t r = 0; r < w; ++r) {
    for (size_t i = 0; i < n; ++i) out[i] = std::max(out[i], static_cast<double>(table[r * n + i]));
  }
  return out;
}

size_t Choose(const AutoTuneRequest& request, int rank, const std::vector<double>& seconds,
              size_t preferred) {
  return request.choose ? request.choose(rank, seconds, preferred)
                        : ChooseByTime(seconds, preferred, request.tie);
}

}  // namespace

size_t ChooseByTime(const std::vector<double>& seconds, size_t preferred, double tie) {
  PSGD_CHECK_LT(preferred, seconds.size());
  const size_t fastest = static_cast<size_t>(
      std::min_element(seconds.begin(), seconds.end()) - seconds.begin());
  return seconds[preferred] > (1 + tie) * seconds[fastest] ? fastest : preferred;
}

std::vector<float> TakeRankZeros(collective::Communicator& comm, std::vector<float> values,
                                 double timeout_s) {
  if (comm.rank() != 0) std::fill(values.begin(), values.end(), 0.0f);
  comm.AllReduce(values, collective::ReduceOp::kSum, Deadline::After(timeout_s));
  return values;
}

uint64_t ChunksPerBlock(uint64_t count, int world_size, uint64_t chunk_bytes) {
  PSGD_CHECK_GE(world_size, 1);
  const uint64_t w = static_cast<uint64_t>(world_size);
  const uint64_t block = (count + w - 1) / w;
  const uint64_t elems = std::max<uint64_t>(1, chunk_bytes / sizeof(float));
  return std::max<uint64_t>(1, (block + elems - 1) / elems);
}

AutoTuneResult AutoTune(collective::Communicator& comm, Objective& objective,
                        std::span<const float> params, const AutoTuneRequest& request) {
  PSGD_CHECK(!request.chunk_bytes.empty() && !request.streams.empty() && !request.widths.empty());
  PSGD_CHECK(request.make_optimizer != nullptr || request.widths.size() == 1);
  const auto start = Clock::now();
  const double timeout = request.timeout_s;
  AutoTuneResult result;
  if (comm.world_size() == 1) {
    // Nothing to reduce, nothing to overlap: a width-2 trial would only add staleness.
    result.chunk_bytes = PreferredOrFirst(request.chunk_bytes, request.preferred_chunk_bytes);
    result.streams = 1;
    result.width = PreferredOrFirst(request.widths, 1);
    comm.Retune(result.chunk_bytes, result.streams);
    result.seconds = SecondsSince(start);
    return result;
  }
  const auto control = ControlRing(comm);
  // The gradient the trainer reduces: the parameters' and the loss (trainer.h's slots).
  const uint64_t count = params.size() + 1;
  std::vector<float> gradient(count);
  for (size_t i = 0; i < gradient.size(); ++i) {
    gradient[i] = 1e-3f * std::sin(0.001f * static_cast<float>(i));
  }

  // Candidates, the preferred value first; chunk sizes that chunk this gradient alike once.
  std::vector<uint64_t> chunks = {
      PreferredOrFirst(request.chunk_bytes, request.preferred_chunk_bytes)};
  for (uint64_t c : request.chunk_bytes) {
    const bool same = std::any_of(chunks.begin(), chunks.end(), [&](uint64_t k) {
      return ChunksPerBlock(count, comm.world_size(), k) ==
             ChunksPerBlock(count, comm.world_size(), c);
    });
    if (!same) chunks.push_back(c);
  }
  std::vector<int> streams = request.streams;
  if (auto it = std::find(streams.begin(), streams.end(), request.preferred_streams);
      it != streams.end()) {
    std::rotate(streams.begin(), it, it + 1);
  }
  struct Candidate {
    uint64_t chunk_bytes;
    int streams;
  };
  std::vector<Candidate> candidates;
  for (int s : streams) {
    for (uint64_t c : chunks) candidates.push_back({c, s});
  }

  // The compute time, for the model's predictions only (the widths are chosen by trial).
  double compute_s = 0;
  if (request.widths.size() > 1) {
    std::vector<float> scratch(params.begin(), params.end()), grads(params.size());
    std::vector<double> times;
    (void)objective.ComputeGradient(0, scratch, grads);
    for (int i = 0; i < 3; ++i) {
      const auto t0 = Clock::now();
      (void)objective.ComputeGradient(1 + i, scratch, grads);
      times.push_back(SecondsSince(t0));
    }
    compute_s = Median(times);
  }

  // How many calls make the budget: from one call at the preferred candidate, the slowest
  // rank's, so that every rank makes the same number.
  auto first = RingWith(comm, candidates[0].chunk_bytes, candidates[0].streams);
  auto t0 = Clock::now();
  first->AllReduce(gradient, collective::ReduceOp::kAverage, Deadline::After(timeout));
  const double once = SlowestRank(*control, {SecondsSince(t0)}, timeout)[0];
  const int reps = std::clamp(static_cast<int>(request.budget_s / std::max(once, 1e-6)), 3, 15);
  first.reset();

  std::vector<double> mine;
  for (const Candidate& c : candidates) {
    mine.push_back(TimeAllReduce(*RingWith(comm, c.chunk_bytes, c.streams), gradient, reps,
                                 timeout));
  }
  mine.push_back(compute_s);
  const std::vector<double> slowest = SlowestRank(*control, mine, timeout);
  std::vector<double> allreduce_s(slowest.begin(), slowest.end() - 1);
  result.compute_s = slowest.back();
  for (size_t i = 0; i < candidates.size(); ++i) {
    result.allreduce.push_back({candidates[i].chunk_bytes, candidates[i].streams, allreduce_s[i]});
  }
  const size_t pick = static_cast<size_t>(TakeRankZeros(
      *control, {static_cast<float>(Choose(request, comm.rank(), allreduce_s, 0))}, timeout)[0]);
  PSGD_CHECK_LT(pick, candidates.size());
  result.chunk_bytes = candidates[pick].chunk_bytes;
  result.streams = candidates[pick].streams;

  // What each other codec would take at the chosen values (the job's error feedback kept).
  if (!request.compare_codecs.empty()) {
    std::vector<double> codec_s;
    for (CodecKind kind : request.compare_codecs) {
      collective::CommunicatorOptions options = comm.options();
      options.codec.kind = kind;
      options.error_feedback = options.error_feedback && kind != CodecKind::kNone;
      codec_s.push_back(TimeAllReduce(*RingWith(comm, result.chunk_bytes, result.streams, options),
                                      gradient, reps, timeout));
    }
    const std::vector<double> slow = SlowestRank(*control, codec_s, timeout);
    for (size_t i = 0; i < slow.size(); ++i) {
      result.codecs.push_back({request.compare_codecs[i], slow[i]});
    }
  }

  // Widths: a few real steps of each on scratch parameters and optimizer state.
  result.width = request.widths[0];
  if (request.widths.size() > 1) {
    const double t_ar = allreduce_s[pick];
    const int steps = std::clamp(
        static_cast<int>(request.width_budget_s / std::max(result.compute_s + t_ar, 1e-6)), 8,
        500);
    constexpr int kWarm = 2;  // the pipeline fills
    // Two rounds, the widths in turn, the faster of each width's two: whichever runs first
    // otherwise pays alone for what warms up (the 1gbit lab had width 1, always first, 6% slower
    // in its trial than in whole runs).
    constexpr int kRounds = 2;
    std::vector<double> step_s(request.widths.size(), 0.0);
    for (int round = 0; round < kRounds; ++round) {
      for (size_t k = 0; k < request.widths.size(); ++k) {
        auto ring = RingWith(comm, result.chunk_bytes, result.streams);
        std::vector<float> scratch(params.begin(), params.end());
        const std::unique_ptr<Optimizer> optimizer = request.make_optimizer();
        TrainerOptions options = request.trainer;
        options.pipeline_width = request.widths[k];
        options.compression_warmup_steps = 0;
        options.sync_warmup_steps = 0;
        const int n = std::max(4, steps / kRounds);
        double seconds = 0;
        {
          Trainer trainer(*ring, objective, *optimizer, scratch, options);
          for (int i = 0; i < kWarm; ++i) trainer.Step();
          t0 = Clock::now();
          for (int i = 0; i < n; ++i) trainer.Step();
          seconds = SecondsSince(t0) / n;
          trainer.Drain(false);
        }
        step_s[k] = round == 0 ? seconds : std::min(step_s[k], seconds);
      }
    }
    const std::vector<double> slow = SlowestRank(*control, step_s, timeout);
    size_t preferred = 0;
    for (size_t i = 0; i < request.widths.size(); ++i) {
      if (request.widths[i] == request.preferred_width) preferred = i;
      const double c = result.compute_s;
      result.widths.push_back({request.widths[i], slow[i],
                               request.widths[i] == 1 ? c + t_ar : std::max(c, t_ar)});
    }
    const size_t w = static_cast<size_t>(TakeRankZeros(
        *control, {static_cast<float>(Choose(request, comm.rank(), slow, preferred))},
        timeout)[0]);
    PSGD_CHECK_LT(w, request.widths.size());
    result.width = request.widths[w];
  }
  comm.Retune(result.chunk_bytes, result.streams);
  // The tuning's traffic left each connection's congestion control in a state of its own (under
  // BBR, a ProbeRTT phase per connection, which stalls the ring once per connection per 10 s):
  // the job starts them afresh and together, as a job without tuning does. Every rank left the
  // last AllReduce above within about one round trip of the others.
  for (const auto* side : {&comm.left_connections(), &comm.right_connections()}) {
    for (transport::Connection* c : *side) {
      const std::string restarted = c->RestartCongestionControl();
      if (!restarted.empty()) result.congestion_restarted = restarted;
    }
  }
  result.seconds = SecondsSince(start);
  return result;
}

}  // namespace pipesgd::train
