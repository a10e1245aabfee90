// The trainer's K gradient slots and how one is reduced over the ranks: one store, in host memory
// (HostGradientSlots, here: the ring or PowerSGD reduces a slot in place) or in device memory
// (cuda::CudaDeviceGradients, core/cuda/cuda_gradients.h: the staged AllReduce reduces it through
// pinned host lanes). Every slot holds num_params + 1 floats: the gradient, then the rank's loss,
// so the loss averaged over ranks arrives with the aggregate. Each store reduces through a
// collective::GradientReducer; the trainer (core/train/trainer.h) sees only this interface.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/base/deadline.h"
#include "core/collective/ring_allreduce.h"

namespace pipesgd::train {

class Objective;  // core/train/trainer.h
class Optimizer;

// What the trainer needs to know of a reduced gradient slot before it applies it: the averaged
// loss (the slot's last element) and the first non-finite element, if any.
struct SlotSummary {
  float loss = 0;
  int64_t first_nonfinite = -1;  // element index, -1: all finite
  float nonfinite_value = 0;
};

// Builds a SlotSummary from a slot's values seen piece by piece (e.g. each staged segment in its
// host lane while it is reduced), so the trainer needs no extra pass over device memory.
class SlotSummaryBuilder {
 public:
  explicit SlotSummaryBuilder(size_t elems) : elems_(elems) {}
  void Add(size_t offset, std::span<const float> values);
  SlotSummary Get() const { return summary_; }

 private:
  size_t elems_;
  SlotSummary summary_;
};

// The trainer calls every method but AllReduce on its compute thread and AllReduce on its
// communication thread, never two calls on the same slot at once.
class GradientSlots {
 public:
  virtual ~GradientSlots() = default;
  virtual int slots() const = 0;
  virtual size_t slot_elems() const = 0;  // num_params + 1
  // Slot i in host memory, where the slots are there (the weight prediction of a staleness
  // compensation reads the rank's own gradient and the aggregate); empty where they are not.
  virtual std::span<float> host_slot(int /*i*/) { return {}; }
  // Computes g[step] at `at` into slot i, the loss last (ordered before the slot's next
  // AllReduce).
  virtual void Compute(Objective& objective, int i, int64_t step, std::span<const float> at) = 0;
  // Averages slot i over the ranks in place, as Communicator::AllReduce; throws what it throws.
  virtual void AllReduce(int i, collective::ReduceOp op, Deadline deadline,
                         const std::atomic<bool>* abort,
                         const collective::AllReduceOptions& call) = 0;
  // What the last AllReduce sent (all of it, over however many collectives it took).
  virtual collective::WireStats last_wire_stats() const = 0;
  // The loss in slot i as it is now: the rank-averaged one after its AllReduce.
  virtual float Loss(int i) = 0;
  // Loss and first non-finite element of slot i as it is now (after its AllReduce or a Write).
  virtual SlotSummary Summary(int i) = 0;
  // Applies slot i's aggregate (its first num_params floats) to `params` with `optimizer`.
  virtual void Apply(Optimizer& optimizer, int i, std::span<float> params) = 0;
  // Blocking copies of the whole of slot i to and from host memory (checkpoints).
  virtual void Read(int i, std::span<float> out) = 0;
  virtual void Write(int i, std::span<const float> in) = 0;
  // False where reducing keeps state that a checkpoint would not hold (GradientReducer's).
  virtual bool checkpointable() const { return true; }
};

// Slots in host memory, registered once with the ring's transport (RDMA transports then move
// them with no per-step registration), reduced by `reducer`: the ring itself or PowerSGD.
class HostGradientSlots final : public GradientSlots {
 public:
  // comm and reducer must outlive this.
  HostGradientSlots(collective::Communicator& comm, collective::GradientReducer& reducer,
                    int slots, size_t slot_elems);

  int slots() const override { return static_cast<int>(buffers_.size()); }
  size_t slot_elems() const override { return slot_elems_; }
  std::span<float> host_slot(int i) override { return buffers_.at(static_cast<size_t>(i)); }
  void Compute(Objective& objective, int i, int64_t step, std::span<const float> at) override;
  void AllReduce(int i, collective::ReduceOp op, Deadline deadline, const std::atomic<bool>* abort,
                 const collective::AllReduceOptions& call) override;
  collective::WireStats last_wire_stats() const override { return reducer_.last_wire_stats(); }
  float Loss(int i) override { return host_slot(i).back(); }
  SlotSummary Summary(int i) override;
  void Apply(Optimizer& optimizer, int i, std::span<float> params) override;
  void Read(int i, std::span<float> out) override;
  void Write(int i, std::span<const float> in) override;
  bool checkpointable() const override { return reducer_.checkpointable(); }

 private:
  collective::GradientReducer& reducer_;
  size_t slot_elems_;
  std::vector<std::vector<float>> buffers_;
  std::vector<std::unique_ptr<transport::MemoryRegion>> regions_;
};

}  // namespace pipesgd::train
