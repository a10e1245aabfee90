// Max pooling on the CPU, with the argmax of every output kept in the workspace for Backward:
// the reference for onednn_max_pool2d.cc, and the layer of builds without oneDNN.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "layers/layer.h"
#include "core/base/rng.h"
#include "layers/spatial.h"

namespace pipesgd::layers {
namespace {

class MaxPool2d final : public MaxPool2dLayer {
 public:
  explicit MaxPool2d(const MaxPool2dGeometry& geom) : MaxPool2dLayer(geom) {}

  // argmax (B, C, OH, OW) as int32: the index h*W + w within the input plane.
  size_t workspace_bytes(size_t batch) const override {
    return batch * g_.out.size() * sizeof(int32_t);
  }

  void Forward(std::span<const float> params, const float* x, float* y,
               const Pass& pass) const override {
    PSGD_CHECK_GE(pass.workspace.size(), workspace_bytes(pass.batch));
    int32_t* argmax = reinterpret_cast<int32_t*>(pass.workspace.data());
    const size_t planes = pass.batch * g_.in.channels;
    const size_t in_plane = g_.in.height * g_.in.width, out_plane = g_.out.height * g_.out.width;
    for (size_t pl = 0; pl < planes; pl++) {
      const float* x_pl = x + pl * in_plane;
      float* y_pl = y + pl * out_plane;
      int32_t* a_pl = argmax + pl * out_plane;
      for (size_t i = 0; i < g_.out.height; i++) {
        for (size_t j = 0; j < g_.out.width; j++) {
          size_t best = i * g_.stride * g_.in.width + j * g_.stride;
          float best_value = x_pl[best];
          for (size_t p = 0; p < g_.kernel; p++) {
            const size_t row = (i * g_.stride + p) * g_.in.width + j * g_.stride;
            for (size_t q = 0; q < g_.kernel; q++) {
              const float v = x_pl[row + q];
              // PyTorch's CPU rule: a value replaces the running max iff it is greater or NaN,
              // so the first of equal maxima wins and a NaN propagates.
              if (v > best_value || std::isnan(v)) {
                best_value = v;
                best = row + q;
              }
            }
          }
          y_pl[i * g_.out.width + j] = best_value;
          a_pl[i * g_.out.width + j] = static_cast<int32_t>(best);
        }
      }
    }
  }

  void Backward(std::span<const float> params, const float* x, const float* y, const float* dy,
                std::span<float> grads, float* dx, const Pass& pass) const override {
    PSGD_CHECK_EQ(grads.size(), size_t{0});
    if (dx == nullptr) return;
    PSGD_CHECK_GE(pass.workspace.size(), workspace_bytes(pass.batch));
    const int32_t* argmax = reinterpret_cast<const int32_t*>(pass.workspace.data());
    const size_t planes = pass.batch * g_.in.channels;
    const size_t in_plane = g_.in.height * g_.in.width, out_plane = g_.out.height * g_.out.width;
    std::memset(dx, 0, planes * in_plane * sizeof(float));
    for (size_t pl = 0; pl < planes; pl++) {
      float* dx_pl = dx + pl * in_plane;
      const float* dy_pl = dy + pl * out_plane;
      const int32_t* a_pl = argmax + pl * out_plane;
      // Summed, in output order, where overlapping windows (stride < kernel) share a maximum.
      for (size_t k = 0; k < out_plane; k++) dx_pl[a_pl[k]] += dy_pl[k];
    }
  }
};

}  // namespace

std::unique_ptr<Layer> MakeMaxPool2d(const Shape& in, size_t kernel, size_t stride,
                                     CpuKernels kernels) {
  if (in.size() == 0 || kernel == 0 || stride == 0) {
    Throw(ErrorCode::kInvalidArgument,
          "max_pool2d on input {} with kernel {}, stride {}: expected every one of them >= 1",
          ToString(in), kernel, stride);
  }
  if (kernel > in.height || kernel > in.width) {
    Throw(ErrorCode::kInvalidArgument,
          "max_pool2d kernel {} is larger than its input {} (height x width {}x{}): expected "
          "kernel <= {}",
          kernel, ToString(in), in.height, in.width, std::min(in.height, in.width));
  }
  if (kernels == CpuKernels::kOneDnn) {
    return MakeOneDnnMaxPool2d(in, kernel, stride);
  }
  return std::make_unique<MaxPool2d>(MaxPool2dGeometry(in, kernel, stride));
}

}  // namespace pipesgd::layers
