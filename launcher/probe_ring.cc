#include "launcher/probe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "core/base/cpu_quota.h"
#include "core/base/error.h"
#include "core/base/measure.h"
#include "core/collective/codec.h"
#include "core/collective/ring_allreduce.h"
#include "core/train/trainer.h"
#include "core/job/model_builder.h"
#include "core/job/worker_detail.h"
#include "launcher/link_prober.h"
#include "transport/rendezvous.h"

namespace pipesgd::launcher::probe {
namespace {

using Clock = std::chrono::steady_clock;

// A gathered message larger than this is no probe's (a rank's is a few hundred bytes).
constexpr uint64_t kMaxGatherBytes = 64u << 20;

// One rank's ring session: its connections to the ring neighbours and, for the PS exchange, a
// star around rank 0; each measurement is one method, every rank calling them in the same order.
class RingSession {
 public:
  RingSession(const RingProbe& in, RankProbe& mine);

  void MeasureLinks();
  void TimeAllReduces();
  void MeasureOverlap();
  void TimeSteps();
  void TimePsSteps();
  std::vector<RankProbe> Gather();

 private:
  transport::Connection& Conn(int peer);
  std::unique_ptr<collective::Communicator> Ring(const collective::CommunicatorOptions& o) {
    return collective::Communicator::CreateOnConnections(shared_, r_, w_, {left_}, {right_}, o);
  }
  // An AllReduce of `values` in place, with the job's deadline.
  void AllReduce(collective::Communicator& ring, std::span<float> values) {
    ring.AllReduce(values, collective::ReduceOp::kAverage, Deadline::After(job_.comm().timeout_s()));
  }
  // The median of kAllReduceReps AllReduces of the model after 2 untimed, and the CPU per call.
  ::pipesgd::probe::TimedAllReduce Time(collective::Communicator& ring, uint64_t chunk);
  // The job's options with `codec` at `chunk` (the config's codec options, error feedback
  // included).
  collective::CommunicatorOptions CodecOptions(const char* codec, uint64_t chunk) const;

  const RingProbe& in_;
  const config::Job& job_;
  RankProbe& mine_;
  const int w_, r_;
  const std::vector<float> params_;
  std::vector<float> values_;  // what the timed AllReduces reduce
  std::vector<int> peers_;
  job::PeerLinks links_;
  std::shared_ptr<transport::Transport> shared_;  // links_'s, not owned: a communicator's handle
  transport::Connection* right_ = nullptr;
  transport::Connection* left_ = nullptr;
  std::unique_ptr<Prober> prober_;
  std::unique_ptr<collective::Communicator> large_ring_;  // the agreements, the overlap
};

RingSession::RingSession(const RingProbe& in, RankProbe& mine)
    : in_(in), job_(in.job), mine_(mine), w_(in.env.world_size), r_(in.env.rank),
      params_(in.params.begin(), in.params.end()), values_(params_.size(), 1.0f) {
  peers_ = collective::Communicator::RingPeers(r_, w_);
  if (r_ == 0) {
    for (int q = 1; q < w_; ++q) peers_.push_back(q);
  } else if (w_ > 1) {
    peers_.push_back(0);
  }
  std::sort(peers_.begin(), peers_.end());
  peers_.erase(std::unique(peers_.begin(), peers_.end()), peers_.end());
  links_ = job::ConnectPeers(in.env, "pipesgd " PIPESGD_VERSION " probe\n" + job::JobDescription(job_),
                             peers_, job_.comm(), Deadline::After(job_.comm().start_timeout_s()),
                             fmt::format("comm.start_timeout_s = {} s", job_.comm().start_timeout_s()));
  shared_ = std::shared_ptr<transport::Transport>(links_.transport.get(), [](transport::Transport*) {});
  right_ = &Conn((r_ + 1) % w_);
  left_ = &Conn((r_ + w_ - 1) % w_);
  prober_ = std::make_unique<Prober>(*links_.transport, job_.comm().timeout_s());
  mine_.set_loopback(transport::IsLoopbackIp(links_.data_address));
  mine_.set_host_cpus(ProcessCpus());
}

transport::Connection& RingSession::Conn(int peer) {
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (peers_[i] == peer) return *links_.connections[i];
  }
  Throw(ErrorCode::kInternal, "probe: no connection to rank {}", peer);
}

void RingSession::MeasureLinks() {
  // Round i: rank i measures its link to rank i+1, which answers; one link at a time.
  for (int i = 0; i < w_; ++i) {
    if (r_ == i) {
      const LinkNumbers link = prober_->Ping(*right_, in_.pings);
      mine_.set_latency_s(link.latency_s);
      mine_.set_bandwidth_bps(link.bandwidth_Bps);
      mine_.set_chunk_overhead_s(link.overhead_s);
    } else if (r_ == (i + 1) % w_) {
      prober_->Pong(*left_, in_.pings);
    }
  }
  mine_.set_ring_bandwidth_bps(
      prober_->RingExchange(*right_, *left_, kBigBytes, kBigReps).bandwidth_Bps);
  // The PS schemes' messages, the whole model each: as many as make 32 MiB, at least 8.
  const size_t model = 4 * params_.size();
  mine_.set_exchange_cpu_s_per_byte(
      prober_->RingExchange(*right_, *left_, model, std::max<int>(8, (32u << 20) / model))
          .cpu_s_per_byte);
}

::pipesgd::probe::TimedAllReduce RingSession::Time(collective::Communicator& ring, uint64_t chunk) {
  std::vector<double> times;
  double cpu0 = 0;
  for (int i = 0; i < 2 + kAllReduceReps; ++i) {
    if (i == 2) cpu0 = ProcessCpuSeconds();
    const auto t0 = Clock::now();
    AllReduce(ring, values_);
    if (i >= 2) times.push_back(SecondsSince(t0));
  }
  ::pipesgd::probe::TimedAllReduce t;
  t.set_chunk_bytes(chunk);
  t.set_cpu_s((ProcessCpuSeconds() - cpu0) / kAllReduceReps);
  t.set_seconds(Median(times));
  return t;
}

collective::CommunicatorOptions RingSession::CodecOptions(const char* codec, uint64_t chunk) const {
  collective::CommunicatorOptions copt = job::CommunicatorOptionsFromConfig(job_);
  copt.chunk_bytes = chunk;
  copt.streams = 1;
  copt.codec.kind = ParseCodecKind(codec);
  copt.compression_min_bytes = 0;
  return copt;
}

void RingSession::TimeAllReduces() {
  // The job's AllReduce itself on these connections (a communicator per chunk size; the
  // transport stays the caller's).
  for (uint64_t chunk : kTimedChunks) {
    collective::CommunicatorOptions copt;
    copt.chunk_bytes = chunk;
    *mine_.add_allreduce() = Time(*Ring(copt), chunk);
  }
  // The same AllReduce with each codec: what a codec costs in the ring, which its encode and
  // decode alone do not show.
  for (const char* name : kProbeCodecs) {
    ::pipesgd::probe::CodecAllReduce& codec = *mine_.add_codec();
    codec.set_codec(name);
    for (const uint64_t chunk : {kMidChunk, kLargeChunk}) {
      *codec.add_timed() = Time(*Ring(CodecOptions(name, chunk)), chunk);
    }
  }
}

void RingSession::MeasureOverlap() {
  // Width 2's situation: this thread reduces while a second one computes, on every rank at
  // once. Where they share cores (loopback, a node under a CPU quota) each slows the other,
  // which the times above, each taken alone, cannot show. The call count comes from an
  // AllReduce of every rank's time, the same bits on every rank.
  collective::CommunicatorOptions copt;
  copt.chunk_bytes = kLargeChunk;
  large_ring_ = Ring(copt);
  std::vector<float> mean_large = {static_cast<float>(mine_.allreduce(2).seconds())};
  AllReduce(*large_ring_, mean_large);
  const int calls = std::clamp(
      static_cast<int>(kOverlapBudgetS / std::max(1e-6, double(mean_large[0]))), 5, 100);
  std::atomic<bool> stop{false};
  double compute_window_s = 0, compute_thread_cpu_s = 0;
  int64_t overlapped_steps = 0;
  const auto a0 = Clock::now();
  const double overlap_cpu0 = ProcessCpuSeconds();
  std::exception_ptr compute_error;
  {
    std::jthread computer([&] {
      try {
        // The job's thread counts here too (OpenMP keeps them per thread).
        job::FitThreadsToCpuQuota(job_.model());
        std::vector<float> cparams(params_), cgrads(params_.size());
        const auto c0 = Clock::now();
        const double cpu0 = ThreadCpuSeconds();
        while (!stop.load(std::memory_order_relaxed)) {
          (void)in_.task.ComputeGradient(overlapped_steps, cparams, cgrads);
          ++overlapped_steps;
        }
        compute_window_s = SecondsSince(c0);
        compute_thread_cpu_s = ThreadCpuSeconds() - cpu0;
      } catch (...) {
        compute_error = std::current_exception();
      }
    });
    try {
      for (int i = 0; i < calls; ++i) AllReduce(*large_ring_, values_);
    } catch (...) {
      stop = true;
      throw;
    }
    stop = true;
  }
  if (compute_error) std::rethrow_exception(compute_error);
  const double overlap_cpu_s = ProcessCpuSeconds() - overlap_cpu0;
  const double steps = static_cast<double>(overlapped_steps);
  mine_.set_overlap_cpu_share(overlap_cpu_s / SecondsSince(a0));
  mine_.set_overlap_compute_cpu_s(overlapped_steps > 0 ? compute_thread_cpu_s / steps : 0);
  mine_.set_overlap_allreduce_cpu_s((overlap_cpu_s - compute_thread_cpu_s) / calls);
  mine_.set_overlap_allreduce_s(SecondsSince(a0) / calls);
  mine_.set_overlap_compute_s(overlapped_steps > 0 ? compute_window_s / steps : 0);
}

void RingSession::TimeSteps() {
  // Real width-1 and width-2 steps (the job's trainer, its communication thread, StepChunk's
  // chunks) on a scratch copy, without a codec and with the one whose AllReduce is fastest
  // (sigma shrinks as the AllReduce grows: a late rank's lag hides in a long one). What they
  // take beyond C + U + T_AR is the model's sigma. The codec and the step counts, as the
  // call count of the overlap, from an AllReduce: the same on every rank.
  const uint64_t step_chunk = mine_.step_chunk_bytes();
  const bool large = step_chunk == kLargeChunk;
  const int at = large ? 1 : 0;  // the codecs' timed entry at step_chunk
  std::vector<float> agreed(2 + kNumProbeCodecs);
  for (int c = 0; c < kNumProbeCodecs; ++c) {
    agreed[2 + c] = static_cast<float>(mine_.codec(c).timed(at).seconds());
  }
  AllReduce(*large_ring_, agreed);
  const int fast = static_cast<int>(
      std::min_element(agreed.begin() + 2, agreed.end()) - (agreed.begin() + 2));
  mine_.set_fast_codec(fast);
  const double cu = in_.compute_s + in_.update_s;
  agreed[0] = static_cast<float>(cu + mine_.allreduce(large ? 2 : 1).seconds());
  agreed[1] = static_cast<float>(cu + mine_.codec(fast).timed(at).seconds());
  AllReduce(*large_ring_, agreed);
  const auto steps_for = [&](float estimate) {
    return std::clamp(
        static_cast<int>(kSyncBudgetS / kStepRounds / std::max(1e-6, double(estimate))), 4, 50);
  };
  const int sync_steps = steps_for(agreed[0]), fast_steps = steps_for(agreed[1]);
  collective::CommunicatorOptions step_options;
  step_options.chunk_bytes = step_chunk;
  auto step_ring = Ring(step_options);
  auto fast_ring = Ring(CodecOptions(kProbeCodecs[fast], step_chunk));
  auto fast_other_ring = Ring(CodecOptions(kProbeCodecs[fast], mine_.other_chunk_bytes()));
  std::vector<float> scratch(params_);
  const auto& train_cfg = job_.train();
  train::SgdOptimizer scratch_sgd(
      {train_cfg.learning_rate(), train_cfg.momentum(), train_cfg.weight_decay()}, params_.size());
  train::TrainerOptions trainer_options;
  trainer_options.timeout_s = job_.comm().timeout_s();
  // Steps of one width at a time; width 2's pipeline fills in its first step (it applies
  // nothing), so the untimed steps cover it.
  const auto time_steps = [&](collective::Communicator& comm, int steps, int width) {
    trainer_options.pipeline_width = width;
    trainer_options.compensation =
        width >= 2 ? job::detail::CompensationFromConfig(train_cfg.staleness_compensation())
                   : train::StalenessCompensation::kNone;
    train::Trainer trainer(comm, in_.task, scratch_sgd, scratch, trainer_options);
    for (int i = 0; i < 2; ++i) trainer.Step();
    const auto s0 = Clock::now();
    for (int i = 0; i < steps; ++i) trainer.Step();
    const double per_step = SecondsSince(s0) / steps;
    trainer.Drain(false);
    return per_step;
  };
  // In turn, so that none takes all of a slow moment, nor pays alone for what warms up first.
  std::vector<double> rounds[6];
  for (int round = 0; round < kStepRounds; ++round) {
    rounds[0].push_back(time_steps(*step_ring, sync_steps, 1));
    rounds[1].push_back(time_steps(*step_ring, sync_steps, 2));
    rounds[2].push_back(time_steps(*fast_ring, fast_steps, 1));
    rounds[3].push_back(time_steps(*fast_ring, fast_steps, 2));
    rounds[4].push_back(time_steps(*fast_other_ring, fast_steps, 1));
    rounds[5].push_back(time_steps(*fast_other_ring, fast_steps, 2));
  }
  mine_.set_sync_step_s(Median(rounds[0]));
  mine_.set_pipe_step_s(Median(rounds[1]));
  mine_.set_fast_sync_step_s(Median(rounds[2]));
  mine_.set_fast_pipe_step_s(Median(rounds[3]));
  mine_.set_fast_other_sync_step_s(Median(rounds[4]));
  mine_.set_fast_other_pipe_step_s(Median(rounds[5]));
}

void RingSession::TimePsSteps() {
  // A synchronous step computes and moves (W-1) models into rank 0 and out, at about W times
  // the 16 MiB AllReduce's link time; the step count, as above, agreed.
  std::vector<float> ps_estimate = {
      static_cast<float>(in_.compute_s + w_ * mine_.allreduce(2).seconds())};
  AllReduce(*large_ring_, ps_estimate);
  const int ps_steps = std::clamp(
      static_cast<int>(kPsBudgetS / kStepRounds / std::max(1e-6, double(ps_estimate[0]))), 3,
      30);
  std::vector<transport::Connection*> star;
  if (r_ == 0) {
    for (int q = 1; q < w_; ++q) star.push_back(&Conn(q));
  } else {
    star.push_back(&Conn(0));
  }
  MeasurePsSteps(*links_.transport, star, r_, in_.task, params_, job_, ps_steps, mine_);
}

std::vector<RankProbe> RingSession::Gather() {
  // One pass around the ring: rank 0 starts with its own, each rank adds its own and passes on,
  // and rank 0 gets every rank's back. A length (8 bytes), then the message.
  ::pipesgd::probe::ProbeResults all;
  const auto send = [&] {
    const std::string bytes = all.SerializeAsString();
    const uint64_t length = bytes.size();
    prober_->Send(*right_, &length, sizeof(length));
    prober_->Send(*right_, bytes.data(), bytes.size());
  };
  const auto recv = [&] {
    uint64_t length = 0;
    prober_->Recv(*left_, &length, sizeof(length));
    if (length > kMaxGatherBytes) {
      Throw(ErrorCode::kDataLoss, "probe: rank {} sent {} bytes of measurements, expected at most {}",
            (r_ + w_ - 1) % w_, length, kMaxGatherBytes);
    }
    std::string bytes(length, '\0');
    prober_->Recv(*left_, bytes.data(), bytes.size());
    if (!all.ParseFromString(bytes) || all.rank_size() != (r_ == 0 ? w_ : r_)) {
      Throw(ErrorCode::kDataLoss, "probe: rank {} sent measurements that are not {} ranks'",
            (r_ + w_ - 1) % w_, r_ == 0 ? w_ : r_);
    }
  };
  if (r_ == 0) {
    *all.add_rank() = mine_;
    send();
    recv();
  } else {
    recv();
    *all.add_rank() = mine_;
    send();
  }
  return {all.rank().begin(), all.rank().end()};
}

}  // namespace

std::vector<RankProbe> MeasureOnRing(const RingProbe& in, RankProbe mine) {
  RingSession session(in, mine);
  session.MeasureLinks();
  session.TimeAllReduces();
  session.MeasureOverlap();
  session.TimeSteps();
  session.TimePsSteps();
  return session.Gather();
}

}  // namespace pipesgd::launcher::probe
