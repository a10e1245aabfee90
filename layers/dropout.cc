// Inverted dropout and Flatten: elementwise layers without parameters.
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

namespace pipesgd::layers {
namespace {

class Dropout final : public Layer {
 public:
  Dropout(const Shape& shape, float p)
      : shape_(shape), features_(shape.size()), p_(p), scale_(1.0f / (1.0f - p)) {}

  std::string name() const override { return fmt::format("dropout({})", p_); }
  Shape in_shape() const override { return shape_; }
  Shape out_shape() const override { return shape_; }
  size_t num_params() const override { return 0; }

  void Init(std::span<float> params, Rng& rng) const override {
    PSGD_CHECK_EQ(params.size(), size_t{0});
  }

  void Forward(std::span<const float> params, const float* x, float* y,
               const Pass& pass) const override {
    const size_t n = pass.batch * features_;
    if (!pass.training) {
      std::memcpy(y, x, n * sizeof(float));
      return;
    }
    const uint64_t first = pass.first_row * features_;
    // x * mask, as PyTorch computes it, rather than a select: a NaN or infinite x stays
    // non-finite even where dropped, so a diverged model is not masked here (see Relu).
    for (size_t k = 0; k < n; k++) y[k] = x[k] * Mask(pass.key, first + k);
  }

  void Backward(std::span<const float> params, const float* x, const float* y, const float* dy,
                std::span<float> grads, float* dx, const Pass& pass) const override {
    PSGD_CHECK_EQ(grads.size(), size_t{0});
    if (dx == nullptr) return;
    const size_t n = pass.batch * features_;
    if (!pass.training) {
      std::memcpy(dx, dy, n * sizeof(float));
      return;
    }
    // The mask is recomputed from the key rather than stored: it costs one hash per element and
    // no memory, and a CUDA kernel can do the same without a mask buffer.
    const uint64_t first = pass.first_row * features_;
    for (size_t k = 0; k < n; k++) dx[k] = dy[k] * Mask(pass.key, first + k);
  }

 private:
  // 1/(1-p) where the element is kept, 0 where it is dropped.
  float Mask(uint64_t key, uint64_t element) const {
    return UnitFloat(Hash(key, element)) >= p_ ? scale_ : 0.0f;
  }

  Shape shape_;
  size_t features_;
  float p_;
  float scale_;  // 1 / (1 - p)
};

class Flatten final : public Layer {
 public:
  explicit Flatten(const Shape& in) : in_(in) {}

  std::string name() const override {
    return fmt::format("flatten({}->{})", ToString(in_), in_.size());
  }
  Shape in_shape() const override { return in_; }
  Shape out_shape() const override { return {in_.size(), 1, 1}; }
  size_t num_params() const override { return 0; }

  void Init(std::span<float> params, Rng& rng) const override {
    PSGD_CHECK_EQ(params.size(), size_t{0});
  }

  // (B, C, H, W) and (B, C*H*W) are the same floats in the same order: a copy.
  void Forward(std::span<const float> params, const float* x, float* y,
               const Pass& pass) const override {
    std::memcpy(y, x, pass.batch * in_.size() * sizeof(float));
  }
  void Backward(std::span<const float> params, const float* x, const float* y, const float* dy,
                std::span<float> grads, float* dx, const Pass& pass) const override {
    PSGD_CHECK_EQ(grads.size(), size_t{0});
    if (dx != nullptr) std::memcpy(dx, dy, pass.batch * in_.size() * sizeof(float));
  }

 private:
  Shape in_;
};

}  // namespace

std::unique_ptr<Layer> MakeDropout(const Shape& shape, float p) {
  if (!(p >= 0.0f && p < 1.0f)) {
    Throw(ErrorCode::kInvalidArgument, "dropout p = {}: expected a probability in [0, 1)", p);
  }
  if (shape.size() == 0) {
    Throw(ErrorCode::kInvalidArgument, "dropout needs at least one feature, got shape {}",
          ToString(shape));
  }
  return std::make_unique<Dropout>(shape, p);
}

std::unique_ptr<Layer> MakeFlatten(const Shape& in) {
  if (in.size() == 0) {
    Throw(ErrorCode::kInvalidArgument, "flatten needs at least one feature, got shape {}",
          ToString(in));
  }
  return std::make_unique<Flatten>(in);
}

}  // namespace pipesgd::layers
