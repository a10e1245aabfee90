#include "layers/spatial.h"

#include <cmath>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "layers/model.h"

namespace pipesgd::layers {

// Which CPU kernels this build has (layer.h's CpuKernels), kept here rather than in either
// layer so that conv2d and max_pool2d make the same choice.
#ifdef PIPESGD_HAVE_ONEDNN
namespace onednn {
std::string Description();  // layers/onednn.cc (its header needs oneDNN's)
int Threads();
bool SetThreads(int threads);
}  // namespace onednn
bool HaveOneDnn() { return true; }
int OneDnnThreads() { return onednn::Threads(); }
bool SetOneDnnThreads(int threads) { return onednn::SetThreads(threads); }
std::string CpuKernelsDescription() { return "onednn (" + onednn::Description() + ")"; }
#else
bool HaveOneDnn() { return false; }
int OneDnnThreads() { return 0; }
bool SetOneDnnThreads(int /*threads*/) { return false; }
std::string CpuKernelsDescription() {
  return "openblas (im2col + OpenBLAS; this build has no oneDNN)";
}

namespace {

[[noreturn]] void ThrowNoOneDnn(const char* layer, const Shape& in) {
  Throw(ErrorCode::kUnavailable,
        "{} on {}: this build has no oneDNN (install libdnnl-dev and configure again), "
        "expected the openblas kernels",
        layer, ToString(in));
}

}  // namespace

std::unique_ptr<Layer> MakeOneDnnConv2d(const Shape& in, size_t, size_t, size_t, size_t) {
  ThrowNoOneDnn("conv2d", in);
}
std::unique_ptr<Layer> MakeOneDnnMaxPool2d(const Shape& in, size_t, size_t) {
  ThrowNoOneDnn("max_pool2d", in);
}
#endif

CpuKernels DefaultCpuKernels() {
  return HaveOneDnn() ? CpuKernels::kOneDnn : CpuKernels::kOpenBlas;
}

std::string ToString(CpuKernels kernels) {
  return kernels == CpuKernels::kOneDnn ? "onednn" : "openblas";
}

Shape Conv2dOutShape(const Shape& in, size_t out_channels, size_t kernel, size_t stride,
                     size_t padding) {
  PSGD_CHECK(stride >= 1 && kernel <= in.height + 2 * padding && kernel <= in.width + 2 * padding);
  return {out_channels, (in.height + 2 * padding - kernel) / stride + 1,
          (in.width + 2 * padding - kernel) / stride + 1};
}

Shape MaxPool2dOutShape(const Shape& in, size_t kernel, size_t stride) {
  PSGD_CHECK(stride >= 1 && kernel <= in.height && kernel <= in.width);
  return {in.channels, (in.height - kernel) / stride + 1, (in.width - kernel) / stride + 1};
}

Conv2dGeometry::Conv2dGeometry(const Shape& in_shape, size_t oc, size_t k, size_t s, size_t p)
    : in(in_shape),
      out(Conv2dOutShape(in_shape, oc, k, s, p)),
      out_channels(oc),
      kernel(k),
      stride(s),
      padding(p),
      patch(in_shape.channels * k * k),
      pixels(out.height * out.width) {}

std::string Conv2dGeometry::name() const {
  return fmt::format("conv2d({}->{}, k{} s{} p{})", ToString(in), ToString(out), kernel, stride,
                     padding);
}

void Conv2dGeometry::Init(std::span<float> params, Rng& rng) const {
  PSGD_CHECK_EQ(params.size(), num_params());
  const float bound = 1.0f / std::sqrt(static_cast<float>(patch));
  for (float& p : params) p = rng.Uniform(-bound, bound);
}

MaxPool2dGeometry::MaxPool2dGeometry(const Shape& in_shape, size_t k, size_t s)
    : in(in_shape),
      out(MaxPool2dOutShape(in_shape, k, s)),
      kernel(k),
      stride(s) {}

std::string MaxPool2dGeometry::name() const {
  return fmt::format("max_pool2d({}->{}, k{} s{})", ToString(in), ToString(out), kernel, stride);
}

void MaxPool2dLayer::Init(std::span<float> params, Rng& rng) const {
  PSGD_CHECK_EQ(params.size(), size_t{0});
}

}  // namespace pipesgd::layers
