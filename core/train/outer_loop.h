// The outer loop of local SGD and DiLoCo as pieces of the pipelined trainer (core/train/
// trainer.h), so that the ring, the codecs with error feedback, PowerSGD, the synchronous
// warm-up and the one-step-late pipeline with its weight prediction all apply to it unchanged:
//
//   one trainer step  = one round: H inner steps of this rank alone (LocalRounds, an Objective
//                       whose "gradient" is the round's pseudo-gradient: start minus local weights)
//   the averaged gradient = the averaged pseudo-gradient, AllReduced through the trainer's ring
//   the optimizer     = the outer optimizer (OuterOptimizer: model averaging or Nesterov)
//   width 1           = DiLoCo (the round's AllReduce blocks before the next round)
//   width 2, kLocalGradient = the round's AllReduce runs behind the next round's inner steps,
//                       and the next round starts from the outer step with this rank's own
//                       pseudo-gradient in place of the average still in flight (the "eager"
//                       outer update of Kale et al., 2025: Pipe-SGD one level up)
//
// docs/outer_loop.md has the recurrences and their sources.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/train/trainer.h"

namespace pipesgd::train {

enum class OuterKind {
  kAverage,   // w -= d: every rank takes the mean of the ranks' local weights (plain local SGD)
  kNesterov,  // DiLoCo's outer step
};

// The outer step on the averaged pseudo-gradient d (the round's start weights minus the local
// weights it ended with, averaged over ranks):
//   kAverage:  w = w - d
//   kNesterov: buf = d (first round), buf = momentum * buf + d (later); w = w - lr * (d +
//              momentum * buf), torch.optim.SGD(nesterov=True, dampening=0)'s arithmetic.
// The first `average_first` rounds (the synchronous warm-up's rounds of one step) are kAverage
// whatever the kind, and leave the Nesterov state untouched.
class OuterOptimizer final : public Optimizer {
 public:
  // Throws Error(kInvalidArgument) naming a learning rate <= 0 or a momentum outside [0, 1).
  OuterOptimizer(OuterKind kind, float learning_rate, float momentum, size_t num_params,
                 int64_t average_first = 0);
  void Apply(std::span<float> params, std::span<const float> grads) override;
  void Predict(std::span<const float> params, std::span<const std::span<const float>> grads,
               std::span<float> out) const override;
  // 1 float (1 before the first Nesterov step, 0 after), the rounds applied so far, then the
  // momentum buffer (kNesterov only).
  std::vector<float> SaveState() const override;
  void LoadState(std::span<const float> state) override;

 private:
  // Round `round`'s step on w (one parameter at a time: Apply and Predict share it).
  void StepOne(std::span<float> w, std::span<const float> d, std::vector<float>& buf, bool& first,
               int64_t round) const;

  OuterKind kind_;
  float lr_;
  float momentum_;
  size_t n_;
  int64_t average_first_;
  std::vector<float> buf_;
  bool first_ = true;
  int64_t applied_ = 0;
  mutable std::vector<float> scratch_;  // Predict's buffer for more than one step ahead
};

// The inner steps of a round, as the trainer's Objective. The trainer computes "the gradient" of
// round r at its point p (w[r], or the prediction of it): Begin(p) before the round's first inner
// step, InnerStep for each of its steps, and then the trainer's Step calls ComputeGradient(r, p),
// which gives p - x (x: the local weights after the round) and the round's mean inner loss.
class LocalRounds final : public Objective {
 public:
  // `inner` computes this rank's gradient of a global inner step; `optimizer` applies it to the
  // local weights (its state, momentum, carries over from round to round on this rank unless
  // Begin resets it). Both must outlive this.
  LocalRounds(Objective& inner, Optimizer& optimizer);

  size_t num_params() const override { return inner_.num_params(); }
  // Starts a round at `start` (the trainer's NextGradientPoint(), which must stay unchanged
  // until ComputeGradient); with `fresh_optimizer` the inner optimizer starts the round as it
  // was made (no momentum).
  void Begin(std::span<const float> start, bool fresh_optimizer = false);
  // One inner step: this rank's gradient of global inner step `step` at the local weights,
  // applied to them. Returns its loss.
  float InnerStep(int64_t step);
  // Inner steps since Begin.
  int64_t inner_steps() const { return inner_steps_; }
  // grads = params - x, where params must be the round's start (Begin's); returns the mean loss
  // of the round's inner steps. REQUIRES: at least one InnerStep since Begin.
  float ComputeGradient(int64_t round, std::span<const float> params,
                        std::span<float> grads) override;
  // The local weights (for tests and the progress line's loss).
  std::span<const float> local() const { return x_; }

 private:
  Objective& inner_;
  Optimizer& optimizer_;
  std::vector<float> x_;      // the local weights
  std::vector<float> g_;      // one inner gradient
  std::vector<float> fresh_;  // the inner optimizer's state as it was made
  const float* start_ = nullptr;
  int64_t inner_steps_ = 0;
  double loss_sum_ = 0;
};

}  // namespace pipesgd::train
