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
// The threads an sgemm call may use (openblas_get_num_threads); 0 for a CBLAS that cannot say.
int BlasThreads();
// Sets it for every thread (openblas_set_num_threads); false for a CBLAS that cannot, or a
// count below 1.
bool SetBlasThreads(int threads);
// The convolution and pooling kernels model.kernels = AUTO picks in this build, for
// `pipesgd info` and the worker's log: "onednn (oneDNN 2.6.3, OpenMP, 1 thread(s))".
std::string CpuKernelsDescription();

struct EvalResult {
  double loss_sum = 0;  // sum over samples of the cross-entropy (natural log)
  int64_t correct = 0;  // samples whose argmax equals the label
  int64_t count = 0;
};

// Where a training batch sits in the run, for layers that draw random numbers (Dropout): layer
// i gets Pass::key = RandomKey(seed, step, i) and Pass::first_row = first_row (core/base/rng.h).
struct BatchKey {
  uint64_t seed = 0;       // the run's seed (train.seed)
  uint64_t step = 0;       // global step
  uint64_t first_row = 0;  // global row of this rank's first sample (rank * per-rank batch)
};

class Model {
 public:
  // `layers` in order; each layer's in_shape must equal the previous out_shape
  // (Error kInvalidArgument otherwise, naming both layers and both shapes). The last layer's
  // out_features is the number of classes. `max_batch` bounds the batch of every later call
  // (activations and workspaces are allocated once).
  Model(std::vector<std::unique_ptr<Layer>> layers, size_t max_batch);

  size_t num_params() const { return num_params_; }
  Shape in_shape() const;
  size_t in_features() const { return in_shape().size(); }
  size_t num_classes() const;
  size_t max_batch() const { return max_batch_; }
  // e.g. "linear(784->256) relu linear(256->128) relu linear(128->10): 235146 params".
  std::string Describe() const;
  // Bytes held for activations, their gradients and the layers' workspaces (at max_batch).
  size_t scratch_bytes() const;

  // The layers' weight matrices in the parameter buffer, in layer order.
  struct ParamMatrix {
    size_t offset = 0, rows = 0, cols = 0;
  };
  std::vector<ParamMatrix> WeightMatrices() const;

  // Writes the initial parameters for `seed` (same seed -> bitwise same params, on any rank).
  void Init(std::span<float> params, uint64_t seed) const;

  // One training forward and backward pass on x (B, in) with labels (B) in [0, num_classes):
  // OVERWRITES grads (num_params) with the gradient of the MEAN loss over the batch and returns
  // that mean loss. `key` seeds the random layers (same key -> bitwise same result).
  // REQUIRES: 1 <= batch <= max_batch, labels in range.
  float ForwardBackward(std::span<const float> params, const float* x, const uint8_t* labels,
                        size_t batch, std::span<float> grads, const BatchKey& key = {});
  // The same in two halves, for callers that time them separately (the timeline): Forward
  // stores the activations and the loss gradient and returns the mean loss; Backward
  // (REQUIRES: right after Forward with the same params, x, batch and key) writes grads.
  float Forward(std::span<const float> params, const float* x, const uint8_t* labels,
                size_t batch, const BatchKey& key = {});
  void Backward(std::span<const float> params, const float* x, size_t batch,
                std::span<float> grads, const BatchKey& key = {});

  // Forward only, in evaluation mode (Dropout is the identity); accumulates loss and accuracy
  // over the batch. REQUIRES as above.
  EvalResult Evaluate(std::span<const float> params, const float* x, const uint8_t* labels,
                      size_t batch);

 private:
  // Runs every layer forward; leaves the logits in acts_.back().
  void ForwardAll(std::span<const float> params, const float* x, size_t batch, bool training,
                  const BatchKey& key);
  Pass LayerPass(size_t i, size_t batch, bool training, const BatchKey& key);
  std::span<const float> LayerParams(std::span<const float> params, size_t i) const {
    return params.subspan(param_offsets_[i], layers_[i]->num_params());
  }

  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<size_t> param_offsets_;  // start of each layer's slice in the parameter buffer
  size_t num_params_ = 0;
  size_t max_batch_ = 0;
  // acts_[i] is the input of layer i (B, in_i); acts_.back() holds the logits.
  std::vector<std::vector<float>> acts_;
  std::vector<std::vector<float>> grads_acts_;  // same shapes, dLoss/dacts
  // workspaces_[i] is layer i's Pass::workspace (workspace_bytes(max_batch) bytes; operator new
  // aligns it for any scalar type).
  std::vector<std::vector<std::byte>> workspaces_;
};

// Softmax cross-entropy on logits (B, C): returns the mean loss and writes dlogits (B, C) =
// (softmax - onehot) / B unless dlogits is null. Numerically stable (max subtracted).
float SoftmaxCrossEntropy(const float* logits, const uint8_t* labels, size_t batch,
                          size_t classes, float* dlogits);

}  // namespace pipesgd::layers
