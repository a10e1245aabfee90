// Max pooling on the CPU, with the argmax of every output kept in the workspace for Backward.
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
#include "layers/rng.h"

namespace pipesgd::layers {
namespace {

class MaxPool2d final : public Layer {
 public:
  MaxPool2d(const Shape& in, size_t kernel, size_t stride)
      : in_(in),
        kernel_(kernel),
        stride_(stride),
        out_{in.channels, (in.height - kernel) / stride + 1, (in.width - kernel) / stride + 1} {}

  std::string name() const override {
    return fmt::format("max_pool2d({}->{}, k{} s{})", ToString(in_), ToString(out_), kernel_,
                       stride_);
  }
  Shape in_shape() const override { return in_; }
  Shape out_shape() const override { return out_; }
  size_t num_params() const override { return 0; }
  // argmax (B, C, OH, OW) as int32: the index h*W + w within the input plane.
  size_t workspace_bytes(size_t batch) const override {
    return batch * out_.size() * sizeof(int32_t);
  }

  void Init(std::span<float> params, Rng& rng) const override {
    PSGD_CHECK_EQ(params.size(), size_t{0});
  }

  void Forward(std::span<const float> params, const float* x, float* y,
               const Pass& pass) const override {
    PSGD_CHECK_GE(pass.workspace.size(), workspace_bytes(pass.batch));
    int32_t* argmax = reinterpret_cast<int32_t*>(pass.workspace.data());
    const size_t planes = pass.batch * in_.channels;
    const size_t in_plane = in_.height * in_.width, out_plane = out_.height * out_.width;
    for (size_t pl = 0; pl < planes; pl++) {
      const float* x_pl = x + pl * in_plane;
      float* y_pl = y + pl * out_plane;
      int32_t* a_pl = argmax + pl * out_plane;
      for (size_t i = 0; i < out_.height; i++) {
        for (size_t j = 0; j < out_.width; j++) {
          size_t best = i * stride_ * in_.width + j * stride_;
          float best_value = x_pl[best];
          for (size_t p = 0; p < kernel_; p++) {
            const size_t row = (i * stride_ + p) * in_.width + j * stride_;
            for (size_t q = 0; q < kernel_; q++) {
              const float v = x_pl[row + q];
              // PyTorch's CPU rule: a value replaces the running max iff it is greater or NaN,
              // so the first of equal maxima wins and a NaN propagates.
              if (v > best_value || std::isnan(v)) {
                best_value = v;
                best = row + q;
              }
            }
          }
          y_pl[i * out_.width + j] = best_value;
          a_pl[i * out_.width + j] = static_cast<int32_t>(best);
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
    const size_t planes = pass.batch * in_.channels;
    const size_t in_plane = in_.height * in_.width, out_plane = out_.height * out_.width;
    std::memset(dx, 0, planes * in_plane * sizeof(float));
    for (size_t pl = 0; pl < planes; pl++) {
      float* dx_pl = dx + pl * in_plane;
      const float* dy_pl = dy + pl * out_plane;
      const int32_t* a_pl = argmax + pl * out_plane;
      // Summed, in output order, where overlapping windows (stride < kernel) share a maximum.
      for (size_t k = 0; k < out_plane; k++) dx_pl[a_pl[k]] += dy_pl[k];
    }
  }

 private:
  Shape in_;
  size_t kernel_;
  size_t stride_;
  Shape out_;
};

}  // namespace

std::unique_ptr<Layer> MakeMaxPool2d(const Shape& in, size_t kernel, size_t stride) {
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
  return std::make_unique<MaxPool2d>(in, kernel, stride);
}

}  // namespace pipesgd::layers
