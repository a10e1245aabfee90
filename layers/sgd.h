// SGD with momentum and weight decay, PyTorch's torch.optim.SGD semantics (dampening 0, no
// Nesterov), so results can be compared with a PyTorch run of the same model:
//   g'  = g + weight_decay * w
//   buf = g'                       (first step)
//   buf = momentum * buf + g'      (later steps)
//   w   = w - lr * buf             (with momentum; w - lr * g' without)
#pragma once

#include <cstddef>
#include <span>
#include <vector>

namespace pipesgd::layers {

struct SgdOptions {
  float learning_rate = 0.05f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
};

class Sgd {
 public:
  // `num_params` fixes the size of the momentum buffer.
  Sgd(const SgdOptions& options, size_t num_params);

  // One update of params (num_params) with the (already rank-averaged) gradient.
  void Step(std::span<float> params, std::span<const float> grads);

  // Writes to `out` the parameters that Step-ping with each of `grads` in turn would give,
  // with Step's arithmetic to the bit, leaving this optimizer unchanged (weight prediction for
  // the pipelined trainer). REQUIRES: out, params and every grads[i] have num_params floats;
  // out may not alias params.
  void Predict(std::span<const float> params, std::span<const std::span<const float>> grads,
               std::span<float> out) const;

  // Step(params, grads), then Predict(params, {ahead}, out), in one pass over the parameters
  // and to the bit the same (the pipelined trainer's update at width 2).
  void StepAndPredict(std::span<float> params, std::span<const float> grads,
                      std::span<const float> ahead, std::span<float> out);

  const SgdOptions& options() const { return options_; }

  // Everything Step depends on besides params and grads (for checkpoints): 1 float that is 1
  // before the first step and 0 after, then the momentum buffer (num_params floats, or none
  // without momentum).
  std::vector<float> SaveState() const;
  // Restores what SaveState returned. Throws Error(kDataLoss) naming both sizes when `state`
  // does not fit this optimizer.
  void LoadState(std::span<const float> state);

 private:
  SgdOptions options_;
  std::vector<float> momentum_buf_;
  bool first_step_ = true;
  // Predict's momentum buffer for predictions of more than one step.
  mutable std::vector<float> scratch_;
};

}  // namespace pipesgd::layers
