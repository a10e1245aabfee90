// What every implementation of conv2d and max_pool2d shares (the im2col + OpenBLAS reference,
// oneDNN's, and the CUDA twins in layers/cuda/): the output shape, the name, the parameter
// layout and its initialisation, so that they describe and initialise themselves identically.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "layers/layer.h"
#include "core/base/rng.h"

namespace pipesgd::layers {

// Conv2d of `in` with a square kernel, stride and zero padding (layer.h, MakeConv2d).
struct Conv2dGeometry {
  Conv2dGeometry(const Shape& in, size_t out_channels, size_t kernel, size_t stride,
                 size_t padding);

  Shape in, out;
  size_t out_channels, kernel, stride, padding;
  size_t patch;   // C * K * K: the fan-in, one column of im2col
  size_t pixels;  // OH * OW

  std::string name() const;  // "conv2d(1x28x28->16x28x28, k5 s1 p2)"
  size_t num_params() const { return out_channels * patch + out_channels; }
  // PyTorch's nn.Conv2d.reset_parameters: kaiming_uniform(a=sqrt(5)) for W reduces to
  // U(-1/sqrt(fan_in), 1/sqrt(fan_in)) and b uses the same bound. One draw per float, W
  // row-major first, then b.
  void Init(std::span<float> params, Rng& rng) const;
};

// MaxPool2d of `in` over kernel x kernel windows, no padding, floor mode (MakeMaxPool2d).
struct MaxPool2dGeometry {
  MaxPool2dGeometry(const Shape& in, size_t kernel, size_t stride);

  Shape in, out;
  size_t kernel, stride;

  std::string name() const;  // "max_pool2d(16x28x28->16x14x14, k2 s2)"
};

// The oneDNN layers (layers/onednn_*.cc); they take the arguments MakeConv2d / MakeMaxPool2d
// have checked. In a build without oneDNN they throw Error(kUnavailable) naming the layer and
// its input.
std::unique_ptr<Layer> MakeOneDnnConv2d(const Shape& in, size_t out_channels, size_t kernel,
                                        size_t stride, size_t padding);
std::unique_ptr<Layer> MakeOneDnnMaxPool2d(const Shape& in, size_t kernel, size_t stride);

// The Layer methods a CPU convolution takes from its geometry.
class Conv2dLayer : public Layer {
 public:
  explicit Conv2dLayer(const Conv2dGeometry& geom) : g_(geom) {}
  std::string name() const final { return g_.name(); }
  Shape in_shape() const final { return g_.in; }
  Shape out_shape() const final { return g_.out; }
  size_t num_params() const final { return g_.num_params(); }
  WeightMatrix weight_matrix() const final { return {g_.out_channels, g_.patch}; }
  void Init(std::span<float> params, Rng& rng) const final { g_.Init(params, rng); }

 protected:
  const Conv2dGeometry g_;
};

// The same for a CPU max pooling (no parameters).
class MaxPool2dLayer : public Layer {
 public:
  explicit MaxPool2dLayer(const MaxPool2dGeometry& geom) : g_(geom) {}
  std::string name() const final { return g_.name(); }
  Shape in_shape() const final { return g_.in; }
  Shape out_shape() const final { return g_.out; }
  size_t num_params() const final { return 0; }
  void Init(std::span<float> params, Rng& rng) const final;

 protected:
  const MaxPool2dGeometry g_;
};

}  // namespace pipesgd::layers
