#include "launcher/model_builder.h"

#include <cstddef>
#include <memory>
#include <vector>

namespace pipesgd::launcher {

layers::Shape InputShape(const config::Model& spec) {
  return {static_cast<size_t>(spec.input_channels()), static_cast<size_t>(spec.input_height()),
          static_cast<size_t>(spec.input_width())};
}

std::vector<std::unique_ptr<layers::Layer>> BuildLayers(const config::Model& spec) {
  std::vector<std::unique_ptr<layers::Layer>> stack;
  layers::Shape shape = InputShape(spec);
  for (const auto& layer : spec.layers()) {
    if (layer.has_linear()) {
      stack.push_back(layers::MakeLinear(shape, layer.linear().out_features()));
    } else if (layer.has_relu()) {
      stack.push_back(layers::MakeRelu(shape));
    } else if (layer.has_conv2d()) {
      const auto& c = layer.conv2d();
      stack.push_back(layers::MakeConv2d(shape, c.out_channels(), c.kernel_size(), c.stride(),
                                         c.padding()));
    } else if (layer.has_max_pool2d()) {
      const auto& m = layer.max_pool2d();
      stack.push_back(layers::MakeMaxPool2d(shape, m.kernel_size(),
                                            m.stride() == 0 ? m.kernel_size() : m.stride()));
    } else if (layer.has_dropout()) {
      stack.push_back(layers::MakeDropout(shape, layer.dropout().p()));
    } else if (layer.has_flatten()) {
      stack.push_back(layers::MakeFlatten(shape));
    } else {
      continue;  // no kind: the config loader rejects it
    }
    shape = stack.back()->out_shape();
  }
  return stack;
}

#ifdef PIPESGD_HAVE_CUDA_BACKEND
std::vector<std::unique_ptr<cuda::CudaLayer>> BuildCudaLayers(const config::Model& spec) {
  std::vector<std::unique_ptr<cuda::CudaLayer>> stack;
  layers::Shape shape = InputShape(spec);
  for (const auto& layer : spec.layers()) {
    if (layer.has_linear()) {
      stack.push_back(cuda::MakeCudaLinear(shape, layer.linear().out_features()));
    } else if (layer.has_relu()) {
      stack.push_back(cuda::MakeCudaRelu(shape));
    } else if (layer.has_conv2d()) {
      const auto& c = layer.conv2d();
      stack.push_back(cuda::MakeCudaConv2d(shape, c.out_channels(), c.kernel_size(), c.stride(),
                                           c.padding()));
    } else if (layer.has_max_pool2d()) {
      const auto& m = layer.max_pool2d();
      stack.push_back(cuda::MakeCudaMaxPool2d(shape, m.kernel_size(),
                                              m.stride() == 0 ? m.kernel_size() : m.stride()));
    } else if (layer.has_dropout()) {
      stack.push_back(cuda::MakeCudaDropout(shape, layer.dropout().p()));
    } else if (layer.has_flatten()) {
      stack.push_back(cuda::MakeCudaFlatten(shape));
    } else {
      continue;
    }
    shape = stack.back()->out_shape();
  }
  return stack;
}
#endif

}  // namespace pipesgd::launcher
