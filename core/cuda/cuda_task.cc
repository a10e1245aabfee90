#include "core/cuda/cuda_task.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::cuda {

CudaClassifierTask::CudaClassifierTask(DeviceContext& ctx, layers::DeviceModel& model,
                                       DeviceParams& params,
                                       const data::Dataset& train, size_t batch_size,
                                       size_t max_batch, int rank, int world_size, uint64_t seed,
                                       const data::InputScaling& scaling)
    : ctx_(ctx),
      model_(model),
      params_(params),
      train_(train),
      batch_size_(batch_size),
      max_batch_(max_batch),
      rank_(rank),
      seed_(seed),
      scaling_(scaling),
      sampler_(train.count, batch_size, rank, world_size, seed),
      host_x_(max_batch * train.features, ctx.device()),
      host_labels_(max_batch, ctx.device()),
      x_(max_batch * train.features, ctx.device()),
      labels_(max_batch, ctx.device()) {
  PSGD_CHECK_GE(max_batch, batch_size);
  PSGD_CHECK_EQ(model.in_features(), train.features);
  PSGD_CHECK_EQ(params.values.size(), model.num_params());
}

void CudaClassifierTask::EnsureCurrent(std::span<const float> params) {
  if (params_.current) return;
  const int device = ctx_.device();
  PSGD_CHECK_EQ(params.size(), params_.values.size());
  PSGD_CUDA(cudaMemcpyAsync(params_.values.data(), params.data(), params.size_bytes(),
                            cudaMemcpyHostToDevice, ctx_.stream()));
  ctx_.Synchronize("uploading the parameters");
  params_.current = true;
}

void CudaClassifierTask::Upload(size_t n, size_t features) {
  const int device = ctx_.device();
  // From pinned memory, so the copies are truly asynchronous on the compute stream.
  PSGD_CUDA(cudaMemcpyAsync(x_.data(), host_x_.data(), n * features * sizeof(float),
                            cudaMemcpyHostToDevice, ctx_.stream()));
  PSGD_CUDA(cudaMemcpyAsync(labels_.data(), host_labels_.data(), n, cudaMemcpyHostToDevice,
                            ctx_.stream()));
}

float CudaClassifierTask::Run(int64_t step, std::span<const float> params, float* device_grads) {
  EnsureCurrent(params);
  const size_t per_epoch = sampler_.steps_per_epoch();
  PSGD_CHECK_GT(per_epoch, 0u);
  const int epoch = static_cast<int>(step / static_cast<int64_t>(per_epoch));
  const size_t index = static_cast<size_t>(step % static_cast<int64_t>(per_epoch));
  auto batch = sampler_.Batch(epoch, index);
  data::GatherBatch(train_, batch, host_x_.data(), host_labels_.data(), scaling_);
  Upload(batch.size(), train_.features);
  // The same key as train::ClassifierTask: the random layers draw what the CPU path draws.
  const layers::BatchKey key{.seed = seed_,
                             .step = static_cast<uint64_t>(step),
                             .first_row = static_cast<uint64_t>(rank_) * batch_size_};
  return model_.ForwardBackward(params_.values.data(), x_.data(), labels_.data(), batch.size(),
                                device_grads, key);
}

float CudaClassifierTask::ComputeGradient(int64_t step, std::span<const float> params,
                                          std::span<float> grads) {
  PSGD_CHECK_EQ(grads.size(), params_.grads.size());
  const float loss = Run(step, params, params_.grads.data());
  const int device = ctx_.device();
  PSGD_CUDA(cudaMemcpyAsync(grads.data(), params_.grads.data(), grads.size_bytes(),
                            cudaMemcpyDeviceToHost, ctx_.stream()));
  ctx_.Synchronize("copying the gradient to the host");
  return loss;
}

float CudaClassifierTask::ComputeGradientOnDevice(int64_t step, std::span<const float> params,
                                                  float* device_grads) {
  // ForwardBackward has waited for the stream (it read the loss): the slot is complete.
  return Run(step, params, device_grads);
}

layers::EvalResult CudaClassifierTask::EvaluateShard(std::span<const float> params,
                                                     const data::Dataset& test, int rank,
                                                     int world_size) {
  EnsureCurrent(params);
  const size_t begin = test.count * rank / world_size;
  const size_t end = test.count * (rank + 1) / world_size;
  layers::EvalResult total;
  std::vector<uint32_t> indices;
  for (size_t start = begin; start < end; start += max_batch_) {
    const size_t n = std::min(max_batch_, end - start);
    indices.resize(n);
    std::iota(indices.begin(), indices.end(), static_cast<uint32_t>(start));
    data::GatherBatch(test, indices, host_x_.data(), host_labels_.data(), scaling_);
    Upload(n, test.features);
    layers::EvalResult r = model_.Evaluate(params_.values.data(), x_.data(), labels_.data(), n);
    total.loss_sum += r.loss_sum;
    total.correct += r.correct;
    total.count += r.count;
  }
  return total;
}

CudaSgdOptimizer::CudaSgdOptimizer(DeviceContext& ctx, DeviceParams& params,
                                   std::unique_ptr<layers::DeviceSgd> sgd)
    : ctx_(ctx), params_(params), sgd_(std::move(sgd)) {}

void CudaSgdOptimizer::Apply(std::span<float> params, std::span<const float> grads) {
  const int device = ctx_.device();
  PSGD_CHECK_EQ(grads.size(), params_.grads.size());
  PSGD_CUDA(cudaMemcpyAsync(params_.grads.data(), grads.data(), grads.size_bytes(),
                            cudaMemcpyHostToDevice, ctx_.stream()));
  Step(params, params_.grads.data());
}

void CudaSgdOptimizer::ApplyFromDevice(std::span<float> params, const float* device_grads) {
  Step(params, device_grads);
}

void CudaSgdOptimizer::Step(std::span<float> params, const float* device_grads) {
  const int device = ctx_.device();
  PSGD_CHECK_EQ(params.size(), params_.values.size());
  if (!params_.current) {
    PSGD_CUDA(cudaMemcpyAsync(params_.values.data(), params.data(), params.size_bytes(),
                              cudaMemcpyHostToDevice, ctx_.stream()));
  }
  sgd_->Step(params_.values.data(), device_grads, params.size());
  PSGD_CUDA(cudaMemcpyAsync(params.data(), params_.values.data(), params.size_bytes(),
                            cudaMemcpyDeviceToHost, ctx_.stream()));
  ctx_.Synchronize("an SGD step");
  params_.current = true;
}

}  // namespace pipesgd::cuda
