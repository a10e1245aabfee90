#include "layers/layer.h"

#include "core/base/error.h"

namespace pipesgd::layers {

std::unique_ptr<Layer> MakeLayer(const LayerSpec& spec, const Shape& in, CpuKernels kernels) {
  switch (spec.kind) {
    case LayerSpec::Kind::kLinear:
      return MakeLinear(in, spec.out_features);
    case LayerSpec::Kind::kRelu:
      return MakeRelu(in);
    case LayerSpec::Kind::kConv2d:
      return MakeConv2d(in, spec.out_channels, spec.kernel, spec.stride, spec.padding, kernels);
    case LayerSpec::Kind::kMaxPool2d:
      return MakeMaxPool2d(in, spec.kernel, spec.stride, kernels);
    case LayerSpec::Kind::kDropout:
      return MakeDropout(in, spec.p);
    case LayerSpec::Kind::kFlatten:
      return MakeFlatten(in);
  }
  Throw(ErrorCode::kInternal, "layer kind {}: not one of LayerSpec::Kind", static_cast<int>(spec.kind));
}

}  // namespace pipesgd::layers
