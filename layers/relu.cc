// ReLU: y = max(x, 0), elementwise, no parameters.
#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "core/base/check.h"
#include "core/base/error.h"
#include "layers/layer.h"
#include "core/base/rng.h"

namespace pipesgd::layers {
namespace {

class Relu final : public Layer {
 public:
  explicit Relu(const Shape& shape) : shape_(shape), features_(shape.size()) {}

  // No size: the neighbouring linear layers already say it (see Model::Describe).
  std::string name() const override { return "relu"; }
  Shape in_shape() const override { return shape_; }
  Shape out_shape() const override { return shape_; }
  size_t num_params() const override { return 0; }

  void Init(std::span<float> params, Rng& rng) const override {
    PSGD_CHECK_EQ(params.size(), size_t{0});
  }

  void Forward(std::span<const float> params, const float* x, float* y,
               const Pass& pass) const override {
    const size_t n = pass.batch * features_;  // x, y (B, features)
    // Written as "x < 0 ? 0 : x" rather than "x > 0 ? x : 0" so that a NaN passes through and
    // a diverged model shows up as a non-finite loss instead of being silently zeroed here.
    for (size_t i = 0; i < n; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
  }

  void Backward(std::span<const float> params, const float* x, const float* y, const float* dy,
                std::span<float> grads, float* dx, const Pass& pass) const override {
    PSGD_CHECK_EQ(grads.size(), size_t{0});
    if (dx == nullptr) return;  // nothing to learn here, and nobody wants the input gradient
    const size_t n = pass.batch * features_;  // x, dy, dx (B, features)
    // Subgradient 0 at exactly x == 0, as PyTorch does. dy is read unconditionally so that the
    // compiler can make this a vector select (a conditional load it will not vectorise; the
    // loop then took a fifth of a CNN step).
    for (size_t i = 0; i < n; i++) {
      const float g = dy[i];
      dx[i] = x[i] > 0.0f ? g : 0.0f;
    }
  }

 private:
  Shape shape_;
  size_t features_;  // shape_.size()
};

}  // namespace

std::unique_ptr<Layer> MakeRelu(const Shape& shape) {
  if (shape.size() == 0) {
    Throw(ErrorCode::kInvalidArgument, "relu layer needs at least one feature, got shape {}",
          ToString(shape));
  }
  return std::make_unique<Relu>(shape);
}

std::unique_ptr<Layer> MakeRelu(size_t features) { return MakeRelu(Shape{features, 1, 1}); }

}  // namespace pipesgd::layers
