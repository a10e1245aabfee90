#include "core/train/classifier_task.h"

#include <algorithm>
#include <numeric>

#include "core/base/check.h"

namespace pipesgd::train {

ClassifierTask::ClassifierTask(layers::Model& model, const data::Dataset& train,
                               size_t batch_size, int rank, int world_size, uint64_t seed,
                               const data::InputScaling& scaling)
    : model_(model),
      train_(train),
      batch_size_(batch_size),
      rank_(rank),
      seed_(seed),
      scaling_(scaling),
      sampler_(train.count, batch_size, rank, world_size, seed),
      x_(batch_size * train.features),
      labels_(batch_size) {
  PSGD_CHECK_GE(model.max_batch(), batch_size);
  PSGD_CHECK_EQ(model.in_features(), train.features);
}

float ClassifierTask::ComputeGradient(int64_t step, std::span<const float> params,
                                      std::span<float> grads) {
  const size_t per_epoch = sampler_.steps_per_epoch();
  PSGD_CHECK_GT(per_epoch, 0u);
  const int epoch = static_cast<int>(step / static_cast<int64_t>(per_epoch));
  const size_t index = static_cast<size_t>(step % static_cast<int64_t>(per_epoch));
  auto batch = sampler_.Batch(epoch, index);
  data::GatherBatch(train_, batch, x_.data(), labels_.data(), scaling_);
  const layers::BatchKey key{.seed = seed_,
                             .step = static_cast<uint64_t>(step),
                             .first_row = static_cast<uint64_t>(rank_) * batch_size_};
  float loss;
  {
    timeline::Span span(timeline_, timeline::kCompute, "forward");
    loss = model_.Forward(params, x_.data(), labels_.data(), batch.size(), key);
  }
  timeline::Span span(timeline_, timeline::kCompute, "backward");
  model_.Backward(params, x_.data(), batch.size(), grads, key);
  return loss;
}

layers::EvalResult ClassifierTask::EvaluateShard(std::span<const float> params,
                                                 const data::Dataset& test, int rank,
                                                 int world_size) {
  const size_t begin = test.count * rank / world_size;
  const size_t end = test.count * (rank + 1) / world_size;
  layers::EvalResult total;
  std::vector<uint32_t> indices;
  const size_t batch = model_.max_batch();
  std::vector<float> x(batch * test.features);
  std::vector<uint8_t> labels(batch);
  for (size_t start = begin; start < end; start += batch) {
    const size_t n = std::min(batch, end - start);
    indices.resize(n);
    std::iota(indices.begin(), indices.end(), static_cast<uint32_t>(start));
    data::GatherBatch(test, indices, x.data(), labels.data(), scaling_);
    layers::EvalResult r = model_.Evaluate(params, x.data(), labels.data(), n);
    total.loss_sum += r.loss_sum;
    total.correct += r.correct;
    total.count += r.count;
  }
  return total;
}

}  // namespace pipesgd::train
