// Fully connected layer on OpenBLAS sgemm. Parameters [W (out, in) row-major, b (out)].
#include <cblas.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
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

class Linear final : public Layer {
 public:
  Linear(const Shape& in_shape, size_t out)
      : in_shape_(in_shape), in_(in_shape.size()), out_(out) {}

  std::string name() const override { return fmt::format("linear({}->{})", in_, out_); }
  Shape in_shape() const override { return in_shape_; }
  Shape out_shape() const override { return {out_, 1, 1}; }
  size_t num_params() const override { return out_ * in_ + out_; }
  WeightMatrix weight_matrix() const override { return {out_, in_}; }

  void Init(std::span<float> params, Rng& rng) const override {
    PSGD_CHECK_EQ(params.size(), num_params());
    // PyTorch's nn.Linear: kaiming_uniform(a=sqrt(5)) for W reduces to U(-1/sqrt(in), 1/sqrt(in)),
    // and b uses the same bound. One draw per float, W row-major first, then b, so the stream
    // order is part of the "same seed -> same model" contract.
    const float bound = 1.0f / std::sqrt(static_cast<float>(in_));
    for (float& p : params) p = rng.Uniform(-bound, bound);
  }

  void Forward(std::span<const float> params, const float* x, float* y,
               const Pass& pass) const override {
    const size_t batch = pass.batch;
    PSGD_CHECK_EQ(params.size(), num_params());
    const float* w = params.data();               // (out, in)
    const float* b = params.data() + out_ * in_;  // (out)
    // y (B, out) = x (B, in) @ W^T (in, out)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Int(batch), Int(out_), Int(in_), 1.0f,
                x, Int(in_), w, Int(in_), 0.0f, y, Int(out_));
    for (size_t i = 0; i < batch; i++) {
      float* y_row = y + i * out_;
      for (size_t o = 0; o < out_; o++) y_row[o] += b[o];
    }
  }

  void Backward(std::span<const float> params, const float* x, const float* y, const float* dy,
                std::span<float> grads, float* dx, const Pass& pass) const override {
    const size_t batch = pass.batch;
    PSGD_CHECK_EQ(params.size(), num_params());
    PSGD_CHECK_EQ(grads.size(), num_params());
    const float* w = params.data();         // (out, in)
    float* dw = grads.data();               // (out, in)
    float* db = grads.data() + out_ * in_;  // (out)
    // beta = 0: gradients are overwritten, never accumulated, so the caller may hand in a buffer
    // holding anything (the trainer reuses gradient buffers across pipeline slots).
    // dW (out, in) = dy^T (out, B) @ x (B, in)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Int(out_), Int(in_), Int(batch), 1.0f,
                dy, Int(out_), x, Int(in_), 0.0f, dw, Int(in_));
    // db (out) = column sums of dy (B, out), in batch order
    for (size_t o = 0; o < out_; o++) db[o] = 0.0f;
    for (size_t i = 0; i < batch; i++) {
      const float* dy_row = dy + i * out_;
      for (size_t o = 0; o < out_; o++) db[o] += dy_row[o];
    }
    if (dx != nullptr) {
      // dx (B, in) = dy (B, out) @ W (out, in)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Int(batch), Int(in_), Int(out_),
                  1.0f, dy, Int(out_), w, Int(in_), 0.0f, dx, Int(in_));
    }
  }

 private:
  // BLAS dimensions are int; sizes beyond that are a bug in the caller, not input.
  static blasint Int(size_t n) {
    PSGD_CHECK_LE(n, static_cast<size_t>(INT32_MAX));
    return static_cast<blasint>(n);
  }

  Shape in_shape_;
  size_t in_;  // in_shape_.size()
  size_t out_;
};

}  // namespace

std::unique_ptr<Layer> MakeLinear(const Shape& in, size_t out_features) {
  if (in.size() == 0 || out_features == 0) {
    Throw(ErrorCode::kInvalidArgument, "linear layer needs at least one input and one output, got "
          "linear({}->{}) on input {}", in.size(), out_features, ToString(in));
  }
  return std::make_unique<Linear>(in, out_features);
}

std::unique_ptr<Layer> MakeLinear(size_t in_features, size_t out_features) {
  return MakeLinear(Shape{in_features, 1, 1}, out_features);
}

}  // namespace pipesgd::layers

namespace pipesgd::layers {

int BlasThreads() {
#ifdef OPENBLAS_VERSION
  return openblas_get_num_threads();
#else
  return 0;
#endif
}

bool SetBlasThreads(int threads) {
#ifdef OPENBLAS_VERSION
  if (threads < 1) return false;
  openblas_set_num_threads(threads);
  return true;
#else
  (void)threads;
  return false;
#endif
}

std::string BlasDescription() {
#ifdef OPENBLAS_VERSION
  return fmt::format("{} ({} core, {} thread(s))", openblas_get_config(),
                     openblas_get_corename(), openblas_get_num_threads());
#else
  return "a CBLAS (not OpenBLAS)";
#endif
}

}  // namespace pipesgd::layers
