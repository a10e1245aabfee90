// SGD with momentum and weight decay, step for step what torch.optim.SGD does (dampening 0, no
// Nesterov), in float.
#include "layers/sgd.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::layers {

Sgd::Sgd(const SgdOptions& options, size_t num_params) : options_(options) {
  // Same rejections as torch.optim.SGD, plus non-finite values.
  if (!std::isfinite(options_.learning_rate) || options_.learning_rate < 0.0f) {
    Throw(ErrorCode::kInvalidArgument, "learning rate must be finite and >= 0, got {}",
          options_.learning_rate);
  }
  if (!std::isfinite(options_.momentum) || options_.momentum < 0.0f) {
    Throw(ErrorCode::kInvalidArgument, "momentum must be finite and >= 0, got {}",
          options_.momentum);
  }
  if (!std::isfinite(options_.weight_decay) || options_.weight_decay < 0.0f) {
    Throw(ErrorCode::kInvalidArgument, "weight decay must be finite and >= 0, got {}",
          options_.weight_decay);
  }
  // Without momentum there is no buffer at all (PyTorch keeps none either).
  if (options_.momentum != 0.0f) momentum_buf_.assign(num_params, 0.0f);
}

void Sgd::Step(std::span<float> params, std::span<const float> grads) {
  PSGD_CHECK_EQ(params.size(), grads.size());
  const float lr = options_.learning_rate;
  const float momentum = options_.momentum;
  const float wd = options_.weight_decay;
  float* w = params.data();
  const float* g = grads.data();
  const size_t n = params.size();

  if (momentum == 0.0f) {
    // Exactly w - lr * g' per element, nothing else: the staleness tests compare this bitwise
    // with a plain recurrence. Weight decay is skipped, not multiplied by 0, when it is 0, since
    // 0 * inf would turn an infinite weight (which the divergence checks must see) into NaN.
    for (size_t i = 0; i < n; i++) {
      const float gi = wd != 0.0f ? g[i] + wd * w[i] : g[i];
      w[i] = w[i] - lr * gi;
    }
    return;
  }

  PSGD_CHECK_EQ(momentum_buf_.size(), n);
  float* buf = momentum_buf_.data();
  for (size_t i = 0; i < n; i++) {
    const float gi = wd != 0.0f ? g[i] + wd * w[i] : g[i];
    // PyTorch seeds the buffer with the first gradient itself, not momentum * 0 + g.
    buf[i] = first_step_ ? gi : momentum * buf[i] + gi;
    w[i] = w[i] - lr * buf[i];
  }
  first_step_ = false;
}

void Sgd::Predict(std::span<const float> params, std::span<const std::span<const float>> grads,
                  std::span<float> out) const {
  const size_t n = params.size();
  PSGD_CHECK_EQ(out.size(), n);
  for (const auto& g : grads) PSGD_CHECK_EQ(g.size(), n);
  const float lr = options_.learning_rate;
  const float momentum = options_.momentum;
  const float wd = options_.weight_decay;
  std::copy(params.begin(), params.end(), out.begin());
  float* w = out.data();
  if (momentum == 0.0f) {
    for (const auto& grad : grads) {
      const float* g = grad.data();
      for (size_t i = 0; i < n; i++) {
        const float gi = wd != 0.0f ? g[i] + wd * w[i] : g[i];
        w[i] = w[i] - lr * gi;
      }
    }
    return;
  }
  PSGD_CHECK_EQ(momentum_buf_.size(), n);
  // One step (width 2) reads the buffer without copying it; later steps need their own.
  const float* buf_in = momentum_buf_.data();
  float* buf_out = nullptr;
  if (grads.size() > 1) {
    scratch_.resize(n);
    buf_out = scratch_.data();
  }
  bool first = first_step_;
  for (const auto& grad : grads) {
    const float* g = grad.data();
    for (size_t i = 0; i < n; i++) {
      const float gi = wd != 0.0f ? g[i] + wd * w[i] : g[i];
      const float b = first ? gi : momentum * buf_in[i] + gi;
      w[i] = w[i] - lr * b;
      if (buf_out != nullptr) buf_out[i] = b;
    }
    first = false;
    if (buf_out != nullptr) buf_in = buf_out;
  }
}

void Sgd::StepAndPredict(std::span<float> params, std::span<const float> grads,
                         std::span<const float> ahead, std::span<float> out) {
  const size_t n = params.size();
  PSGD_CHECK_EQ(grads.size(), n);
  PSGD_CHECK_EQ(ahead.size(), n);
  PSGD_CHECK_EQ(out.size(), n);
  const float lr = options_.learning_rate;
  const float momentum = options_.momentum;
  const float wd = options_.weight_decay;
  float* w = params.data();
  float* o = out.data();
  const float* g = grads.data();
  const float* a = ahead.data();
  if (momentum == 0.0f) {
    for (size_t i = 0; i < n; i++) {
      const float gi = wd != 0.0f ? g[i] + wd * w[i] : g[i];
      const float wi = w[i] - lr * gi;
      w[i] = wi;
      const float ai = wd != 0.0f ? a[i] + wd * wi : a[i];
      o[i] = wi - lr * ai;
    }
    return;
  }
  PSGD_CHECK_EQ(momentum_buf_.size(), n);
  float* buf = momentum_buf_.data();
  for (size_t i = 0; i < n; i++) {
    const float gi = wd != 0.0f ? g[i] + wd * w[i] : g[i];
    const float bi = first_step_ ? gi : momentum * buf[i] + gi;
    const float wi = w[i] - lr * bi;
    buf[i] = bi;
    w[i] = wi;
    const float ai = wd != 0.0f ? a[i] + wd * wi : a[i];
    o[i] = wi - lr * (momentum * bi + ai);
  }
  first_step_ = false;
}

std::vector<float> Sgd::SaveState() const {
  std::vector<float> state;
  state.reserve(1 + momentum_buf_.size());
  state.push_back(first_step_ ? 1.0f : 0.0f);
  state.insert(state.end(), momentum_buf_.begin(), momentum_buf_.end());
  return state;
}

void Sgd::LoadState(std::span<const float> state) {
  if (state.size() != 1 + momentum_buf_.size() || (state[0] != 0.0f && state[0] != 1.0f)) {
    Throw(ErrorCode::kDataLoss,
          "optimizer state of {} floats (first-step flag {}): expected {} (SGD with momentum {} "
          "over {} parameters)",
          state.size(), state.empty() ? 0.0f : state[0], 1 + momentum_buf_.size(),
          options_.momentum, momentum_buf_.size());
  }
  first_step_ = state[0] == 1.0f;
  std::copy(state.begin() + 1, state.end(), momentum_buf_.begin());
}

}  // namespace pipesgd::layers
