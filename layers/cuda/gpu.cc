// layers::OpenGpu (layers/device_model.h): the GPU backend behind the interfaces core/ sees.
#include <memory>
#include <vector>

#include "core/base/error.h"
#include "layers/cuda/cuda_model.h"
#include "layers/cuda/device.h"
#include "layers/device_model.h"

namespace pipesgd::cuda {

std::unique_ptr<CudaLayer> MakeCudaLayer(const layers::LayerSpec& spec, const layers::Shape& in,
                                         GpuKernels kernels) {
  using Kind = layers::LayerSpec::Kind;
  switch (spec.kind) {
    case Kind::kLinear:
      return MakeCudaLinear(in, spec.out_features);
    case Kind::kRelu:
      return MakeCudaRelu(in);
    case Kind::kConv2d:
      return MakeCudaConv2d(in, spec.out_channels, spec.kernel, spec.stride, spec.padding,
                            kernels);
    case Kind::kMaxPool2d:
      return MakeCudaMaxPool2d(in, spec.kernel, spec.stride);
    case Kind::kDropout:
      return MakeCudaDropout(in, spec.p);
    case Kind::kFlatten:
      return MakeCudaFlatten(in);
  }
  Throw(ErrorCode::kInternal, "layer kind {}: not one of LayerSpec::Kind",
        static_cast<int>(spec.kind));
}

namespace {

class CudaGpu final : public layers::Gpu {
 public:
  explicit CudaGpu(int device) : context_(device) {}
  DeviceContext& context() override { return context_; }

  std::unique_ptr<layers::DeviceModel> MakeModel(std::span<const layers::LayerSpec> specs,
                                                 const layers::Shape& in, size_t max_batch,
                                                 GpuKernels kernels) override {
    std::vector<std::unique_ptr<CudaLayer>> stack;
    layers::Shape shape = in;
    for (const layers::LayerSpec& spec : specs) {
      stack.push_back(MakeCudaLayer(spec, shape, kernels));
      shape = stack.back()->out_shape();
    }
    return std::make_unique<CudaModel>(context_, std::move(stack), max_batch);
  }

  std::unique_ptr<layers::DeviceSgd> MakeSgd(const layers::SgdOptions& options,
                                             size_t num_params) override {
    return std::make_unique<CudaSgd>(context_, options, num_params);
  }

 private:
  Context context_;
};

}  // namespace
}  // namespace pipesgd::cuda

namespace pipesgd::layers {

std::unique_ptr<Gpu> OpenGpu(int device) { return std::make_unique<cuda::CudaGpu>(device); }

}  // namespace pipesgd::layers
