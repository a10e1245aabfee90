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
                               size_t num_params)
    : kind_(kind), lr_(learning_rate), momentum_(momentum), n_(num_params) {
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

void OuterOptimizer::Apply(std::span<float> params, std::span<const float> grads) {
  PSGD_CHECK_EQ(params.size(), n_);
  PSGD_CHECK_EQ(grads.size(), n_);
  if (kind_ == OuterKind::kAverage) {
    for (size_t i = 0; i < n_; ++i) params[i] = params[i] - grads[i];
  } else {
    for (size_t i = 0; i < n_; ++i) {
      params[i] = Nesterov(params[i], grads[i], buf_[i], first_, lr_, momentum_);
    }
  }
  first_ = false;
}

void OuterOptimizer::Predict(std::span<const float> params,
                             std::span<const std::span<const float>> grads,
                             std::span<float> out) const {
  PSGD_CHECK_EQ(params.size(), n_);
  PSGD_CHECK_EQ(out.size(), n_);
  std::copy(params.begin(), params.end(), out.begin());
  if (kind_ == OuterKind::kNesterov) scratch_ = buf_;
  bool first = first_;
  for (const std::span<const float>& d : grads) {
    PSGD_CHECK_EQ(d.size(), n_);
    if (kind_ == OuterKind::kAverage) {
      for (size_t i = 0; i < n_; ++i) out[i] = out[i] - d[i];
    } else {
      for (size_t i = 0; i < n_; ++i) {
        out[i] = Nesterov(out[i], d[i], scratch_[i], first, lr_, momentum_);
      }
    }
    first = false;
  }
}

std::vector<float> OuterOptimizer::SaveState() const {
  std::vector<float> state{first_ ? 1.0f : 0.0f};
  state.insert(state.end(), buf_.begin(), buf_.end());
  return state;
}

void OuterOptimizer::LoadState(std::span<const float> state) {
  if (state.size() != 1 + buf_.size()) {
    Throw(ErrorCode::kDataLoss, "outer optimizer state of {} floats; expected {}", state.size(),
          1 + buf_.size());
  }
  first_ = state[0] != 0.0f;
  std::copy(state.begin() + 1, state.end(), buf_.begin());
}

LocalRounds::LocalRounds(Objective& inner, Optimizer& optimizer)
    : inner_(inner), optimizer_(optimizer), x_(inner.num_params()), g_(inner.num_params()) {}

void LocalRounds::Begin(std::span<const float> start) {
  PSGD_CHECK_EQ(start.size(), x_.size());
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
