#include "pipesgd/pipesgd.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <utility>

#include "core/base/error.h"
#include "core/collective/ring_allreduce.h"
#include "core/train/trainer.h"
#include "transport/factory.h"
#include "transport/launch_env.h"
#include "transport/message_io.h"
#include "transport/rendezvous.h"

namespace pipesgd {

struct Communicator::Impl {
  std::unique_ptr<collective::Communicator> ring;
};

namespace {

collective::Communicator& Ring(const std::unique_ptr<Communicator::Impl>& impl) {
  if (!impl) Throw(ErrorCode::kInvalidArgument, "this pipesgd::Communicator was moved from");
  return *impl->ring;
}

void Exact(collective::Communicator& ring, std::span<float> data, double timeout_s) {
  collective::AllReduceOptions call;
  call.compress = false;
  ring.AllReduce(data, ReduceOp::kSum, Deadline::After(timeout_s), nullptr, call);
}

}  // namespace

const char* Version() { return PIPESGD_VERSION_STRING; }

ConnectOptions ConnectOptionsFromEnv() {
  const transport::LaunchEnv env = transport::ReadLaunchEnv();
  ConnectOptions o;
  o.rank = env.rank;
  o.world_size = env.world_size;
  o.master_addr = env.master_addr;
  o.master_port = env.master_port;
  if (const char* token = std::getenv("PIPESGD_JOB_TOKEN"); token != nullptr) o.token = token;
  return o;
}

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::Communicator(Communicator&&) noexcept = default;
Communicator& Communicator::operator=(Communicator&&) noexcept = default;
Communicator::~Communicator() = default;

int Communicator::rank() const { return Ring(impl_).rank(); }
int Communicator::world_size() const { return Ring(impl_).world_size(); }
std::string Communicator::Describe() const { return Ring(impl_).transport().Describe(); }

void Communicator::AllReduce(std::span<float> data, ReduceOp op, double timeout_s,
                             bool compress) {
  collective::AllReduceOptions call;
  call.compress = compress;
  Ring(impl_).AllReduce(data, op, Deadline::After(timeout_s), nullptr, call);
}

void Communicator::Broadcast(std::span<float> data, int root, double timeout_s) {
  Ring(impl_).Broadcast(std::as_writable_bytes(data), root, Deadline::After(timeout_s));
}

void Communicator::AllGather(std::span<const float> mine, std::span<float> all,
                             double timeout_s) {
  auto& ring = Ring(impl_);
  const size_t n = mine.size();
  const size_t world = static_cast<size_t>(ring.world_size());
  if (all.size() != world * n) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: AllGather of {} floats per rank into {} floats: expected world size {} x {} "
          "= {}",
          ring.rank(), n, all.size(), world, n, world * n);
  }
  ring.AllGather(std::as_bytes(mine), std::as_writable_bytes(all), Deadline::After(timeout_s));
}

void Communicator::Barrier(double timeout_s) {
  float token = 0;
  Exact(Ring(impl_), {&token, 1}, timeout_s);
}

WireStats Communicator::last_wire_stats() const {
  const collective::WireStats& s = Ring(impl_).last_wire_stats();
  return {s.bytes_sent, s.compressed, s.compression_ratio()};
}

Communicator Connect(const ConnectOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    Throw(ErrorCode::kInvalidArgument, "rank {} and world size {}: expected 0 <= rank < world size",
          o.rank, o.world_size);
  }
  if (o.chunk_bytes % 4 != 0) {
    Throw(ErrorCode::kInvalidArgument, "chunk_bytes {}: expected a multiple of 4 (or 0 = auto)",
          o.chunk_bytes);
  }
  if (o.streams < 1) {
    Throw(ErrorCode::kInvalidArgument, "streams {}: expected >= 1", o.streams);
  }
  if (!std::isfinite(o.timeout_s) || o.timeout_s <= 0) {
    Throw(ErrorCode::kInvalidArgument, "timeout_s {}: expected a positive number of seconds",
          o.timeout_s);
  }
  const Deadline deadline = Deadline::After(o.timeout_s);
  transport::TransportOptions t;
  t.kind = o.transport;
  t.rank = o.rank;
  t.world_size = o.world_size;
  t.bind_host = o.bind_host.empty() ? transport::LocalIpToward(o.master_addr, o.master_port)
                                    : o.bind_host;
  t.peers = collective::Communicator::RingPeers(o.rank, o.world_size);
  t.streams = o.streams;
  auto tr = transport::CreateTransport(t);
  transport::RendezvousOptions rdv;
  rdv.master_addr = o.master_addr;
  rdv.master_port = o.master_port;
  rdv.rank = o.rank;
  rdv.world_size = o.world_size;
  rdv.job = o.job;
  rdv.token = o.token;
  auto addresses = transport::RendezvousAllGather(rdv, tr->LocalAddress(), deadline);
  collective::CommunicatorOptions c;
  c.chunk_bytes = o.chunk_bytes;
  c.streams = o.streams;
  c.codec.kind = o.codec;
  c.error_feedback = o.error_feedback;
  c.compression_min_bytes = o.compression_min_bytes;
  auto impl = std::make_unique<Communicator::Impl>();
  impl->ring = collective::Communicator::Create(std::move(tr), o.world_size, addresses, c, deadline);
  return Communicator(std::move(impl));
}

ApplyFn PlainSgd(float lr) {
  return [lr](std::span<float> w, std::span<const float> g) {
    for (size_t i = 0; i < w.size(); ++i) w[i] -= lr * g[i];
  };
}

namespace {

class CallbackObjective : public train::Objective {
 public:
  CallbackObjective(size_t num_params, GradientFn gradient)
      : num_params_(num_params), gradient_(std::move(gradient)) {}
  size_t num_params() const override { return num_params_; }
  float ComputeGradient(int64_t step, std::span<const float> params,
                        std::span<float> grads) override {
    return gradient_(step, params, grads);
  }

 private:
  size_t num_params_;
  GradientFn gradient_;
};

class CallbackOptimizer : public train::Optimizer {
 public:
  explicit CallbackOptimizer(ApplyFn apply) : apply_(std::move(apply)) {}
  void Apply(std::span<float> params, std::span<const float> grads) override {
    apply_(params, grads);
  }

 private:
  ApplyFn apply_;
};

}  // namespace

// Declared in the order they are built: the trainer refers to the two callbacks.
struct Trainer::Impl {
  CallbackObjective objective;
  CallbackOptimizer optimizer;
  train::Trainer trainer;
  Impl(collective::Communicator& ring, std::span<float> params, GradientFn gradient,
       ApplyFn apply, const TrainOptions& o)
      : objective(params.size(), std::move(gradient)),
        optimizer(std::move(apply)),
        trainer(ring, objective, optimizer, params, {o.pipeline_width, o.timeout_s}) {}
};

Trainer::Trainer(Communicator& comm, std::span<float> params, GradientFn gradient, ApplyFn apply,
                 const TrainOptions& options) {
  if (!gradient || !apply) {
    Throw(ErrorCode::kInvalidArgument, "Trainer: the {} callback is empty",
          !gradient ? "gradient" : "apply");
  }
  impl_ = std::make_unique<Impl>(Ring(comm.impl_), params, std::move(gradient), std::move(apply),
                                 options);
}

Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

Trainer::~Trainer() {
  if (!impl_) return;
  // Finish the collectives this rank's peers are still in, so that they do not fail on a
  // closed connection; a failure here has already been or will be thrown by Step.
  try {
    impl_->trainer.Drain(false);
  } catch (const std::exception&) {
  }
}

train::Trainer& Trainer::Inner() const {
  if (!impl_) Throw(ErrorCode::kInvalidArgument, "this pipesgd::Trainer was moved from");
  return impl_->trainer;
}

void Trainer::Step() { Inner().Step(); }
void Trainer::Drain(bool apply) { Inner().Drain(apply); }
int64_t Trainer::steps() const { return Inner().steps(); }
float Trainer::StepLoss(int64_t t) const { return Inner().StepLoss(t); }

std::vector<float> Train(Communicator& comm, std::span<float> params, int64_t steps,
                         GradientFn gradient, ApplyFn apply, const TrainOptions& options) {
  Trainer trainer(comm, params, std::move(gradient), std::move(apply), options);
  for (int64_t t = 0; t < steps; ++t) trainer.Step();
  trainer.Drain(true);
  std::vector<float> losses;
  losses.reserve(static_cast<size_t>(std::max<int64_t>(steps, 0)));
  for (int64_t t = 0; t < steps; ++t) losses.push_back(trainer.StepLoss(t));
  return losses;
}

}  // namespace pipesgd
