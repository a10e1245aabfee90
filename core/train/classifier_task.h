// The training task of the main job: a layers::Model classifying a data::Dataset, seen by the
// trainer only as an Objective (core/train/trainer.h). Step t of the run is global batch
// (t mod steps_per_epoch) of epoch (t div steps_per_epoch); this rank computes on its slice
// (core/data/dataset.h), so the run's samples do not depend on the world size. The random layers
// (Dropout) are keyed by (seed, step, global row of the sample), so they do not depend on it
// either, and a resumed run draws what the uninterrupted one would have.
#pragma once

#include <span>
#include <vector>

#include "core/data/dataset.h"
#include "core/base/timeline.h"
#include "core/train/trainer.h"
#include "layers/model.h"
#include "layers/sgd.h"

namespace pipesgd::train {

class ClassifierTask : public Objective {
 public:
  // `model` and `train` must outlive the task. REQUIRES: model.max_batch() >= batch_size.
  ClassifierTask(layers::Model& model, const data::Dataset& train, size_t batch_size, int rank,
                 int world_size, uint64_t seed, const data::InputScaling& scaling = {});

  size_t num_params() const override { return model_.num_params(); }
  size_t steps_per_epoch() const { return sampler_.steps_per_epoch(); }
  float ComputeGradient(int64_t step, std::span<const float> params,
                        std::span<float> grads) override;

  // Loss and accuracy sums of `params` on this rank's shard of `test`: the contiguous range
  // [rank*n/world, (rank+1)*n/world). Summing the results over ranks covers the set once.
  layers::EvalResult EvaluateShard(std::span<const float> params, const data::Dataset& test,
                                   int rank, int world_size);

  // Forward and backward spans on the compute track (null: none). Must outlive the task.
  void set_timeline(timeline::Recorder* recorder) { timeline_ = recorder; }

 private:
  timeline::Recorder* timeline_ = nullptr;
  layers::Model& model_;
  const data::Dataset& train_;
  size_t batch_size_;
  int rank_;
  uint64_t seed_;
  data::InputScaling scaling_;
  data::Sampler sampler_;
  std::vector<float> x_;         // (batch, features)
  std::vector<uint8_t> labels_;  // (batch)
};

// layers::Sgd behind the trainer's Optimizer interface.
class SgdOptimizer : public Optimizer {
 public:
  SgdOptimizer(const layers::SgdOptions& options, size_t num_params) : sgd_(options, num_params) {}
  void Apply(std::span<float> params, std::span<const float> grads) override {
    sgd_.Step(params, grads);
  }
  void Predict(std::span<const float> params, std::span<const std::span<const float>> grads,
               std::span<float> out) const override {
    sgd_.Predict(params, grads, out);
  }
  void ApplyAndPredict(std::span<float> params, std::span<const float> grads,
                       std::span<const float> ahead, std::span<float> out) override {
    sgd_.StepAndPredict(params, grads, ahead, out);
  }
  std::vector<float> SaveState() const override { return sgd_.SaveState(); }
  void LoadState(std::span<const float> state) override { sgd_.LoadState(state); }

 private:
  layers::Sgd sgd_;
};

}  // namespace pipesgd::train
