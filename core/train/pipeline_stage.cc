#include "core/train/pipeline_stage.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/rng.h"

namespace pipesgd::train {

std::vector<size_t> BalancedBoundaries(const std::vector<size_t>& layer_params, int stages) {
  const size_t n = layer_params.size();
  if (stages < 1 || static_cast<size_t>(stages) > n) {
    Throw(ErrorCode::kInvalidArgument,
          "cannot split {} layers into {} pipeline stages (need 1 <= stages <= layers)", n,
          stages);
  }
  std::vector<double> prefix(n + 1, 0.0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + static_cast<double>(layer_params[i]);
  const double total = prefix[n];
  std::vector<size_t> boundaries;
  size_t prev = 0;
  for (int k = 1; k < stages; ++k) {
    const double target = total * k / stages;
    const size_t lo = prev + 1;
    const size_t hi = n - static_cast<size_t>(stages - k);
    size_t best = lo;
    for (size_t j = lo; j <= hi; ++j) {
      if (std::abs(prefix[j] - target) < std::abs(prefix[best] - target)) best = j;
    }
    boundaries.push_back(best);
    prev = best;
  }
  return boundaries;
}

void CheckBoundaries(const std::vector<size_t>& boundaries, size_t layers) {
  size_t prev = 0;
  for (size_t k = 0; k < boundaries.size(); ++k) {
    if (boundaries[k] <= prev || boundaries[k] >= layers) {
      Throw(ErrorCode::kInvalidArgument,
            "pipeline boundary {} is {}: boundaries must be strictly ascending layer indices in "
            "[1, {}) (the model has {} layers; each stage needs at least one)",
            k, boundaries[k], layers, layers);
    }
    prev = boundaries[k];
  }
}

PipelineStage::PipelineStage(std::vector<std::unique_ptr<layers::Layer>> layers,
                             size_t first_layer, bool has_loss, size_t max_batch,
                             int max_in_flight, std::span<const float> params)
    : layers_(std::move(layers)),
      first_layer_(first_layer),
      has_loss_(has_loss),
      max_batch_(max_batch) {
  if (layers_.empty()) Throw(ErrorCode::kInvalidArgument, "a pipeline stage needs >= 1 layer");
  if (max_batch_ == 0) Throw(ErrorCode::kInvalidArgument, "max_batch must be at least 1");
  if (max_in_flight < 1) {
    Throw(ErrorCode::kInvalidArgument, "max_in_flight is {}, must be >= 1", max_in_flight);
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i] == nullptr) {
      Throw(ErrorCode::kInvalidArgument, "layer {} is null", first_layer_ + i);
    }
    if (i > 0 && layers_[i]->in_shape() != layers_[i - 1]->out_shape()) {
      Throw(ErrorCode::kInvalidArgument, "layer {} {} takes {} but layer {} {} outputs {}",
            first_layer_ + i, layers_[i]->name(), layers::ToString(layers_[i]->in_shape()),
            first_layer_ + i - 1, layers_[i - 1]->name(),
            layers::ToString(layers_[i - 1]->out_shape()));
    }
    param_offsets_.push_back(num_params_);
    num_params_ += layers_[i]->num_params();
  }
  if (params.size() != num_params_) {
    Throw(ErrorCode::kInvalidArgument, "stage of layers {}..{} has {} parameters, got {}",
          first_layer_, first_layer_ + layers_.size() - 1, num_params_, params.size());
  }
  params_.assign(params.begin(), params.end());

  // Everything a micro-batch needs is allocated once per slot, so steps never allocate.
  slots_.resize(static_cast<size_t>(max_in_flight));
  for (auto& slot : slots_) {
    slot.weights.resize(num_params_);
    slot.acts.resize(layers_.size() + 1);
    slot.grad_acts.resize(layers_.size() + 1);
    slot.acts[0].resize(max_batch_ * layers_.front()->in_features());
    slot.grad_acts[0].resize(max_batch_ * layers_.front()->in_features());
    for (size_t i = 0; i < layers_.size(); ++i) {
      slot.acts[i + 1].resize(max_batch_ * layers_[i]->out_features());
      slot.grad_acts[i + 1].resize(max_batch_ * layers_[i]->out_features());
      slot.workspaces.emplace_back(layers_[i]->workspace_bytes(max_batch_));
    }
  }
}

std::string PipelineStage::Describe() const {
  std::string out;
  for (const auto& layer : layers_) {
    if (!out.empty()) out += ' ';
    out += layer->name();
  }
  return fmt::format("layers {}..{}: {}: {} params", first_layer_,
                     first_layer_ + layers_.size() - 1, out, num_params_);
}

PipelineStage::Slot& PipelineStage::SlotFor(int mb) {
  PSGD_CHECK_GE(mb, 0);
  return slots_[static_cast<size_t>(mb) % slots_.size()];
}

const PipelineStage::Slot& PipelineStage::SlotFor(int mb) const {
  PSGD_CHECK_GE(mb, 0);
  return slots_[static_cast<size_t>(mb) % slots_.size()];
}

float* PipelineStage::InputBuffer(int mb) {
  Slot& slot = SlotFor(mb);
  if (slot.forwarded) {
    Throw(ErrorCode::kInvalidArgument,
          "stage at layer {}: micro-batch {} needs slot {}, still held by micro-batch {} (more "
          "than {} in flight)",
          first_layer_, mb, static_cast<size_t>(mb) % slots_.size(), slot.mb, slots_.size());
  }
  return slot.acts[0].data();
}

layers::Pass PipelineStage::LayerPass(Slot& slot, size_t i) {
  layers::Pass pass;
  pass.batch = slot.batch;
  pass.training = true;
  pass.key = pipesgd::RandomKey(slot.key.seed, slot.key.step, first_layer_ + i);
  pass.first_row = slot.key.first_row;
  pass.workspace =
      std::span<std::byte>(slot.workspaces[i].data(), layers_[i]->workspace_bytes(slot.batch));
  return pass;
}

float PipelineStage::Forward(int mb, size_t batch, const layers::BatchKey& key,
                             const uint8_t* labels) {
  if (batch < 1 || batch > max_batch_) {
    Throw(ErrorCode::kInvalidArgument, "micro-batch of {} rows, the stage allows 1..{}", batch,
          max_batch_);
  }
  if (has_loss_ && labels == nullptr) {
    Throw(ErrorCode::kInvalidArgument, "the last pipeline stage needs labels for its loss");
  }
  InputBuffer(mb);  // throws if the slot is busy
  Slot& slot = SlotFor(mb);
  slot.mb = mb;
  slot.batch = batch;
  slot.key = key;
  slot.version = version_;
  std::copy(params_.begin(), params_.end(), slot.weights.begin());
  const std::span<const float> w(slot.weights);
  for (size_t i = 0; i < layers_.size(); ++i) {
    layers_[i]->Forward(w.subspan(param_offsets_[i], layers_[i]->num_params()),
                        slot.acts[i].data(), slot.acts[i + 1].data(), LayerPass(slot, i));
  }
  slot.forwarded = true;
  if (!has_loss_) return 0.0f;
  return layers::SoftmaxCrossEntropy(slot.acts.back().data(), labels, batch,
                                     layers_.back()->out_features(),
                                     slot.grad_acts.back().data());
}

const float* PipelineStage::Output(int mb) const {
  const Slot& slot = SlotFor(mb);
  PSGD_CHECK_EQ(slot.mb, mb);
  return slot.acts.back().data();
}

float* PipelineStage::OutputGradBuffer(int mb) {
  Slot& slot = SlotFor(mb);
  PSGD_CHECK_EQ(slot.mb, mb);
  return slot.grad_acts.back().data();
}

int64_t PipelineStage::Backward(int mb, std::span<float> grads) {
  PSGD_CHECK_EQ(grads.size(), num_params_);
  Slot& slot = SlotFor(mb);
  if (slot.mb != mb || !slot.forwarded) {
    Throw(ErrorCode::kInvalidArgument,
          "stage at layer {}: backward of micro-batch {}, which is not in flight", first_layer_,
          mb);
  }
  // The stashed weights, not the latest ones: the gradient belongs to the forward's version.
  const std::span<const float> w(slot.weights);
  const bool need_input_grad = first_layer_ > 0;
  for (size_t i = layers_.size(); i-- > 0;) {
    float* dx = (i == 0 && !need_input_grad) ? nullptr : slot.grad_acts[i].data();
    layers_[i]->Backward(w.subspan(param_offsets_[i], layers_[i]->num_params()),
                         slot.acts[i].data(), slot.acts[i + 1].data(),
                         slot.grad_acts[i + 1].data(),
                         grads.subspan(param_offsets_[i], layers_[i]->num_params()), dx,
                         LayerPass(slot, i));
  }
  slot.forwarded = false;
  return slot.version;
}

const float* PipelineStage::InputGrad(int mb) const {
  const Slot& slot = SlotFor(mb);
  PSGD_CHECK_EQ(slot.mb, mb);
  return slot.grad_acts[0].data();
}

void PipelineStage::Update(Optimizer& optimizer, std::span<const float> grads) {
  PSGD_CHECK_EQ(grads.size(), num_params_);
  optimizer.Apply(params_, grads);
  ++version_;
}

void PipelineStage::SetParams(std::span<const float> params) {
  if (params.size() != num_params_) {
    Throw(ErrorCode::kInvalidArgument, "SetParams got {} floats, the stage has {}",
          params.size(), num_params_);
  }
  std::copy(params.begin(), params.end(), params_.begin());
  ++version_;
}

StageSlice StageSliceOf(const std::vector<size_t>& layer_params,
                        const std::vector<size_t>& boundaries, int stage) {
  PSGD_CHECK(stage >= 0 && static_cast<size_t>(stage) <= boundaries.size());
  StageSlice slice;
  slice.first_layer = stage == 0 ? 0 : boundaries[static_cast<size_t>(stage) - 1];
  slice.end_layer = static_cast<size_t>(stage) == boundaries.size()
                        ? layer_params.size()
                        : boundaries[static_cast<size_t>(stage)];
  PSGD_CHECK(slice.first_layer <= slice.end_layer && slice.end_layer <= layer_params.size());
  for (size_t i = 0; i < slice.first_layer; ++i) slice.param_offset += layer_params[i];
  for (size_t i = slice.first_layer; i < slice.end_layer; ++i) slice.param_count += layer_params[i];
  return slice;
}

}  // namespace pipesgd::train
