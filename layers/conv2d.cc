// 2-D convolution on the CPU: im2col + OpenBLAS sgemm, one sample at a time (Chellapilla,
// Puri, Simard 2006, "High Performance Convolutional Neural Networks for Document Processing").
// The reference the oneDNN layer (onednn_conv2d.cc) is tested against; MakeConv2d picks.
// Parameters [W (OC, C, K, K), b (OC)].
#include <cblas.h>

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

blasint Int(size_t n) {
  PSGD_CHECK_LE(n, static_cast<size_t>(INT32_MAX));
  return static_cast<blasint>(n);
}

class Conv2d final : public Conv2dLayer {
 public:
  explicit Conv2d(const Conv2dGeometry& geom) : Conv2dLayer(geom) {}

  // One sample's columns and their gradient (patch x pixels floats each): im2col is recomputed
  // in Backward rather than kept for the whole batch, which would need batch times as much
  // memory (tens of MB at the evaluation batch) for a copy that costs little next to the sgemm.
  size_t workspace_bytes(size_t batch) const override {
    return 2 * g_.patch * g_.pixels * sizeof(float);
  }

  void Forward(std::span<const float> params, const float* x, float* y,
               const Pass& pass) const override {
    PSGD_CHECK_EQ(params.size(), num_params());
    PSGD_CHECK_GE(pass.workspace.size(), workspace_bytes(pass.batch));
    const float* w = params.data();                               // (OC, patch)
    const float* b = params.data() + g_.out_channels * g_.patch;  // (OC)
    float* col = Columns(pass);                                   // (patch, pixels)
    for (size_t n = 0; n < pass.batch; n++) {
      Im2col(x + n * g_.in.size(), col);
      float* y_n = y + n * g_.out.size();  // (OC, pixels)
      // Bias first, then y_n += W (OC, patch) @ col (patch, pixels): sgemm adds onto it.
      for (size_t o = 0; o < g_.out_channels; o++) {
        float* row = y_n + o * g_.pixels;
        for (size_t i = 0; i < g_.pixels; i++) row[i] = b[o];
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Int(g_.out_channels), Int(g_.pixels),
                  Int(g_.patch), 1.0f, w, Int(g_.patch), col, Int(g_.pixels), 1.0f, y_n,
                  Int(g_.pixels));
    }
  }

  void Backward(std::span<const float> params, const float* x, const float* y, const float* dy,
                std::span<float> grads, float* dx, const Pass& pass) const override {
    PSGD_CHECK_EQ(params.size(), num_params());
    PSGD_CHECK_EQ(grads.size(), num_params());
    PSGD_CHECK_GE(pass.workspace.size(), workspace_bytes(pass.batch));
    const float* w = params.data();                         // (OC, patch)
    float* dw = grads.data();                               // (OC, patch)
    float* db = grads.data() + g_.out_channels * g_.patch;  // (OC)
    float* col = Columns(pass);                             // (patch, pixels)
    float* dcol = col + g_.patch * g_.pixels;               // (patch, pixels)
    for (size_t o = 0; o < g_.out_channels; o++) db[o] = 0.0f;
    for (size_t n = 0; n < pass.batch; n++) {
      const float* dy_n = dy + n * g_.out.size();  // (OC, pixels)
      Im2col(x + n * g_.in.size(), col);
      // dW (OC, patch) (+)= dy_n (OC, pixels) @ col^T (pixels, patch); the first sample
      // overwrites (beta 0), so grads may hold anything on entry. Samples in batch order.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Int(g_.out_channels), Int(g_.patch),
                  Int(g_.pixels), 1.0f, dy_n, Int(g_.pixels), col, Int(g_.pixels),
                  n == 0 ? 0.0f : 1.0f, dw, Int(g_.patch));
      for (size_t o = 0; o < g_.out_channels; o++) {
        const float* row = dy_n + o * g_.pixels;
        float sum = 0.0f;
        for (size_t i = 0; i < g_.pixels; i++) sum += row[i];
        db[o] += sum;
      }
      if (dx != nullptr) {
        // dcol (patch, pixels) = W^T (patch, OC) @ dy_n (OC, pixels), scattered back onto dx_n.
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Int(g_.patch), Int(g_.pixels),
                    Int(g_.out_channels), 1.0f, w, Int(g_.patch), dy_n, Int(g_.pixels), 0.0f, dcol,
                    Int(g_.pixels));
        Col2im(dcol, dx + n * g_.in.size());
      }
    }
  }

 private:
  float* Columns(const Pass& pass) const { return reinterpret_cast<float*>(pass.workspace.data()); }

  // col (patch, pixels): row (c, p, q), column (i, j) holds x[c][i*S + p - P][j*S + q - P], or 0
  // where that falls in the padding.
  void Im2col(const float* x, float* col) const {
    const ptrdiff_t h = static_cast<ptrdiff_t>(g_.in.height),
                    w = static_cast<ptrdiff_t>(g_.in.width);
    for (size_t c = 0; c < g_.in.channels; c++) {
      const float* plane = x + c * g_.in.height * g_.in.width;
      for (size_t p = 0; p < g_.kernel; p++) {
        for (size_t q = 0; q < g_.kernel; q++) {
          float* out = col + ((c * g_.kernel + p) * g_.kernel + q) * g_.pixels;
          for (size_t i = 0; i < g_.out.height; i++) {
            const ptrdiff_t r =
                static_cast<ptrdiff_t>(i * g_.stride + p) - static_cast<ptrdiff_t>(g_.padding);
            float* out_row = out + i * g_.out.width;
            if (r < 0 || r >= h) {
              std::memset(out_row, 0, g_.out.width * sizeof(float));
              continue;
            }
            const float* in_row = plane + r * w;
            for (size_t j = 0; j < g_.out.width; j++) {
              const ptrdiff_t s =
                  static_cast<ptrdiff_t>(j * g_.stride + q) - static_cast<ptrdiff_t>(g_.padding);
              out_row[j] = s < 0 || s >= w ? 0.0f : in_row[s];
            }
          }
        }
      }
    }
  }

  // The adjoint of Im2col: dx (C, H, W) = sum of dcol over every (row, column) that read the
  // pixel; padding positions are dropped.
  void Col2im(const float* dcol, float* dx) const {
    std::memset(dx, 0, g_.in.size() * sizeof(float));
    const ptrdiff_t h = static_cast<ptrdiff_t>(g_.in.height),
                    w = static_cast<ptrdiff_t>(g_.in.width);
    for (size_t c = 0; c < g_.in.channels; c++) {
      float* plane = dx + c * g_.in.height * g_.in.width;
      for (size_t p = 0; p < g_.kernel; p++) {
        for (size_t q = 0; q < g_.kernel; q++) {
          const float* in = dcol + ((c * g_.kernel + p) * g_.kernel + q) * g_.pixels;
          for (size_t i = 0; i < g_.out.height; i++) {
            const ptrdiff_t r =
                static_cast<ptrdiff_t>(i * g_.stride + p) - static_cast<ptrdiff_t>(g_.padding);
            if (r < 0 || r >= h) continue;
            const float* in_row = in + i * g_.out.width;
            float* out_row = plane + r * w;
            for (size_t j = 0; j < g_.out.width; j++) {
              const ptrdiff_t s =
                  static_cast<ptrdiff_t>(j * g_.stride + q) - static_cast<ptrdiff_t>(g_.padding);
              if (s >= 0 && s < w) out_row[s] += in_row[j];
            }
          }
        }
      }
    }
  }
};

}  // namespace

std::unique_ptr<Layer> MakeConv2d(const Shape& in, size_t out_channels, size_t kernel,
                                  size_t stride, size_t padding, CpuKernels kernels) {
  if (in.size() == 0 || out_channels == 0 || kernel == 0 || stride == 0) {
    Throw(ErrorCode::kInvalidArgument,
          "conv2d on input {} with out_channels {}, kernel {}, stride {}: expected every one "
          "of them >= 1",
          ToString(in), out_channels, kernel, stride);
  }
  if (kernel > in.height + 2 * padding || kernel > in.width + 2 * padding) {
    Throw(ErrorCode::kInvalidArgument,
          "conv2d kernel {} is larger than its padded input {}x{} (input {}, padding {}): "
          "expected kernel <= {}",
          kernel, in.height + 2 * padding, in.width + 2 * padding, ToString(in), padding,
          std::min(in.height, in.width) + 2 * padding);
  }
  if (kernels == CpuKernels::kOneDnn) {
    return MakeOneDnnConv2d(in, out_channels, kernel, stride, padding);
  }
  return std::make_unique<Conv2d>(Conv2dGeometry(in, out_channels, kernel, stride, padding));
}

}  // namespace pipesgd::layers
