#include "core/train/outer_loop.h"

#include <algorithm>
#include <cmath>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::train {

namespace {

// One parameter's outer step; Apply and Predict both use it, so a prediction is Apply's
// arithmetic to the bit.
inline float Nesterov(float w, float d, float& buf, bool first, float lr, float momentum) {
  buf = first ? d : momentum * buf + d;
  return w - lr * (d + momentum * buf);
}

}  // namespace

OuterOptimizer::OuterOptimizer(OuterKind kind, float learning_rate, float momentum,
                               size_t num_params, int64_t average_first)
    : kind_(kind), lr_(learning_rate), momentum_(momentum), n_(num_params),
      average_first_(average_first) {
  if (kind_ == OuterKind::kNesterov) {
    if (!(learning_rate > 0) || !std::isfinite(learning_rate)) {
      Throw(ErrorCode::kInvalidArgument, "outer learning rate {}: expected a finite value > 0",
            learning_rate);
    }
    if (!(momentum >= 0 && momentum < 1)) {
      Throw(ErrorCode::kInvalidArgument, "outer momentum {}: expected a value in [0, 1)",
            momentum);
    }
    buf_.assign(n_, 0.0f);
  }
}

void OuterOptimizer::StepOne(std::span<float> w, std::span<const float> d,
                             std::vector<float>& buf, bool& first, int64_t round) const {
  PSGD_CHECK_EQ(d.size(), n_);
  if (kind_ == OuterKind::kAverage || round < average_first_) {
    for (size_t i = 0; i < n_; ++i) w[i] = w[i] - d[i];
    return;
  }
  for (size_t i = 0; i < n_; ++i) w[i] = Nesterov(w[i], d[i], buf[i], first, lr_, momentum_);
  first = false;
}

void OuterOptimizer::Apply(std::span<float> params, std::span<const float> grads) {
  PSGD_CHECK_EQ(params.size(), n_);
  StepOne(params, grads, buf_, first_, applied_);
  ++applied_;
}

void OuterOptimizer::Predict(std::span<const float> params,
                             std::span<const std::span<const float>> grads,
                             std::span<float> out) const {
  PSGD_CHECK_EQ(params.size(), n_);
  PSGD_CHECK_EQ(out.size(), n_);
  std::copy(params.begin(), params.end(), out.begin());
  scratch_ = buf_;
  bool first = first_;
  int64_t round = applied_;
  for (const std::span<const float>& d : grads) StepOne(out, d, scratch_, first, round++);
}

std::vector<float> OuterOptimizer::SaveState() const {
  std::vector<float> state{first_ ? 1.0f : 0.0f, static_cast<float>(applied_)};
  state.insert(state.end(), buf_.begin(), buf_.end());
  return state;
}

void OuterOptimizer::LoadState(std::span<const float> state) {
  if (state.size() != 2 + buf_.size()) {
    Throw(ErrorCode::kDataLoss, "outer optimizer state of {} floats; expected {}", state.size(),
          2 + buf_.size());
  }
  first_ = state[0] != 0.0f;
  applied_ = static_cast<int64_t>(state[1]);
  std::copy(state.begin() + 2, state.end(), buf_.begin());
}

LocalRounds::LocalRounds(Objective& inner, Optimizer& optimizer)
    : inner_(inner), optimizer_(optimizer), x_(inner.num_params()), g_(inner.num_params()),
      fresh_(optimizer.SaveState()) {}

void LocalRounds::Begin(std::span<const float> start, bool fresh_optimizer) {
  PSGD_CHECK_EQ(start.size(), x_.size());
  if (fresh_optimizer) optimizer_.LoadState(fresh_);
  std::copy(start.begin(), start.end(), x_.begin());
  start_ = start.data();
  inner_steps_ = 0;
  loss_sum_ = 0;
}

float LocalRounds::InnerStep(int64_t step) {
  PSGD_CHECK(start_ != nullptr);
  const float loss = inner_.ComputeGradient(step, x_, g_);
  optimizer_.Apply(x_, g_);
  ++inner_steps_;
  loss_sum_ += loss;
  return loss;
}

float LocalRounds::ComputeGradient(int64_t /*round*/, std::span<const float> params,
                                   std::span<float> grads) {
  // The trainer computes the round's "gradient" at the point the round began from.
  PSGD_CHECK(params.data() == start_);
  PSGD_CHECK_GT(inner_steps_, 0);
  PSGD_CHECK_EQ(grads.size(), x_.size());
  for (size_t i = 0; i < x_.size(); ++i) grads[i] = params[i] - x_[i];
  const float loss = static_cast<float>(loss_sum_ / static_cast<double>(inner_steps_));
  start_ = nullptr;
  return loss;
}

}  // namespace pipesgd::train
