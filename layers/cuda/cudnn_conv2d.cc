// GPU Conv2d on cuDNN: the same layer as CudaConv2d (cuda_cnn.cc) and layers/conv2d.cc (same
// parameters [W (OC, C, K, K), b (OC)], same NCHW buffers), computed by cuDNN's convolution
// kernels, the ones PyTorch's GPU convolutions use.
//
// Full FP32: the descriptor's math type is CUDNN_FMA_MATH (no TF32 tensor cores), as the cuBLAS
// path runs CUBLAS_PEDANTIC_MATH, so the layer stays within float rounding of the CPU. The
// algorithms are cuDNN's heuristic choice (cudnnGet*_v7, no timing, so the same on every run),
// restricted to deterministic ones whose scratch fits the workspace, chosen once per batch
// size. The workspace is bounded by what the im2col path needs for the same batch
// (CudaConv2dLayer::workspace_bytes).
#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "layers/cuda/cuda_model.h"
#include "layers/cuda/cudnn_loader.h"
#include "layers/cuda/spatial.h"

// The legacy convolution API is marked deprecated in cuDNN 9; it is what this file uses.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace pipesgd::cuda {
namespace {

using layers::Pass;
using layers::Shape;

// One cuDNN descriptor, destroyed with its owner.
template <typename T, auto kCreate, auto kDestroy>
class Descriptor {
 public:
  explicit Descriptor(int device) { PSGD_CUDNN((Cudnn().*kCreate)(&d_)); }
  ~Descriptor() {
    if (d_ != nullptr) (Cudnn().*kDestroy)(d_);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  T get() const { return d_; }

 private:
  T d_ = nullptr;
};
using TensorDescriptor =
    Descriptor<cudnnTensorDescriptor_t, &CudnnApi::create_tensor, &CudnnApi::destroy_tensor>;
using FilterDescriptor =
    Descriptor<cudnnFilterDescriptor_t, &CudnnApi::create_filter, &CudnnApi::destroy_filter>;
using ConvolutionDescriptor =
    Descriptor<cudnnConvolutionDescriptor_t, &CudnnApi::create_convolution,
               &CudnnApi::destroy_convolution>;

// The first of cuDNN's ranked candidates that ran its heuristics successfully, is
// deterministic, is no tensor-op (TF32) variant, and fits `bound` bytes of scratch. The
// descriptor stays CUDNN_FMA_MATH when the algorithm runs; a candidate may report
// CUDNN_DEFAULT_MATH, which on FP32 data under that descriptor is FMA too.
template <typename Perf>
const Perf* Pick(const std::array<Perf, 16>& perf, int returned, size_t bound) {
  for (int i = 0; i < returned; i++) {
    const Perf& p = perf[i];
    if (p.status == CUDNN_STATUS_SUCCESS && p.determinism == CUDNN_DETERMINISTIC &&
        p.mathType != CUDNN_TENSOR_OP_MATH &&
        p.mathType != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION && p.memory <= bound) {
      return &p;
    }
  }
  return nullptr;
}

class CudnnConv2d final : public CudaConv2dLayer {
 public:
  explicit CudnnConv2d(const layers::Conv2dGeometry& geom) : CudaConv2dLayer(geom) {}

  void Forward(Context& ctx, const float* params, const float* x, float* y,
               const Pass& pass) override {
    const int device = ctx.device();
    const Plan& plan = PlanFor(ctx, pass.batch);
    const float one = 1.0f, zero = 0.0f;
    PSGD_CUDNN(Cudnn().forward(ctx.cudnn(), &one, plan.x.get(), x, filter_->get(), params,
                               convolution_->get(), plan.forward, pass.workspace.data(),
                               plan.forward_bytes, &zero, plan.y.get(), y));
    PSGD_CUDNN(Cudnn().add_tensor(ctx.cudnn(), &one, bias_->get(),
                                  params + geom_.out_channels * geom_.patch, &one, plan.y.get(),
                                  y));
  }

  void Backward(Context& ctx, const float* params, const float* x, const float* y, const float* dy,
                float* grads, float* dx, const Pass& pass) override {
    const int device = ctx.device();
    const Plan& plan = PlanFor(ctx, pass.batch);
    const float one = 1.0f, zero = 0.0f;
    PSGD_CUDNN(Cudnn().backward_filter(ctx.cudnn(), &one, plan.x.get(), x, plan.y.get(), dy,
                                       convolution_->get(), plan.backward_filter,
                                       pass.workspace.data(), plan.backward_filter_bytes, &zero,
                                       filter_->get(), grads));
    PSGD_CUDNN(Cudnn().backward_bias(ctx.cudnn(), &one, plan.y.get(), dy, &zero, bias_->get(),
                                     grads + geom_.out_channels * geom_.patch));
    if (dx == nullptr) return;
    PSGD_CUDNN(Cudnn().backward_data(ctx.cudnn(), &one, filter_->get(), params, plan.y.get(), dy,
                                     convolution_->get(), plan.backward_data, pass.workspace.data(),
                                     plan.backward_data_bytes, &zero, plan.x.get(), dx));
  }

 private:
  struct Plan {
    explicit Plan(int device) : x(device), y(device) {}
    TensorDescriptor x, y;
    cudnnConvolutionFwdAlgo_t forward{};
    cudnnConvolutionBwdDataAlgo_t backward_data{};
    cudnnConvolutionBwdFilterAlgo_t backward_filter{};
    size_t forward_bytes = 0, backward_data_bytes = 0, backward_filter_bytes = 0;
  };

  const Plan& PlanFor(Context& ctx, size_t batch) {
    PSGD_CHECK_GE(batch, size_t{1});
    auto it = plans_.find(batch);
    if (it != plans_.end()) return *it->second;
    const int device = ctx.device();
    if (filter_ == nullptr) {
      filter_ = std::make_unique<FilterDescriptor>(device);
      PSGD_CUDNN(Cudnn().set_filter_4d(filter_->get(), CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW,
                                       Int(geom_.out_channels), Int(geom_.in.channels),
                                       Int(geom_.kernel), Int(geom_.kernel)));
      bias_ = std::make_unique<TensorDescriptor>(device);
      PSGD_CUDNN(Cudnn().set_tensor_4d(bias_->get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1,
                                       Int(geom_.out_channels), 1, 1));
      convolution_ = std::make_unique<ConvolutionDescriptor>(device);
      PSGD_CUDNN(Cudnn().set_convolution_2d(
          convolution_->get(), Int(geom_.padding), Int(geom_.padding), Int(geom_.stride),
          Int(geom_.stride), 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
      PSGD_CUDNN(Cudnn().set_convolution_math_type(convolution_->get(), CUDNN_FMA_MATH));
    }
    auto plan = std::make_unique<Plan>(device);
    PSGD_CUDNN(Cudnn().set_tensor_4d(plan->x.get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, Int(batch),
                                     Int(geom_.in.channels), Int(geom_.in.height),
                                     Int(geom_.in.width)));
    std::array<int, 4> dims{};
    PSGD_CUDNN(Cudnn().forward_output_dim(convolution_->get(), plan->x.get(), filter_->get(),
                                          &dims[0], &dims[1], &dims[2], &dims[3]));
    PSGD_CHECK_EQ(static_cast<size_t>(dims[1]), geom_.out.channels);
    PSGD_CHECK_EQ(static_cast<size_t>(dims[2]), geom_.out.height);
    PSGD_CHECK_EQ(static_cast<size_t>(dims[3]), geom_.out.width);
    PSGD_CUDNN(Cudnn().set_tensor_4d(plan->y.get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, Int(batch),
                                     Int(geom_.out.channels), Int(geom_.out.height),
                                     Int(geom_.out.width)));
    const size_t bound = workspace_bytes(batch);
    const cudnnHandle_t handle = ctx.cudnn();
    int returned = 0;
    std::array<cudnnConvolutionFwdAlgoPerf_t, 16> forward{};
    PSGD_CUDNN(Cudnn().forward_algorithms(handle, plan->x.get(), filter_->get(),
                                          convolution_->get(), plan->y.get(), Int(forward.size()),
                                          &returned, forward.data()));
    const auto* f = Pick(forward, returned, bound);
    std::array<cudnnConvolutionBwdDataAlgoPerf_t, 16> data{};
    PSGD_CUDNN(Cudnn().backward_data_algorithms(handle, filter_->get(), plan->y.get(),
                                                convolution_->get(), plan->x.get(),
                                                Int(data.size()), &returned, data.data()));
    const auto* d = Pick(data, returned, bound);
    std::array<cudnnConvolutionBwdFilterAlgoPerf_t, 16> filter{};
    PSGD_CUDNN(Cudnn().backward_filter_algorithms(handle, plan->x.get(), plan->y.get(),
                                                  convolution_->get(), filter_->get(),
                                                  Int(filter.size()), &returned, filter.data()));
    const auto* w = Pick(filter, returned, bound);
    if (f == nullptr || d == nullptr || w == nullptr) {
      Throw(ErrorCode::kUnavailable,
            "cuDNN offers no deterministic FP32 {} algorithm for {} at batch {} within {} bytes "
            "of workspace; set model.gpu_kernels = CUBLAS",
            f == nullptr   ? "forward"
            : d == nullptr ? "backward-data"
                           : "backward-filter",
            name(), batch, bound);
    }
    plan->forward = f->algo;
    plan->forward_bytes = f->memory;
    plan->backward_data = d->algo;
    plan->backward_data_bytes = d->memory;
    plan->backward_filter = w->algo;
    plan->backward_filter_bytes = w->memory;
    return *plans_.emplace(batch, std::move(plan)).first->second;
  }

  // Made on first use, when a device and cuDNN are known to be there.
  std::unique_ptr<FilterDescriptor> filter_;
  std::unique_ptr<TensorDescriptor> bias_;
  std::unique_ptr<ConvolutionDescriptor> convolution_;
  std::map<size_t, std::unique_ptr<Plan>> plans_;  // by batch size
};

}  // namespace

std::unique_ptr<CudaLayer> MakeCudnnConv2d(const Shape& in, size_t out_channels, size_t kernel,
                                           size_t stride, size_t padding) {
  return std::make_unique<CudnnConv2d>(
      layers::Conv2dGeometry(in, out_channels, kernel, stride, padding));
}

}  // namespace pipesgd::cuda
