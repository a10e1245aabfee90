// The main job's classifier task and SGD on the GPU, behind the trainer's Objective and Optimizer
// interfaces (core/train/trainer.h), for model.device = CUDA.
//
// What lives where: the parameters are resident on the GPU (one contiguous device buffer, the CPU
// layout) and mirrored on the host after every update (the trainer's params span: checkpoints and
// the loss/finiteness checks read it); the gradient of each step is computed on the GPU (one
// contiguous device buffer) and copied once into the trainer's gradient slot, which the ring
// AllReduces over host memory as on the CPU path; the optimizer copies the reduced gradient back
// and steps on the GPU. Batches are gathered into pinned host buffers and copied asynchronously.
// Not done here: keeping the gradients on the GPU through the ring (the staged AllReduce,
// core/collective/staged_allreduce.h, is that building block; see docs/gpu.md).
//
// UNTESTED ON A GPU: compiled and linked, never run (no GPU on the machine this was written on).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/data/dataset.h"
#include "core/train/trainer.h"
#include "layers/cuda/cuda_model.h"
#include "layers/cuda/device.h"

namespace pipesgd::cuda {

// Device parameters shared by the task and the optimizer, and whether they equal the host copy.
struct DeviceParams {
  DeviceParams(Context& ctx, size_t n) : values(n, ctx.device()), grads(n, ctx.device()) {}
  DeviceBuffer<float> values;
  DeviceBuffer<float> grads;  // this step's gradient, and the reduced one before Apply
  bool current = false;       // values == the trainer's host params
};

class CudaClassifierTask : public train::Objective {
 public:
  // As train::ClassifierTask; everything must outlive the task. REQUIRES batch_size <= the
  // model's max batch, model.in_features() == train.features.
  CudaClassifierTask(Context& ctx, CudaModel& model, DeviceParams& params,
                     const data::Dataset& train, size_t batch_size, size_t max_batch, int rank,
                     int world_size, uint64_t seed, const data::InputScaling& scaling = {});

  size_t num_params() const override { return model_.num_params(); }
  size_t steps_per_epoch() const { return sampler_.steps_per_epoch(); }
  float ComputeGradient(int64_t step, std::span<const float> params,
                        std::span<float> grads) override;
  // As train::ClassifierTask::EvaluateShard, on the GPU (params: the host copy, uploaded if the
  // device copy is not current).
  layers::EvalResult EvaluateShard(std::span<const float> params, const data::Dataset& test,
                                   int rank, int world_size);

 private:
  void EnsureCurrent(std::span<const float> params);
  // Copies n samples (already gathered into the pinned buffers) to the device, asynchronously.
  void Upload(size_t n, size_t features);

  Context& ctx_;
  CudaModel& model_;
  DeviceParams& params_;
  const data::Dataset& train_;
  size_t batch_size_;
  size_t max_batch_;
  int rank_;
  uint64_t seed_;
  data::InputScaling scaling_;
  data::Sampler sampler_;
  PinnedBuffer<float> host_x_;
  PinnedBuffer<uint8_t> host_labels_;
  DeviceBuffer<float> x_;
  DeviceBuffer<uint8_t> labels_;
};

class CudaSgdOptimizer : public train::Optimizer {
 public:
  CudaSgdOptimizer(Context& ctx, DeviceParams& params, const layers::SgdOptions& options);
  // Uploads the reduced gradient, steps on the GPU, mirrors the parameters to the host.
  void Apply(std::span<float> params, std::span<const float> grads) override;
  std::vector<float> SaveState() const override { return sgd_.SaveState(); }
  void LoadState(std::span<const float> state) override { sgd_.LoadState(state); }

 private:
  Context& ctx_;
  DeviceParams& params_;
  CudaSgd sgd_;
};

}  // namespace pipesgd::cuda
