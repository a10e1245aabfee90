// What the two GPU convolutions (im2col + cuBLAS in cuda_cnn.cc, cuDNN in cudnn_conv2d.cc)
// share with each other and with the CPU ones (layers/spatial.h): geometry, name, parameter
// layout, and the workspace bound.
#pragma once

#include <climits>
#include <cstddef>
#include <string>

#include "core/base/check.h"
#include "layers/cuda/cuda_model.h"
#include "layers/spatial.h"

namespace pipesgd::cuda {

// A size as the int that CUDA kernels, cuBLAS and cuDNN take; aborts with the value past INT_MAX.
inline int Int(size_t n) {
  PSGD_CHECK_LE(n, static_cast<size_t>(INT_MAX));
  return static_cast<int>(n);
}

class CudaConv2dLayer : public CudaLayer {
 public:
  explicit CudaConv2dLayer(const layers::Conv2dGeometry& geom) : geom_(geom) {}
  std::string name() const final { return geom_.name(); }
  layers::Shape in_shape() const final { return geom_.in; }
  layers::Shape out_shape() const final { return geom_.out; }
  size_t num_params() const final { return geom_.num_params(); }
  // The im2col path's columns for the whole batch (B, patch, OH*OW), then the bias partial
  // sums (B, OC); cuDNN's scratch is held to the same bound.
  size_t workspace_bytes(size_t batch) const final {
    return (batch * geom_.patch * geom_.pixels + batch * geom_.out_channels) * sizeof(float);
  }

 protected:
  const layers::Conv2dGeometry geom_;
};

}  // namespace pipesgd::cuda
