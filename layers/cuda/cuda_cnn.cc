// GPU Conv2d, MaxPool2d, Dropout and Flatten: the CUDA twins of layers/conv2d.cc,
// max_pool2d.cc, dropout.cc and Flatten (layers/layer.h), same parameter layout, same
// semantics. Checked against the CPU layers on an H200 (tests/cuda_layers_test.cc).
#include <memory>
#include <string>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "layers/cuda/cnn_kernels.h"
#include "layers/cuda/cublas_loader.h"
#include "layers/cuda/cuda_model.h"
#include "layers/cuda/spatial.h"
#ifdef PIPESGD_HAVE_CUDNN
#include "layers/cuda/cudnn_loader.h"
#endif

namespace pipesgd::cuda {
namespace {

using layers::Pass;
using layers::Shape;

// Convolution as im2col + one strided-batched GEMM per direction (cuBLAS), col for the whole
// batch in the workspace: W (OC, patch) row-major, col_n (patch, P), y_n (OC, P).
class CudaConv2d final : public CudaConv2dLayer {
 public:
  explicit CudaConv2d(const layers::Conv2dGeometry& geom)
      : CudaConv2dLayer(geom), g_{Int(geom.in.channels), Int(geom.in.height), Int(geom.in.width),
                                  Int(geom.kernel),      Int(geom.stride),    Int(geom.padding),
                                  Int(geom.out.height),  Int(geom.out.width)} {}

  void Forward(Context& ctx, const float* params, const float* x, float* y,
               const Pass& pass) override {
    const int device = ctx.device();
    const float* w = params;
    const float* b = params + geom_.out_channels * geom_.patch;
    float* col = Col(pass);
    PSGD_CUDA(kernels::Im2col(x, col, pass.batch, g_, ctx.stream()));
    PSGD_CUDA(kernels::FillBias(y, b, pass.batch, geom_.out_channels, geom_.pixels, ctx.stream()));
    const float one = 1.0f;
    // Row-major y_n (OC, P) += W (OC, patch) col_n (patch, P)  <=>  column-major
    // y_n^T (P, OC) += col_n^T (P, patch) W^T (patch, OC); the column-major views of col_n and W
    // are exactly col_n^T and W^T, so no operand is transposed.
    PSGD_CUBLAS(Cublas().sgemm_strided_batched(
        ctx.cublas(), CUBLAS_OP_N, CUBLAS_OP_N, Int(geom_.pixels), Int(geom_.out_channels),
        Int(geom_.patch), &one, col, Int(geom_.pixels),
        static_cast<long long>(geom_.patch * geom_.pixels), w, Int(geom_.patch), 0, &one, y,
        Int(geom_.pixels), static_cast<long long>(geom_.out_channels * geom_.pixels),
        Int(pass.batch)));
  }

  void Backward(Context& ctx, const float* params, const float* x, const float* y, const float* dy,
                float* grads, float* dx, const Pass& pass) override {
    const int device = ctx.device();
    const float* w = params;
    float* dw = grads;
    float* db = grads + geom_.out_channels * geom_.patch;
    float* col = Col(pass);
    PSGD_CUDA(kernels::Im2col(x, col, pass.batch, g_, ctx.stream()));
    const float one = 1.0f, zero = 0.0f;
    // dW (OC, patch) = sum_n dy_n (OC, P) col_n^T (P, patch), samples in order (the first
    // overwrites). Column-major: dW^T (patch, OC) = col_n (patch, P) dy_n^T (P, OC); col_n is
    // the transpose of its column-major view (op T), dy_n^T is dy_n's view (op N).
    for (size_t n = 0; n < pass.batch; ++n) {
      PSGD_CUBLAS(Cublas().sgemm(ctx.cublas(), CUBLAS_OP_T, CUBLAS_OP_N, Int(geom_.patch),
                                 Int(geom_.out_channels), Int(geom_.pixels), &one,
                                 col + n * geom_.patch * geom_.pixels, Int(geom_.pixels),
                                 dy + n * geom_.out_channels * geom_.pixels, Int(geom_.pixels),
                                 n == 0 ? &zero : &one, dw, Int(geom_.patch)));
    }
    PSGD_CUDA(kernels::ConvBiasGrad(dy, db, col + pass.batch * geom_.patch * geom_.pixels,
                                    pass.batch, geom_.out_channels, geom_.pixels, ctx.stream()));
    if (dx == nullptr) return;
    // dcol_n (patch, P) = W^T (patch, OC) dy_n (OC, P)  <=>  column-major
    // dcol_n^T (P, patch) = dy_n^T (P, OC) W (OC, patch): dy_n's view as is (N), W's view
    // transposed (T). dcol reuses the col area (col is no longer needed).
    PSGD_CUBLAS(Cublas().sgemm_strided_batched(
        ctx.cublas(), CUBLAS_OP_N, CUBLAS_OP_T, Int(geom_.pixels), Int(geom_.patch),
        Int(geom_.out_channels), &one, dy, Int(geom_.pixels),
        static_cast<long long>(geom_.out_channels * geom_.pixels), w, Int(geom_.patch), 0, &zero,
        col, Int(geom_.pixels), static_cast<long long>(geom_.patch * geom_.pixels),
        Int(pass.batch)));
    PSGD_CUDA(kernels::Col2im(col, dx, pass.batch, g_, ctx.stream()));
  }

 private:
  float* Col(const Pass& pass) const {
    PSGD_CHECK_GE(pass.workspace.size(), workspace_bytes(pass.batch));
    return reinterpret_cast<float*>(pass.workspace.data());
  }

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
    return fmt::format("max_pool2d({}->{}, k{} s{})", layers::ToString(in_), layers::ToString(out_),
                       kernel_, stride_);
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
    PSGD_CUDA(kernels::MaxPoolBackward(dy, reinterpret_cast<const int32_t*>(pass.workspace.data()),
                                       dx, pass.batch, g_, ctx.stream()));
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
      PSGD_CUDA(
          cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice, ctx.stream()));
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

#ifdef PIPESGD_HAVE_CUDNN
// layers/cuda/cudnn_conv2d.cc; takes the arguments MakeCudaConv2d has checked.
std::unique_ptr<CudaLayer> MakeCudnnConv2d(const Shape& in, size_t out_channels, size_t kernel,
                                           size_t stride, size_t padding);
#endif

}  // namespace pipesgd::cuda

// Declared in layers/device_model.h: what core/ may ask of the GPU backend.
namespace pipesgd::layers {

bool CudnnUsable(std::string* why_not) {
#ifdef PIPESGD_HAVE_CUDNN
  try {
    (void)cuda::Cudnn();
    return true;
  } catch (const Error& e) {
    if (why_not != nullptr) *why_not = e.what();
    return false;
  }
#else
  if (why_not != nullptr) {
    *why_not = "this pipesgd was built without cuDNN (no cudnn.h in the CUDA toolkit)";
  }
  return false;
#endif
}

GpuKernels DefaultGpuKernels() { return CudnnUsable() ? GpuKernels::kCudnn : GpuKernels::kCublas; }

std::string GpuKernelsDescription() {
  std::string why_not;
  if (!CudnnUsable(&why_not)) return "cublas (no cuDNN: " + why_not + ")";
#ifdef PIPESGD_HAVE_CUDNN
  const size_t v = cuda::Cudnn().get_version();
  return fmt::format("cudnn (cuDNN {}.{}.{})", v / 10000, v / 100 % 100, v % 100);
#else
  return "cublas";
#endif
}

std::string ToString(GpuKernels kernels) {
  return kernels == GpuKernels::kCudnn ? "cudnn" : "cublas";
}

}  // namespace pipesgd::layers

namespace pipesgd::cuda {

std::unique_ptr<CudaLayer> MakeCudaConv2d(const Shape& in, size_t out_channels, size_t kernel,
                                          size_t stride, size_t padding, GpuKernels kernels) {
  // The CPU factory validates (and throws the same errors); the twin only computes.
  layers::MakeConv2d(in, out_channels, kernel, stride, padding, layers::CpuKernels::kOpenBlas);
  if (kernels == GpuKernels::kCudnn) {
    std::string why_not;
    if (!CudnnUsable(&why_not)) {
      Throw(ErrorCode::kUnavailable, "conv2d on {} with cuDNN: {}", layers::ToString(in), why_not);
    }
#ifdef PIPESGD_HAVE_CUDNN
    return MakeCudnnConv2d(in, out_channels, kernel, stride, padding);
#endif
  }
  return std::make_unique<CudaConv2d>(
      layers::Conv2dGeometry(in, out_channels, kernel, stride, padding));
}
std::unique_ptr<CudaLayer> MakeCudaMaxPool2d(const Shape& in, size_t kernel, size_t stride) {
  layers::MakeMaxPool2d(in, kernel, stride, layers::CpuKernels::kOpenBlas);
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
