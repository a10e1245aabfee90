#include "core/data/dataset.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/data/idx.h"
#include "core/base/rng.h"

namespace pipesgd::data {

Dataset LoadDataset(const std::string& images_path, const std::string& labels_path,
                    int num_classes, size_t limit) {
  IdxImages images = ReadIdxImages(images_path);
  std::vector<uint8_t> labels = ReadIdxLabels(labels_path, num_classes);
  if (images.count != labels.size()) {
    Throw(ErrorCode::kDataLoss,
          "images and labels disagree: {} has {} images but {} has {} labels", images_path,
          images.count, labels_path, labels.size());
  }
  Dataset out;
  out.rows = images.rows;
  out.cols = images.cols;
  out.features = images.rows * images.cols;
  out.count = (limit > 0) ? std::min(limit, images.count) : images.count;
  out.num_classes = num_classes;
  out.pixels = std::move(images.pixels);
  out.pixels.resize(out.count * out.features);
  out.pixels.shrink_to_fit();
  out.labels = std::move(labels);
  out.labels.resize(out.count);
  out.labels.shrink_to_fit();
  return out;
}

void CheckSameShape(const Dataset& train, const std::string& train_path, const Dataset& test,
                    const std::string& test_path) {
  if (train.rows != test.rows || train.cols != test.cols) {
    Throw(ErrorCode::kDataLoss,
          "{} has {}x{} images but {} has {}x{}: a model trained on one cannot be evaluated on "
          "the other",
          test_path, test.rows, test.cols, train_path, train.rows, train.cols);
  }
}

void GatherBatch(const Dataset& dataset, std::span<const uint32_t> indices, float* x,
                 uint8_t* labels, const InputScaling& scaling) {
  PSGD_CHECK_GT(scaling.std, 0.0f);
  // One table lookup per pixel instead of a subtract and a divide.
  float table[256];
  for (int p = 0; p < 256; ++p) {
    table[p] = (static_cast<float>(p) / 255.0f - scaling.mean) / scaling.std;
  }
  const size_t features = dataset.features;
  PSGD_CHECK_EQ(dataset.pixels.size(), dataset.count * features);
  PSGD_CHECK_EQ(dataset.labels.size(), dataset.count);
  for (size_t i = 0; i < indices.size(); ++i) {
    const size_t index = indices[i];
    PSGD_CHECK_LT(index, dataset.count);
    const uint8_t* src = dataset.pixels.data() + index * features;
    float* dst = x + i * features;
    for (size_t j = 0; j < features; ++j) dst[j] = table[src[j]];
    labels[i] = dataset.labels[index];
  }
}

Sampler::Sampler(size_t num_samples, size_t batch_size, int rank, int world_size, uint64_t seed)
    : num_samples_(num_samples),
      batch_size_(batch_size),
      rank_(rank),
      world_size_(world_size),
      seed_(seed),
      steps_per_epoch_(0) {
  PSGD_CHECK_GE(batch_size, size_t{1});
  PSGD_CHECK_GE(world_size, 1);
  PSGD_CHECK_GE(rank, 0);
  PSGD_CHECK_LT(rank, world_size);
  // Indices are uint32_t.
  PSGD_CHECK_LE(num_samples, size_t{std::numeric_limits<uint32_t>::max()} + 1);
  PSGD_CHECK_LE(batch_size, std::numeric_limits<size_t>::max() / static_cast<size_t>(world_size));
  steps_per_epoch_ = num_samples / (batch_size * static_cast<size_t>(world_size));
}

std::span<const uint32_t> Sampler::Batch(int epoch, size_t step) {
  PSGD_CHECK_GE(epoch, 0);
  PSGD_CHECK_LT(step, steps_per_epoch_);
  if (epoch != cached_epoch_) {
    // The epoch's stream: the seed and the epoch each go through a SplitMix64 output step, so
    // nearby (seed, epoch) pairs start far apart in the sequence. (Seeding with
    // seed ^ golden*(epoch+1) would not do: SplitMix64 advances its state by that same golden
    // constant, so epoch e+1's stream would be epoch e's shifted by one draw.)
    const uint64_t seed_key = pipesgd::Rng(seed_).NextU64();
    const uint64_t stream = pipesgd::Rng(seed_key ^ static_cast<uint64_t>(epoch)).NextU64();
    pipesgd::Rng rng(stream);
    perm_.resize(num_samples_);
    std::iota(perm_.begin(), perm_.end(), uint32_t{0});
    // Fisher-Yates: position i takes a uniform pick among positions [0, i].
    for (size_t i = num_samples_; i > 1; --i) {
      const size_t j = static_cast<size_t>(rng.Below(i));
      std::swap(perm_[i - 1], perm_[j]);
    }
    cached_epoch_ = epoch;
  }
  const size_t global = batch_size_ * static_cast<size_t>(world_size_);
  const size_t begin = step * global + static_cast<size_t>(rank_) * batch_size_;
  return std::span<const uint32_t>(perm_.data() + begin, batch_size_);
}

}  // namespace pipesgd::data
