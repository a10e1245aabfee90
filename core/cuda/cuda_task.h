// The main job's classifier task and SGD on the GPU, behind the trainer's Objective and Optimizer
// interfaces (core/train/trainer.h), for model.device = CUDA.
//
// What lives where: the parameters are resident on the GPU (one contiguous device buffer, the CPU
// layout) and mirrored on the host after every update (the trainer's params span: checkpoints and
// evaluation on other ranks read it). The gradient of each step is computed on the GPU:
//   - with device gradient slots (the default, CudaDeviceGradients in cuda_gradients.h) straight
//     into the trainer's device slot, which is AllReduced staged through pinned host lanes, and
//     the optimizer steps from that slot (ComputeGradientOnDevice / ApplyFromDevice);
//   - with host slots (comm.error_feedback, which the staged AllReduce refuses) it is copied into
//     the trainer's host slot, reduced there, and copied back by the optimizer.
// Batches are gathered into pinned host buffers and copied asynchronously.
//
// Run on an NVIDIA H200 (tests/cuda_*_test.cc, and 4-rank training over loopback TCP); see
// docs/gpu.md for what ran there.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/data/dataset.h"
#include "core/train/trainer.h"
#include "core/base/cuda/device.h"
#include "layers/device_model.h"

namespace pipesgd::cuda {

// Device parameters shared by the task and the optimizer, and whether they equal the host copy.
struct DeviceParams {
  DeviceParams(DeviceContext& ctx, size_t n) : values(n, ctx.device()), grads(n, ctx.device()) {}
  DeviceBuffer<float> values;
  DeviceBuffer<float> grads;  // this step's gradient, and the reduced one before Apply
  bool current = false;       // values == the trainer's host params
};

class CudaClassifierTask : public train::Objective {
 public:
  // As train::ClassifierTask; everything must outlive the task. REQUIRES batch_size <= the
  // model's max batch, model.in_features() == train.features.
  CudaClassifierTask(DeviceContext& ctx, layers::DeviceModel& model, DeviceParams& params,
                     const data::Dataset& train, size_t batch_size, size_t max_batch, int rank,
                     int world_size, uint64_t seed, const data::InputScaling& scaling = {});

  size_t num_params() const override { return model_.num_params(); }
  size_t steps_per_epoch() const { return sampler_.steps_per_epoch(); }
  float ComputeGradient(int64_t step, std::span<const float> params,
                        std::span<float> grads) override;
  float ComputeGradientOnDevice(int64_t step, std::span<const float> params,
                                float* device_grads) override;
  // As train::ClassifierTask::EvaluateShard, on the GPU (params: the host copy, uploaded if the
  // device copy is not current).
  layers::EvalResult EvaluateShard(std::span<const float> params, const data::Dataset& test,
                                   int rank, int world_size);

 private:
  void EnsureCurrent(std::span<const float> params);
  // Uploads batch `step` and runs forward/backward into device_grads; returns the loss.
  float Run(int64_t step, std::span<const float> params, float* device_grads);
  // Copies n samples (already gathered into the pinned buffers) to the device, asynchronously.
  void Upload(size_t n, size_t features);

  DeviceContext& ctx_;
  layers::DeviceModel& model_;
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
  // `sgd`: the layers' SGD on ctx's device (layers::Gpu::MakeSgd).
  CudaSgdOptimizer(DeviceContext& ctx, DeviceParams& params,
                   std::unique_ptr<layers::DeviceSgd> sgd);
  // Uploads the reduced gradient, steps on the GPU, mirrors the parameters to the host.
  void Apply(std::span<float> params, std::span<const float> grads) override;
  // Steps on the GPU from the device gradient, mirrors the parameters to the host.
  void ApplyFromDevice(std::span<float> params, const float* device_grads) override;
  std::vector<float> SaveState() const override { return sgd_->SaveState(); }
  void LoadState(std::span<const float> state) override { sgd_->LoadState(state); }

 private:
  void Step(std::span<float> params, const float* device_grads);

  DeviceContext& ctx_;
  DeviceParams& params_;
  std::unique_ptr<layers::DeviceSgd> sgd_;
};

}  // namespace pipesgd::cuda
