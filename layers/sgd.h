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
};

}  // namespace pipesgd::layers
