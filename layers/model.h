// A feed-forward stack of layers ending in softmax cross-entropy, over one contiguous parameter
// buffer. The model owns only scratch activations; parameters and gradients are passed in, so the
// trainer decides where they live (one gradient buffer per pipeline slot).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "layers/layer.h"

namespace pipesgd::layers {

// The BLAS library the layers run on, for `pipesgd info`: "OpenBLAS 0.3.21 ... (Haswell core,
// 2 threads)".
std::string BlasDescription();

struct EvalResult {
  double loss_sum = 0;  // sum over samples of the cross-entropy (natural log)
  int64_t correct = 0;  // samples whose argmax equals the label
  int64_t count = 0;
};

class Model {
 public:
  // `layers` in order; each layer's in_features must equal the previous out_features
  // (Error kInvalidArgument otherwise, naming both layers). The last out_features is the number
  // of classes. `max_batch` bounds the batch of every later call (activations are allocated once).
  Model(std::vector<std::unique_ptr<Layer>> layers, size_t max_batch);

  size_t num_params() const { return num_params_; }
  size_t in_features() const;
  size_t num_classes() const;
  size_t max_batch() const { return max_batch_; }
  // e.g. "linear(784->256) relu linear(256->128) relu linear(128->10): 235146 params".
  std::string Describe() const;

  // Writes the initial parameters for `seed` (same seed -> bitwise same params, on any rank).
  void Init(std::span<float> params, uint64_t seed) const;

  // One forward and backward pass on x (B, in) with labels (B) in [0, num_classes):
  // OVERWRITES grads (num_params) with the gradient of the MEAN loss over the batch and returns
  // that mean loss. REQUIRES: 1 <= batch <= max_batch, labels in range.
  float ForwardBackward(std::span<const float> params, const float* x, const uint8_t* labels,
                        size_t batch, std::span<float> grads);
  // The same in two halves, for callers that time them separately (the timeline):
  // Forward stores the activations and the loss gradient and returns the mean loss; Backward
  // (REQUIRES: right after Forward with the same params, x and batch) writes grads.
  float Forward(std::span<const float> params, const float* x, const uint8_t* labels,
                size_t batch);
  void Backward(std::span<const float> params, const float* x, size_t batch,
                std::span<float> grads);

  // Forward only; accumulates loss and accuracy over the batch. REQUIRES as above.
  EvalResult Evaluate(std::span<const float> params, const float* x, const uint8_t* labels,
                      size_t batch);

 private:
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<size_t> param_offsets_;  // start of each layer's slice in the parameter buffer
  size_t num_params_ = 0;
  size_t max_batch_ = 0;
  // acts_[i] is the input of layer i (B, in_i); acts_.back() holds the logits.
  std::vector<std::vector<float>> acts_;
  std::vector<std::vector<float>> grads_acts_;  // same shapes, dLoss/dacts
};

// Softmax cross-entropy on logits (B, C): returns the mean loss and writes dlogits (B, C) =
// (softmax - onehot) / B unless dlogits is null. Numerically stable (max subtracted).
float SoftmaxCrossEntropy(const float* logits, const uint8_t* labels, size_t batch,
                          size_t classes, float* dlogits);

}  // namespace pipesgd::layers
