// GPU layers, model and SGD; see cuda_model.h. Host code: cuBLAS calls and kernel launches.
#include "layers/cuda/cuda_model.h"

#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "layers/cuda/cublas_loader.h"
#include "layers/cuda/kernels.h"
#include "layers/layer.h"
#include "core/base/rng.h"

namespace pipesgd::cuda {
namespace {

int Int(size_t n) {
  PSGD_CHECK_LE(n, static_cast<size_t>(INT_MAX));
  return static_cast<int>(n);
}

// Fully connected, y = x W^T + b with W (out, in) row-major. cuBLAS is column-major: a row-major
// (r, c) matrix is the column-major (c, r) matrix of the same bytes, its transpose. So every
// row-major product C = A B is computed as the column-major C^T = B^T A^T (operands swapped).
class CudaLinear final : public CudaLayer {
 public:
  CudaLinear(const layers::Shape& in, size_t out) : in_shape_(in), in_(in.size()), out_(out) {}
  std::string name() const override { return fmt::format("linear({}->{})", in_, out_); }
  layers::Shape in_shape() const override { return in_shape_; }
  layers::Shape out_shape() const override { return {out_, 1, 1}; }
  size_t num_params() const override { return out_ * in_ + out_; }

  void Forward(Context& ctx, const float* params, const float* x, float* y,
               const layers::Pass& pass) override {
    const int device = ctx.device();
    const size_t batch = pass.batch;
    const float* w = params;
    const float* b = params + out_ * in_;
    const float one = 1.0f, zero = 0.0f;
    // Row-major y (B, out) = x (B, in) W^T  <=>  column-major y^T (out, B) = W (out, in) x^T,
    // where the column-major view of W's bytes is W^T (in, out), hence op T.
    PSGD_CUBLAS(Cublas().sgemm(ctx.cublas(), CUBLAS_OP_T, CUBLAS_OP_N, Int(out_), Int(batch),
                            Int(in_), &one, w, Int(in_), x, Int(in_), &zero, y, Int(out_)));
    PSGD_CUDA(kernels::AddBias(y, b, batch, out_, ctx.stream()));
  }

  void Backward(Context& ctx, const float* params, const float* x, const float* y,
                const float* dy, float* grads, float* dx, const layers::Pass& pass) override {
    const int device = ctx.device();
    const size_t batch = pass.batch;
    const float* w = params;
    float* dw = grads;
    float* db = grads + out_ * in_;
    const float one = 1.0f, zero = 0.0f;
    // Row-major dW (out, in) = dy^T x  <=>  column-major dW^T (in, out) = x^T (in, B) dy (B, out),
    // with x^T and dy^T the column-major views of x and dy.
    PSGD_CUBLAS(Cublas().sgemm(ctx.cublas(), CUBLAS_OP_N, CUBLAS_OP_T, Int(in_), Int(out_),
                            Int(batch), &one, x, Int(in_), dy, Int(out_), &zero, dw, Int(in_)));
    PSGD_CUDA(kernels::ColumnSums(dy, db, batch, out_, ctx.stream()));
    if (dx != nullptr) {
      // Row-major dx (B, in) = dy W  <=>  column-major dx^T (in, B) = W^T (in, out) dy^T (out, B).
      PSGD_CUBLAS(Cublas().sgemm(ctx.cublas(), CUBLAS_OP_N, CUBLAS_OP_N, Int(in_), Int(batch),
                              Int(out_), &one, w, Int(in_), dy, Int(out_), &zero, dx, Int(in_)));
    }
  }

 private:
  layers::Shape in_shape_;
  size_t in_, out_;
};

class CudaRelu final : public CudaLayer {
 public:
  explicit CudaRelu(const layers::Shape& shape) : shape_(shape), features_(shape.size()) {}
  std::string name() const override { return "relu"; }
  layers::Shape in_shape() const override { return shape_; }
  layers::Shape out_shape() const override { return shape_; }
  size_t num_params() const override { return 0; }

  void Forward(Context& ctx, const float*, const float* x, float* y,
               const layers::Pass& pass) override {
    const int device = ctx.device();
    PSGD_CUDA(kernels::ReluForward(x, y, pass.batch * features_, ctx.stream()));
  }
  void Backward(Context& ctx, const float*, const float* x, const float*, const float* dy,
                float*, float* dx, const layers::Pass& pass) override {
    if (dx == nullptr) return;
    const int device = ctx.device();
    PSGD_CUDA(kernels::ReluBackward(x, dy, dx, pass.batch * features_, ctx.stream()));
  }

 private:
  layers::Shape shape_;
  size_t features_;
};

}  // namespace

// Each twin runs the CPU factory first for its argument checks, so both fail alike.
std::unique_ptr<CudaLayer> MakeCudaLinear(const layers::Shape& in, size_t out_features) {
  layers::MakeLinear(in, out_features);
  return std::make_unique<CudaLinear>(in, out_features);
}
std::unique_ptr<CudaLayer> MakeCudaLinear(size_t in_features, size_t out_features) {
  return MakeCudaLinear(layers::Shape{in_features, 1, 1}, out_features);
}
std::unique_ptr<CudaLayer> MakeCudaRelu(const layers::Shape& shape) {
  layers::MakeRelu(shape);
  return std::make_unique<CudaRelu>(shape);
}
std::unique_ptr<CudaLayer> MakeCudaRelu(size_t features) {
  return MakeCudaRelu(layers::Shape{features, 1, 1});
}

CudaModel::CudaModel(Context& ctx, std::vector<std::unique_ptr<CudaLayer>> layers,
                     size_t max_batch)
    : ctx_(ctx), layers_(std::move(layers)), max_batch_(max_batch) {
  if (layers_.empty()) Throw(ErrorCode::kInvalidArgument, "a model needs at least one layer");
  if (max_batch_ == 0) Throw(ErrorCode::kInvalidArgument, "max_batch must be at least 1");
  for (size_t i = 1; i < layers_.size(); i++) {
    const CudaLayer& prev = *layers_[i - 1];
    const CudaLayer& cur = *layers_[i];
    if (cur.in_shape() != prev.out_shape()) {
      Throw(ErrorCode::kInvalidArgument,
            "layer {} {} takes {} features ({}) but layer {} {} outputs {} ({})", i, cur.name(),
            cur.in_features(), layers::ToString(cur.in_shape()), i - 1, prev.name(),
            prev.out_features(), layers::ToString(prev.out_shape()));
    }
  }
  for (const auto& layer : layers_) {
    param_offsets_.push_back(num_params_);
    num_params_ += layer->num_params();
  }
  const int device = ctx.device();
  acts_.resize(layers_.size() + 1);
  grads_acts_.resize(layers_.size() + 1);
  for (size_t i = 1; i <= layers_.size(); i++) {
    const size_t features = layers_[i - 1]->out_features();
    acts_[i] = DeviceBuffer<float>(max_batch_ * features, device);
    grads_acts_[i] = DeviceBuffer<float>(max_batch_ * features, device);
  }
  workspaces_.resize(layers_.size());
  for (size_t i = 0; i < layers_.size(); i++) {
    workspaces_[i] = DeviceBuffer<std::byte>(layers_[i]->workspace_bytes(max_batch_), device);
  }
  row_loss_ = DeviceBuffer<double>(max_batch_, device);
  correct_ = DeviceBuffer<uint8_t>(max_batch_, device);
  host_row_loss_ = PinnedBuffer<double>(max_batch_, device);
  host_correct_ = PinnedBuffer<uint8_t>(max_batch_, device);
}

layers::Shape CudaModel::in_shape() const { return layers_.front()->in_shape(); }
size_t CudaModel::num_classes() const { return layers_.back()->out_features(); }

std::string CudaModel::Describe() const {
  std::string out;
  for (const auto& layer : layers_) {
    if (!out.empty()) out += ' ';
    out += layer->name();
  }
  return fmt::format("{}: {} params on {}", out, num_params_, ctx_.description());
}

// Exactly layers::Model::LayerPass, with a device workspace.
layers::Pass CudaModel::LayerPass(size_t i, size_t batch, bool training,
                                  const layers::BatchKey& key) {
  layers::Pass pass;
  pass.batch = batch;
  pass.training = training;
  pass.key = pipesgd::RandomKey(key.seed, key.step, i);
  pass.first_row = key.first_row;
  pass.workspace = std::span<std::byte>(workspaces_[i].data(),
                                        layers_[i]->workspace_bytes(batch));
  return pass;
}

void CudaModel::RunForward(const float* params, const float* x, size_t batch, bool training,
                           const layers::BatchKey& key) {
  PSGD_CHECK_GE(batch, size_t{1});
  PSGD_CHECK_LE(batch, max_batch_);
  for (size_t i = 0; i < layers_.size(); i++) {
    const float* in = i == 0 ? x : acts_[i].data();
    layers_[i]->Forward(ctx_, params + param_offsets_[i], in, acts_[i + 1].data(),
                        LayerPass(i, batch, training, key));
  }
}

layers::EvalResult CudaModel::Loss(const uint8_t* labels, size_t batch, bool gradient) {
  const int device = ctx_.device();
  const size_t classes = num_classes();
  PSGD_CUDA(kernels::SoftmaxCrossEntropy(acts_.back().data(), labels, batch, classes,
                                         1.0 / static_cast<double>(batch),
                                         gradient ? grads_acts_.back().data() : nullptr,
                                         row_loss_.data(), correct_.data(), ctx_.stream()));
  PSGD_CUDA(cudaMemcpyAsync(host_row_loss_.data(), row_loss_.data(), batch * sizeof(double),
                            cudaMemcpyDeviceToHost, ctx_.stream()));
  PSGD_CUDA(cudaMemcpyAsync(host_correct_.data(), correct_.data(), batch,
                            cudaMemcpyDeviceToHost, ctx_.stream()));
  return {};
}

float CudaModel::ForwardBackward(const float* params, const float* x, const uint8_t* labels,
                                 size_t batch, float* grads, const layers::BatchKey& key) {
  RunForward(params, x, batch, /*training=*/true, key);
  Loss(labels, batch, /*gradient=*/true);
  for (size_t i = layers_.size(); i-- > 0;) {
    const float* in = i == 0 ? x : acts_[i].data();
    float* dx = i == 0 ? nullptr : grads_acts_[i].data();
    layers_[i]->Backward(ctx_, params + param_offsets_[i], in, acts_[i + 1].data(),
                         grads_acts_[i + 1].data(), grads + param_offsets_[i], dx,
                         LayerPass(i, batch, /*training=*/true, key));
  }
  ctx_.Synchronize("a forward and backward pass");
  // Summed on the host in sample order, as layers::SoftmaxCrossEntropy does.
  double loss_sum = 0.0;
  for (size_t i = 0; i < batch; i++) loss_sum += host_row_loss_.data()[i];
  return static_cast<float>(loss_sum * (1.0 / static_cast<double>(batch)));
}

layers::EvalResult CudaModel::Evaluate(const float* params, const float* x,
                                       const uint8_t* labels, size_t batch) {
  RunForward(params, x, batch, /*training=*/false, {});
  Loss(labels, batch, /*gradient=*/false);
  ctx_.Synchronize("an evaluation pass");
  layers::EvalResult result;
  for (size_t i = 0; i < batch; i++) {
    result.loss_sum += host_row_loss_.data()[i];
    result.correct += host_correct_.data()[i];
  }
  result.count = static_cast<int64_t>(batch);
  return result;
}

CudaSgd::CudaSgd(Context& ctx, const layers::SgdOptions& options, size_t num_params)
    : ctx_(ctx), options_(options), num_params_(num_params) {
  layers::Sgd validate(options, 0);  // the same rejections as the CPU optimizer
  if (options_.momentum != 0.0f) {
    const int device = ctx.device();
    momentum_buf_ = DeviceBuffer<float>(num_params, device);
    PSGD_CUDA(cudaMemsetAsync(momentum_buf_.data(), 0, momentum_buf_.bytes(), ctx.stream()));
  }
}

void CudaSgd::Step(float* params, const float* grads, size_t n) {
  PSGD_CHECK_EQ(n, num_params_);
  const int device = ctx_.device();
  PSGD_CUDA(kernels::SgdStep(params, grads, momentum_buf_.data(), n, options_.learning_rate,
                             options_.momentum, options_.weight_decay, first_step_,
                             ctx_.stream()));
  if (options_.momentum != 0.0f) first_step_ = false;
}

std::vector<float> CudaSgd::SaveState() const {
  const int device = ctx_.device();
  std::vector<float> state(1 + momentum_buf_.size());
  state[0] = first_step_ ? 1.0f : 0.0f;
  if (momentum_buf_.size() > 0) {
    PSGD_CUDA(cudaMemcpyAsync(state.data() + 1, momentum_buf_.data(), momentum_buf_.bytes(),
                              cudaMemcpyDeviceToHost, ctx_.stream()));
    ctx_.Synchronize("saving the optimizer state");
  }
  return state;
}

void CudaSgd::LoadState(std::span<const float> state) {
  if (state.size() != 1 + momentum_buf_.size() || (state[0] != 0.0f && state[0] != 1.0f)) {
    Throw(ErrorCode::kDataLoss,
          "optimizer state of {} floats (first-step flag {}): expected {} (SGD with momentum {} "
          "over {} parameters)",
          state.size(), state.empty() ? 0.0f : state[0], 1 + momentum_buf_.size(),
          options_.momentum, momentum_buf_.size());
  }
  first_step_ = state[0] == 1.0f;
  const int device = ctx_.device();
  if (momentum_buf_.size() > 0) {
    PSGD_CUDA(cudaMemcpyAsync(momentum_buf_.data(), state.data() + 1, momentum_buf_.bytes(),
                              cudaMemcpyHostToDevice, ctx_.stream()));
    ctx_.Synchronize("loading the optimizer state");
  }
}

}  // namespace pipesgd::cuda
