// An in-memory classification dataset and the sampler that cuts it into per-rank batches.
//
// Sharding rule: epoch e is a seeded permutation of the sample indices (same on every rank);
// global batch t of the epoch is perm[t*G, (t+1)*G) with G = batch_size * world_size, and rank r
// takes the slice [r*batch_size, (r+1)*batch_size) of it. So the samples of global batch t do not
// depend on the world size, and 1 worker with batch 4b sees exactly what 4 workers with batch b
// see together. A trailing partial global batch is dropped (every rank runs the same number of
// steps).
//
// The permutation of epoch e (data/dataset.cc; changing it changes every run's sample order):
//   key    = Rng(seed).NextU64()
//   stream = Rng(key ^ e).NextU64()
//   perm   = iota(N), then Fisher-Yates with Rng(stream): for i = N down to 2,
//            swap(perm[i-1], perm[Below(i)])
// with Rng = pipesgd::pipesgd::Rng (SplitMix64), identical on every platform.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace pipesgd::data {

struct Dataset {
  size_t count = 0;
  size_t rows = 0;
  size_t cols = 0;
  size_t features = 0;          // rows * cols
  std::vector<uint8_t> pixels;  // (count, features)
  std::vector<uint8_t> labels;  // (count)
  int num_classes = 0;
};

// Loads images and labels and checks they agree (same count; Error kDataLoss naming both files
// and both counts otherwise). `limit` > 0 keeps only the first `limit` samples (all of them if
// there are fewer). Errors from the IDX reader (core/data/idx.h) propagate unchanged.
Dataset LoadDataset(const std::string& images_path, const std::string& labels_path,
                    int num_classes, size_t limit = 0);

// How pixels become model inputs: x = (pixel / 255 - mean) / std. Standardising the inputs
// (mean 0.2860, std 0.3530 for the Fashion-MNIST training set, as torchvision's Normalize does)
// makes SGD converge markedly faster than raw [0, 1] pixels.
struct InputScaling {
  float mean = 0.0f;
  float std = 1.0f;  // > 0
};

// Checks that `test` can be fed to a model trained on `train`: same image shape (rows x cols)
// and same number of classes. Throws Error kDataLoss naming both files and both shapes.
void CheckSameShape(const Dataset& train, const std::string& train_path, const Dataset& test,
                    const std::string& test_path);

// Copies samples `indices` into x (n, features), scaled as above, and labels (n).
void GatherBatch(const Dataset& dataset, std::span<const uint32_t> indices, float* x,
                 uint8_t* labels, const InputScaling& scaling = {});

class Sampler {
 public:
  // REQUIRES: batch_size >= 1, 0 <= rank < world_size. If the dataset is smaller than one
  // global batch, steps_per_epoch() is 0 (the caller reports that as bad input).
  Sampler(size_t num_samples, size_t batch_size, int rank, int world_size, uint64_t seed);

  size_t steps_per_epoch() const { return steps_per_epoch_; }

  // This rank's batch_size sample indices for global batch `step` (< steps_per_epoch()) of
  // epoch `epoch` (0-based). The permutation is computed once per epoch and cached.
  std::span<const uint32_t> Batch(int epoch, size_t step);

 private:
  size_t num_samples_;
  size_t batch_size_;
  int rank_;
  int world_size_;
  uint64_t seed_;
  size_t steps_per_epoch_;
  int cached_epoch_ = -1;
  std::vector<uint32_t> perm_;
};

}  // namespace pipesgd::data
