// The layer stack, its softmax cross-entropy loss, and evaluation.
#include "layers/model.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "layers/layer.h"
#include "core/base/rng.h"

namespace pipesgd::layers {
namespace {

// Cross-entropy of one row of logits (C) against `label`, computed in double: Evaluate sums it over
// a whole test set, and log-sum-exp in float would throw away digits the loss curve can show.
// Subtracting the row max keeps exp() in (0, 1], so logits of 1000 do not overflow.
// If drow is not null, writes drow (C) = (softmax - onehot) * scale.
double CrossEntropyRow(const float* row, size_t classes, size_t label, float* drow,
                       double scale) {
  PSGD_CHECK_LT(label, classes);
  float max = row[0];
  for (size_t c = 1; c < classes; c++) {
    if (row[c] > max) max = row[c];
  }
  double sum = 0.0;
  for (size_t c = 0; c < classes; c++) sum += std::exp(static_cast<double>(row[c]) - max);
  const double log_sum = std::log(sum);
  if (drow != nullptr) {
    for (size_t c = 0; c < classes; c++) {
      const double p = std::exp(static_cast<double>(row[c]) - max) / sum;
      const double onehot = c == label ? 1.0 : 0.0;
      drow[c] = static_cast<float>((p - onehot) * scale);
    }
  }
  // -log softmax(row)[label] = log(sum_c exp(row_c - max)) - (row_label - max)
  return log_sum - (static_cast<double>(row[label]) - max);
}

// Index of the largest logit; the lowest index wins ties so the result does not depend on the
// order a reduction happened to visit the classes.
size_t Argmax(const float* row, size_t classes) {
  size_t best = 0;
  for (size_t c = 1; c < classes; c++) {
    if (row[c] > row[best]) best = c;
  }
  return best;
}

}  // namespace

float SoftmaxCrossEntropy(const float* logits, const uint8_t* labels, size_t batch,
                          size_t classes, float* dlogits) {
  PSGD_CHECK_GE(batch, size_t{1});
  PSGD_CHECK_GE(classes, size_t{1});
  const double inv_batch = 1.0 / static_cast<double>(batch);  // gradient of the MEAN loss
  double loss_sum = 0.0;
  for (size_t i = 0; i < batch; i++) {
    float* drow = dlogits != nullptr ? dlogits + i * classes : nullptr;
    loss_sum += CrossEntropyRow(logits + i * classes, classes, size_t{labels[i]}, drow, inv_batch);
  }
  return static_cast<float>(loss_sum * inv_batch);
}

Model::Model(std::vector<std::unique_ptr<Layer>> layers, size_t max_batch)
    : layers_(std::move(layers)), max_batch_(max_batch) {
  if (layers_.empty()) Throw(ErrorCode::kInvalidArgument, "a model needs at least one layer");
  if (max_batch_ == 0) Throw(ErrorCode::kInvalidArgument, "max_batch must be at least 1");
  for (size_t i = 0; i < layers_.size(); i++) {
    if (layers_[i] == nullptr) Throw(ErrorCode::kInvalidArgument, "layer {} is null", i);
  }
  for (size_t i = 1; i < layers_.size(); i++) {
    const Layer& prev = *layers_[i - 1];
    const Layer& cur = *layers_[i];
    if (cur.in_shape() != prev.out_shape()) {
      Throw(ErrorCode::kInvalidArgument,
            "layer {} {} takes {} features ({}) but layer {} {} outputs {} ({})", i, cur.name(),
            cur.in_features(), ToString(cur.in_shape()), i - 1, prev.name(),
            prev.out_features(), ToString(prev.out_shape()));
    }
  }

  param_offsets_.reserve(layers_.size());
  for (const auto& layer : layers_) {
    param_offsets_.push_back(num_params_);
    num_params_ += layer->num_params();
  }

  // Allocated once for max_batch so that training steps never allocate. Entry 0 stays empty:
  // the first layer reads the caller's x in place and needs no input gradient.
  acts_.resize(layers_.size() + 1);
  grads_acts_.resize(layers_.size() + 1);
  for (size_t i = 1; i <= layers_.size(); i++) {
    const size_t features = layers_[i - 1]->out_features();
    acts_[i].resize(max_batch_ * features);        // (max_batch, out_{i-1})
    grads_acts_[i].resize(max_batch_ * features);  // (max_batch, out_{i-1})
  }
  workspaces_.resize(layers_.size());
  for (size_t i = 0; i < layers_.size(); i++) {
    workspaces_[i].resize(layers_[i]->workspace_bytes(max_batch_));
  }
}

Shape Model::in_shape() const { return layers_.front()->in_shape(); }

size_t Model::num_classes() const { return layers_.back()->out_features(); }

std::vector<Model::ParamMatrix> Model::WeightMatrices() const {
  std::vector<ParamMatrix> out;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer::WeightMatrix w = layers_[i]->weight_matrix();
    if (w.rows > 0) out.push_back({param_offsets_[i], w.rows, w.cols});
  }
  return out;
}

std::string Model::Describe() const {
  std::string out;
  for (const auto& layer : layers_) {
    if (!out.empty()) out += ' ';
    out += layer->name();
  }
  return fmt::format("{}: {} params", out, num_params_);
}

size_t Model::scratch_bytes() const {
  size_t bytes = 0;
  for (size_t i = 0; i < acts_.size(); i++) {
    bytes += (acts_[i].size() + grads_acts_[i].size()) * sizeof(float);
  }
  for (const auto& w : workspaces_) bytes += w.size();
  return bytes;
}

void Model::Init(std::span<float> params, uint64_t seed) const {
  PSGD_CHECK_EQ(params.size(), num_params_);
  // One stream for the whole model, consumed layer by layer: every rank derives the same
  // parameters from the seed alone, so nothing has to be broadcast at start-up.
  Rng rng(seed);
  for (size_t i = 0; i < layers_.size(); i++) {
    layers_[i]->Init(params.subspan(param_offsets_[i], layers_[i]->num_params()), rng);
  }
}

Pass Model::LayerPass(size_t i, size_t batch, bool training, const BatchKey& key) {
  Pass pass;
  pass.batch = batch;
  pass.training = training;
  pass.key = RandomKey(key.seed, key.step, i);
  pass.first_row = key.first_row;
  pass.workspace = std::span<std::byte>(workspaces_[i].data(),
                                        layers_[i]->workspace_bytes(batch));
  return pass;
}

void Model::ForwardAll(std::span<const float> params, const float* x, size_t batch,
                       bool training, const BatchKey& key) {
  PSGD_CHECK_GE(batch, size_t{1});
  PSGD_CHECK_LE(batch, max_batch_);
  PSGD_CHECK_EQ(params.size(), num_params_);
  // acts_[i + 1] (B, out_i) = layer_i(input_i (B, in_i)).
  for (size_t i = 0; i < layers_.size(); i++) {
    const float* in = i == 0 ? x : acts_[i].data();
    layers_[i]->Forward(LayerParams(params, i), in, acts_[i + 1].data(),
                        LayerPass(i, batch, training, key));
  }
}

float Model::ForwardBackward(std::span<const float> params, const float* x,
                             const uint8_t* labels, size_t batch, std::span<float> grads,
                             const BatchKey& key) {
  const float loss = Forward(params, x, labels, batch, key);
  Backward(params, x, batch, grads, key);
  return loss;
}

float Model::Forward(std::span<const float> params, const float* x, const uint8_t* labels,
                     size_t batch, const BatchKey& key) {
  ForwardAll(params, x, batch, /*training=*/true, key);
  const size_t n = layers_.size();
  // Loss on the logits (B, C); its gradient seeds the backward pass.
  return SoftmaxCrossEntropy(acts_[n].data(), labels, batch, num_classes(),
                             grads_acts_[n].data());
}

void Model::Backward(std::span<const float> params, const float* x, size_t batch,
                     std::span<float> grads, const BatchKey& key) {
  PSGD_CHECK_EQ(grads.size(), num_params_);
  const size_t n = layers_.size();
  // Last layer first, each with the Pass of its forward call. Each layer overwrites its own
  // slice of grads, so the caller's buffer needs no zeroing; layer 0 skips dx since nobody uses
  // the gradient of the data.
  for (size_t i = n; i-- > 0;) {
    const float* in = i == 0 ? x : acts_[i].data();
    float* dx = i == 0 ? nullptr : grads_acts_[i].data();
    layers_[i]->Backward(LayerParams(params, i), in, acts_[i + 1].data(),
                         grads_acts_[i + 1].data(),
                         grads.subspan(param_offsets_[i], layers_[i]->num_params()), dx,
                         LayerPass(i, batch, /*training=*/true, key));
  }
}

EvalResult Model::Evaluate(std::span<const float> params, const float* x, const uint8_t* labels,
                           size_t batch) {
  ForwardAll(params, x, batch, /*training=*/false, BatchKey{});
  const size_t n = layers_.size();
  const size_t classes = num_classes();
  EvalResult result;
  for (size_t i = 0; i < batch; i++) {
    const float* row = acts_[n].data() + i * classes;  // (C)
    const size_t label = labels[i];
    result.loss_sum += CrossEntropyRow(row, classes, label, nullptr, 0.0);
    if (Argmax(row, classes) == label) result.correct++;
  }
  result.count = static_cast<int64_t>(batch);
  return result;
}

std::string ToString(const Shape& shape) {
  return fmt::format("{}x{}x{}", shape.channels, shape.height, shape.width);
}

}  // namespace pipesgd::layers
