// 2-D convolution on the CPU: im2col + OpenBLAS sgemm, one sample at a time (Chellapilla,
// Puri, Simard 2006, "High Performance Convolutional Neural Networks for Document Processing").
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
#include "layers/rng.h"

namespace pipesgd::layers {
namespace {

blasint Int(size_t n) {
  PSGD_CHECK_LE(n, static_cast<size_t>(INT32_MAX));
  return static_cast<blasint>(n);
}

class Conv2d final : public Layer {
 public:
  Conv2d(const Shape& in, size_t out_channels, size_t kernel, size_t stride, size_t padding)
      : in_(in),
        out_channels_(out_channels),
        kernel_(kernel),
        stride_(stride),
        padding_(padding),
        out_{out_channels, (in.height + 2 * padding - kernel) / stride + 1,
             (in.width + 2 * padding - kernel) / stride + 1},
        patch_(in.channels * kernel * kernel),
        pixels_(out_.height * out_.width) {}

  std::string name() const override {
    return fmt::format("conv2d({}->{}, k{} s{} p{})", ToString(in_), ToString(out_), kernel_,
                       stride_, padding_);
  }
  Shape in_shape() const override { return in_; }
  Shape out_shape() const override { return out_; }
  size_t num_params() const override { return out_channels_ * patch_ + out_channels_; }
  WeightMatrix weight_matrix() const override { return {out_channels_, patch_}; }
  // One sample's columns and their gradient (patch x pixels floats each): im2col is recomputed
  // in Backward rather than kept for the whole batch, which would need batch times as much
  // memory (tens of MB at the evaluation batch) for a copy that costs little next to the sgemm.
  size_t workspace_bytes(size_t batch) const override {
    return 2 * patch_ * pixels_ * sizeof(float);
  }

  void Init(std::span<float> params, Rng& rng) const override {
    PSGD_CHECK_EQ(params.size(), num_params());
    // PyTorch's nn.Conv2d.reset_parameters: kaiming_uniform(a=sqrt(5)) for W reduces to
    // U(-1/sqrt(fan_in), 1/sqrt(fan_in)) and b uses the same bound; fan_in = C*K*K. One draw per
    // float, W row-major first, then b.
    const float bound = 1.0f / std::sqrt(static_cast<float>(patch_));
    for (float& p : params) p = rng.Uniform(-bound, bound);
  }

  void Forward(std::span<const float> params, const float* x, float* y,
               const Pass& pass) const override {
    PSGD_CHECK_EQ(params.size(), num_params());
    PSGD_CHECK_GE(pass.workspace.size(), workspace_bytes(pass.batch));
    const float* w = params.data();                          // (OC, patch)
    const float* b = params.data() + out_channels_ * patch_;  // (OC)
    float* col = Columns(pass);                              // (patch, pixels)
    for (size_t n = 0; n < pass.batch; n++) {
      Im2col(x + n * in_.size(), col);
      float* y_n = y + n * out_.size();  // (OC, pixels)
      // Bias first, then y_n += W (OC, patch) @ col (patch, pixels): sgemm adds onto it.
      for (size_t o = 0; o < out_channels_; o++) {
        float* row = y_n + o * pixels_;
        for (size_t i = 0; i < pixels_; i++) row[i] = b[o];
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Int(out_channels_), Int(pixels_),
                  Int(patch_), 1.0f, w, Int(patch_), col, Int(pixels_), 1.0f, y_n, Int(pixels_));
    }
  }

  void Backward(std::span<const float> params, const float* x, const float* y, const float* dy,
                std::span<float> grads, float* dx, const Pass& pass) const override {
    PSGD_CHECK_EQ(params.size(), num_params());
    PSGD_CHECK_EQ(grads.size(), num_params());
    PSGD_CHECK_GE(pass.workspace.size(), workspace_bytes(pass.batch));
    const float* w = params.data();                     // (OC, patch)
    float* dw = grads.data();                           // (OC, patch)
    float* db = grads.data() + out_channels_ * patch_;  // (OC)
    float* col = Columns(pass);                         // (patch, pixels)
    float* dcol = col + patch_ * pixels_;               // (patch, pixels)
    for (size_t o = 0; o < out_channels_; o++) db[o] = 0.0f;
    for (size_t n = 0; n < pass.batch; n++) {
      const float* dy_n = dy + n * out_.size();  // (OC, pixels)
      Im2col(x + n * in_.size(), col);
      // dW (OC, patch) (+)= dy_n (OC, pixels) @ col^T (pixels, patch); the first sample
      // overwrites (beta 0), so grads may hold anything on entry. Samples in batch order.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Int(out_channels_), Int(patch_),
                  Int(pixels_), 1.0f, dy_n, Int(pixels_), col, Int(pixels_), n == 0 ? 0.0f : 1.0f,
                  dw, Int(patch_));
      for (size_t o = 0; o < out_channels_; o++) {
        const float* row = dy_n + o * pixels_;
        float sum = 0.0f;
        for (size_t i = 0; i < pixels_; i++) sum += row[i];
        db[o] += sum;
      }
      if (dx != nullptr) {
        // dcol (patch, pixels) = W^T (patch, OC) @ dy_n (OC, pixels), scattered back onto dx_n.
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Int(patch_), Int(pixels_),
                    Int(out_channels_), 1.0f, w, Int(patch_), dy_n, Int(pixels_), 0.0f, dcol,
                    Int(pixels_));
        Col2im(dcol, dx + n * in_.size());
      }
    }
  }

 private:
  float* Columns(const Pass& pass) const {
    return reinterpret_cast<float*>(pass.workspace.data());
  }

  // col (patch, pixels): row (c, p, q), column (i, j) holds x[c][i*S + p - P][j*S + q - P], or 0
  // where that falls in the padding.
  void Im2col(const float* x, float* col) const {
    const ptrdiff_t h = static_cast<ptrdiff_t>(in_.height), w = static_cast<ptrdiff_t>(in_.width);
    for (size_t c = 0; c < in_.channels; c++) {
      const float* plane = x + c * in_.height * in_.width;
      for (size_t p = 0; p < kernel_; p++) {
        for (size_t q = 0; q < kernel_; q++) {
          float* out = col + ((c * kernel_ + p) * kernel_ + q) * pixels_;
          for (size_t i = 0; i < out_.height; i++) {
            const ptrdiff_t r = static_cast<ptrdiff_t>(i * stride_ + p) -
                                static_cast<ptrdiff_t>(padding_);
            float* out_row = out + i * out_.width;
            if (r < 0 || r >= h) {
              std::memset(out_row, 0, out_.width * sizeof(float));
              continue;
            }
            const float* in_row = plane + r * w;
            for (size_t j = 0; j < out_.width; j++) {
              const ptrdiff_t s = static_cast<ptrdiff_t>(j * stride_ + q) -
                                  static_cast<ptrdiff_t>(padding_);
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
    std::memset(dx, 0, in_.size() * sizeof(float));
    const ptrdiff_t h = static_cast<ptrdiff_t>(in_.height), w = static_cast<ptrdiff_t>(in_.width);
    for (size_t c = 0; c < in_.channels; c++) {
      float* plane = dx + c * in_.height * in_.width;
      for (size_t p = 0; p < kernel_; p++) {
        for (size_t q = 0; q < kernel_; q++) {
          const float* in = dcol + ((c * kernel_ + p) * kernel_ + q) * pixels_;
          for (size_t i = 0; i < out_.height; i++) {
            const ptrdiff_t r = static_cast<ptrdiff_t>(i * stride_ + p) -
                                static_cast<ptrdiff_t>(padding_);
            if (r < 0 || r >= h) continue;
            const float* in_row = in + i * out_.width;
            float* out_row = plane + r * w;
            for (size_t j = 0; j < out_.width; j++) {
              const ptrdiff_t s = static_cast<ptrdiff_t>(j * stride_ + q) -
                                  static_cast<ptrdiff_t>(padding_);
              if (s >= 0 && s < w) out_row[s] += in_row[j];
            }
          }
        }
      }
    }
  }

  Shape in_;
  size_t out_channels_;
  size_t kernel_;
  size_t stride_;
  size_t padding_;
  Shape out_;
  size_t patch_;   // C * K * K: one column of im2col
  size_t pixels_;  // OH * OW
};

}  // namespace

std::unique_ptr<Layer> MakeConv2d(const Shape& in, size_t out_channels, size_t kernel,
                                  size_t stride, size_t padding) {
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
  return std::make_unique<Conv2d>(in, out_channels, kernel, stride, padding);
}

}  // namespace pipesgd::layers
