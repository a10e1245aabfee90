// GPU Conv2d, MaxPool2d, Dropout and Flatten: the CUDA twins of layers/conv2d.cc,
// max_pool2d.cc, dropout.cc and Flatten (layers/layer.h), same parameter layout, same
// semantics. Checked against the CPU layers on an H200 (tests/cuda_layers_test.cc).
#include <climits>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "layers/cuda/cnn_kernels.h"
#include "layers/cuda/cublas_loader.h"
#include "layers/cuda/cuda_model.h"

namespace pipesgd::cuda {
namespace {

using layers::Pass;
using layers::Shape;

int Int(size_t n) {
  PSGD_CHECK_LE(n, static_cast<size_t>(INT_MAX));
  return static_cast<int>(n);
}

// Convolution as im2col + one strided-batched GEMM per direction (cuBLAS), col for the whole
// batch in the workspace: W (OC, patch) row-major, col_n (patch, P), y_n (OC, P).
class CudaConv2d final : public CudaLayer {
 public:
  CudaConv2d(const Shape& in, size_t out_channels, size_t kernel, size_t stride, size_t padding)
      : in_(in), out_channels_(out_channels), kernel_(kernel), stride_(stride), padding_(padding) {
    out_ = {out_channels, (in.height + 2 * padding - kernel) / stride + 1,
            (in.width + 2 * padding - kernel) / stride + 1};
    patch_ = in.channels * kernel * kernel;
    pixels_ = out_.height * out_.width;
    g_ = {Int(in.channels), Int(in.height), Int(in.width), Int(kernel), Int(stride),
          Int(padding), Int(out_.height), Int(out_.width)};
  }
  std::string name() const override {
    return fmt::format("conv2d({}->{}, k{} s{} p{})", layers::ToString(in_),
                       layers::ToString(out_), kernel_, stride_, padding_);
  }
  Shape in_shape() const override { return in_; }
  Shape out_shape() const override { return out_; }
  size_t num_params() const override { return out_channels_ * patch_ + out_channels_; }
  // col (B, patch, P), then the bias partial sums (B, OC).
  size_t workspace_bytes(size_t batch) const override {
    return (batch * patch_ * pixels_ + batch * out_channels_) * sizeof(float);
  }

  void Forward(Context& ctx, const float* params, const float* x, float* y,
               const Pass& pass) override {
    const int device = ctx.device();
    const float* w = params;
    const float* b = params + out_channels_ * patch_;
    float* col = Col(pass);
    PSGD_CUDA(kernels::Im2col(x, col, pass.batch, g_, ctx.stream()));
    PSGD_CUDA(kernels::FillBias(y, b, pass.batch, out_channels_, pixels_, ctx.stream()));
    const float one = 1.0f;
    // Row-major y_n (OC, P) += W (OC, patch) col_n (patch, P)  <=>  column-major
    // y_n^T (P, OC) += col_n^T (P, patch) W^T (patch, OC); the column-major views of col_n and W
    // are exactly col_n^T and W^T, so no operand is transposed.
    PSGD_CUBLAS(Cublas().sgemm_strided_batched(
        ctx.cublas(), CUBLAS_OP_N, CUBLAS_OP_N, Int(pixels_), Int(out_channels_), Int(patch_),
        &one, col, Int(pixels_), static_cast<long long>(patch_ * pixels_), w, Int(patch_), 0,
        &one, y, Int(pixels_), static_cast<long long>(out_channels_ * pixels_), Int(pass.batch)));
  }

  void Backward(Context& ctx, const float* params, const float* x, const float* y,
                const float* dy, float* grads, float* dx, const Pass& pass) override {
    const int device = ctx.device();
    const float* w = params;
    float* dw = grads;
    float* db = grads + out_channels_ * patch_;
    float* col = Col(pass);
    PSGD_CUDA(kernels::Im2col(x, col, pass.batch, g_, ctx.stream()));
    const float one = 1.0f, zero = 0.0f;
    // dW (OC, patch) = sum_n dy_n (OC, P) col_n^T (P, patch), samples in order (the first
    // overwrites). Column-major: dW^T (patch, OC) = col_n (patch, P) dy_n^T (P, OC); col_n is
    // the transpose of its column-major view (op T), dy_n^T is dy_n's view (op N).
    for (size_t n = 0; n < pass.batch; ++n) {
      PSGD_CUBLAS(Cublas().sgemm(ctx.cublas(), CUBLAS_OP_T, CUBLAS_OP_N, Int(patch_),
                              Int(out_channels_), Int(pixels_), &one, col + n * patch_ * pixels_,
                              Int(pixels_), dy + n * out_channels_ * pixels_, Int(pixels_),
                              n == 0 ? &zero : &one, dw, Int(patch_)));
    }
    PSGD_CUDA(kernels::ConvBiasGrad(dy, db, col + pass.batch * patch_ * pixels_, pass.batch,
                                    out_channels_, pixels_, ctx.stream()));
    if (dx == nullptr) return;
    // dcol_n (patch, P) = W^T (patch, OC) dy_n (OC, P)  <=>  column-major
    // dcol_n^T (P, patch) = dy_n^T (P, OC) W (OC, patch): dy_n's view as is (N), W's view
    // transposed (T). dcol reuses the col area (col is no longer needed).
    PSGD_CUBLAS(Cublas().sgemm_strided_batched(
        ctx.cublas(), CUBLAS_OP_N, CUBLAS_OP_T, Int(pixels_), Int(patch_), Int(out_channels_),
        &one, dy, Int(pixels_), static_cast<long long>(out_channels_ * pixels_), w, Int(patch_),
        0, &zero, col, Int(pixels_), static_cast<long long>(patch_ * pixels_), Int(pass.batch)));
    PSGD_CUDA(kernels::Col2im(col, dx, pass.batch, g_, ctx.stream()));
  }

 private:
  float* Col(const Pass& pass) const {
    PSGD_CHECK_GE(pass.workspace.size(), workspace_bytes(pass.batch));
    return reinterpret_cast<float*>(pass.workspace.data());
  }

  Shape in_, out_;
  size_t out_channels_, kernel_, stride_, padding_, patch_, pixels_;
  kernels::Window g_;
};

class CudaMaxPool2d final : public CudaLayer {
 public:
  CudaMaxPool2d(const Shape& in, size_t kernel, size_t stride)
      : in_(in), kernel_(kernel), stride_(stride) {
    out_ = {in.channels, (in.height - kernel) / stride + 1, (in.width - kernel) / stride + 1};
    g_ = {Int(in.channels), Int(in.height), Int(in.width), Int(kernel), Int(stride), 0,
          Int(out_.height), Int(out_.width)};
  }
  std::string name() const override {
    return fmt::format("max_pool2d({}->{}, k{} s{})", layers::ToString(in_),
                       layers::ToString(out_), kernel_, stride_);
  }
  Shape in_shape() const override { return in_; }
  Shape out_shape() const override { return out_; }
  size_t num_params() const override { return 0; }
  size_t workspace_bytes(size_t batch) const override {
    return batch * out_.size() * sizeof(int32_t);
  }
  void Forward(Context& ctx, const float*, const float* x, float* y, const Pass& pass) override {
    const int device = ctx.device();
    PSGD_CHECK_GE(pass.workspace.size(), workspace_bytes(pass.batch));
    PSGD_CUDA(kernels::MaxPoolForward(x, y, reinterpret_cast<int32_t*>(pass.workspace.data()),
                                      pass.batch, g_, ctx.stream()));
  }
  void Backward(Context& ctx, const float*, const float*, const float*, const float* dy, float*,
                float* dx, const Pass& pass) override {
    if (dx == nullptr) return;
    const int device = ctx.device();
    PSGD_CUDA(kernels::MaxPoolBackward(
        dy, reinterpret_cast<const int32_t*>(pass.workspace.data()), dx, pass.batch, g_,
        ctx.stream()));
  }

 private:
  Shape in_, out_;
  size_t kernel_, stride_;
  kernels::Window g_;
};

class CudaDropout final : public CudaLayer {
 public:
  CudaDropout(const Shape& shape, float p) : shape_(shape), p_(p), scale_(1.0f / (1.0f - p)) {}
  std::string name() const override { return fmt::format("dropout({})", p_); }
  Shape in_shape() const override { return shape_; }
  Shape out_shape() const override { return shape_; }
  size_t num_params() const override { return 0; }
  void Forward(Context& ctx, const float*, const float* x, float* y, const Pass& pass) override {
    Apply(ctx, x, y, pass);
  }
  void Backward(Context& ctx, const float*, const float*, const float*, const float* dy, float*,
                float* dx, const Pass& pass) override {
    if (dx != nullptr) Apply(ctx, dy, dx, pass);  // the same mask, recomputed from the Pass
  }

 private:
  void Apply(Context& ctx, const float* in, float* out, const Pass& pass) {
    const int device = ctx.device();
    const size_t n = pass.batch * shape_.size();
    if (!pass.training) {
      PSGD_CUDA(cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice,
                                ctx.stream()));
      return;
    }
    PSGD_CUDA(kernels::DropoutApply(in, out, n, pass.key, pass.first_row * shape_.size(), p_,
                                    scale_, ctx.stream()));
  }

  Shape shape_;
  float p_, scale_;
};

class CudaFlatten final : public CudaLayer {
 public:
  explicit CudaFlatten(const Shape& in) : in_(in) {}
  std::string name() const override { return "flatten"; }
  Shape in_shape() const override { return in_; }
  Shape out_shape() const override { return {in_.size(), 1, 1}; }
  size_t num_params() const override { return 0; }
  void Forward(Context& ctx, const float*, const float* x, float* y, const Pass& pass) override {
    const int device = ctx.device();
    PSGD_CUDA(cudaMemcpyAsync(y, x, pass.batch * in_.size() * sizeof(float),
                              cudaMemcpyDeviceToDevice, ctx.stream()));
  }
  void Backward(Context& ctx, const float*, const float*, const float*, const float* dy, float*,
                float* dx, const Pass& pass) override {
    if (dx == nullptr) return;
    const int device = ctx.device();
    PSGD_CUDA(cudaMemcpyAsync(dx, dy, pass.batch * in_.size() * sizeof(float),
                              cudaMemcpyDeviceToDevice, ctx.stream()));
  }

 private:
  Shape in_;
};

}  // namespace

std::unique_ptr<CudaLayer> MakeCudaConv2d(const Shape& in, size_t out_channels, size_t kernel,
                                          size_t stride, size_t padding) {
  // The CPU factory validates (and throws the same errors); the twin only computes.
  layers::MakeConv2d(in, out_channels, kernel, stride, padding);
  return std::make_unique<CudaConv2d>(in, out_channels, kernel, stride, padding);
}
std::unique_ptr<CudaLayer> MakeCudaMaxPool2d(const Shape& in, size_t kernel, size_t stride) {
  layers::MakeMaxPool2d(in, kernel, stride);
  return std::make_unique<CudaMaxPool2d>(in, kernel, stride);
}
std::unique_ptr<CudaLayer> MakeCudaDropout(const Shape& shape, float p) {
  layers::MakeDropout(shape, p);
  return std::make_unique<CudaDropout>(shape, p);
}
std::unique_ptr<CudaLayer> MakeCudaFlatten(const Shape& in) {
  layers::MakeFlatten(in);
  return std::make_unique<CudaFlatten>(in);
}

}  // namespace pipesgd::cuda
