// Layers on the CPU (OpenBLAS sgemm), written as stateless functions of their parameters so that
// one contiguous parameter buffer and one contiguous gradient buffer cover the whole model
// (llm.c's arenas): the trainer can AllReduce the gradient in one call and keep several gradient
// buffers (one per pipeline slot) without copying.
//
// Shapes are row-major: x (B, in) means B samples of `in` floats each. Layers know nothing of the
// network or of training; see layers/model.h for the stack and the loss.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "layers/rng.h"

namespace pipesgd::layers {

class Layer {
 public:
  virtual ~Layer() = default;

  // Human-readable, e.g. "linear(784->256)".
  virtual std::string name() const = 0;
  virtual size_t in_features() const = 0;
  virtual size_t out_features() const = 0;
  // Number of float parameters this layer owns in the model's parameter buffer.
  virtual size_t num_params() const = 0;

  // Writes the seeded initial parameters (num_params floats).
  virtual void Init(std::span<float> params, Rng& rng) const = 0;

  // y (B, out) = layer(x (B, in)).
  virtual void Forward(std::span<const float> params, const float* x, float* y,
                       size_t batch) const = 0;

  // Given the forward input x (B, in), output y (B, out) and upstream gradient dy (B, out):
  // OVERWRITES grads (num_params floats) with dLoss/dparams, and writes dx (B, in) unless dx is
  // null (the first layer needs no input gradient).
  virtual void Backward(std::span<const float> params, const float* x, const float* y,
                        const float* dy, std::span<float> grads, float* dx,
                        size_t batch) const = 0;
};

// Fully connected: y = x W^T + b, W (out, in) row-major, then b (out). Parameters laid out as
// [W, b]. Init as PyTorch's nn.Linear: W, b ~ U(-1/sqrt(in), 1/sqrt(in)).
std::unique_ptr<Layer> MakeLinear(size_t in_features, size_t out_features);

// y = max(x, 0); no parameters. The gradient at exactly 0 is 0.
std::unique_ptr<Layer> MakeRelu(size_t features);

}  // namespace pipesgd::layers
