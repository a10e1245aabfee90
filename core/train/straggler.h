// Straggler injection for experiments (SDPipe artifact's `--hetero h`: a worker sleeps h seconds
// with probability 0.1 at every step; ../shared/docs/papers.md Sec. 2.6). Wraps the objective,
// so every training mode sees the same slow ranks.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/train/trainer.h"

namespace pipesgd::train {

struct StragglerOptions {
  std::vector<int> ranks;    // the ranks that straggle
  double sleep_s = 0;        // seconds per delayed step, >= 0
  double probability = 0.1;  // per step, in [0, 1]
  uint64_t seed = 1;
};

// Whether `rank` sleeps before step `step`: a pure function of (seed, rank, step), so a run
// is reproducible and independent of timing.
bool StragglerSleeps(const StragglerOptions& options, int rank, int64_t step);

// An Objective that sleeps sleep_s before computing the gradient of a step when
// StragglerSleeps says so, then forwards to `inner` (which must outlive it).
class StragglerObjective : public Objective {
 public:
  StragglerObjective(Objective& inner, const StragglerOptions& options, int rank);
  size_t num_params() const override { return inner_.num_params(); }
  float ComputeGradient(int64_t step, std::span<const float> params,
                        std::span<float> grads) override;
  float ComputeGradientOnDevice(int64_t step, std::span<const float> params,
                                float* device_grads) override;
  int64_t sleeps() const { return sleeps_; }

 private:
  void MaybeSleep(int64_t step);

  Objective& inner_;
  StragglerOptions options_;
  int rank_;
  bool active_;
  int64_t sleeps_ = 0;
};

}  // namespace pipesgd::train
