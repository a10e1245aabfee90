// Device gradient slots for the trainer (train::GradientSlots, core/train/gradient_slots.h) on one
// CUDA device: K device buffers of num_params + 1 floats, AllReduced in place through the staged
// AllReduce (core/collective/staged_allreduce.h) with pinned host lanes and two copy streams
// (CudaStagingCopier), so the device-to-host copy of segment i+1, the ring on segment i and the
// host-to-device copy of segment i-1 overlap. The ring itself (and so the reduction of received
// chunks) runs on the host lanes: over TCP and UCX the wire moves host memory anyway.
// The loss and the finiteness check the trainer needs before an update are taken from the host
// lanes while the slot is reduced (SlotSummaryBuilder), so they cost no extra GPU round trip;
// after a Write (a restored checkpoint) they are computed on the GPU instead.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "core/collective/staged_allreduce.h"
#include "core/cuda/cuda_staging.h"
#include "core/train/trainer.h"
#include "core/base/cuda/device.h"

namespace pipesgd::cuda {

class CudaDeviceGradients final : public train::GradientSlots {
 public:
  // `slots` buffers of `slot_elems` floats on ctx's device; segments of
  // min(staging.segment_bytes / 4, slot_elems) floats in staging.lanes pinned lanes. comm and
  // ctx must outlive this. Throws what StagedAllReduce's constructor throws (e.g. error
  // feedback on comm) and kUnavailable / kInternal for CUDA failures.
  CudaDeviceGradients(DeviceContext& ctx, collective::Communicator& comm, int slots, size_t slot_elems,
                      const collective::StagingOptions& staging = {});
  ~CudaDeviceGradients() override;

  int slots() const override { return static_cast<int>(slots_.size()); }
  size_t slot_elems() const override { return slot_elems_; }
  // Device pointer to slot i (slot_elems floats).
  float* slot(int i) { return slots_.at(i).data(); }
  // Stores the loss in slot i's last element, ordered before the slot's next AllReduce (does not
  // block).
  void SetLoss(int i, float loss);
  // The objective's ComputeGradientOnDevice into slot i, then SetLoss.
  void Compute(train::Objective& objective, int i, int64_t step,
               std::span<const float> at) override;
  // Runs on the trainer's communication thread (selects the device there first).
  void AllReduce(int i, collective::ReduceOp op, Deadline deadline,
                 const std::atomic<bool>* abort,
                 const collective::AllReduceOptions& call) override;
  collective::WireStats last_wire_stats() const override { return staged_->last_wire_stats(); }
  float Loss(int i) override { return Summary(i).loss; }
  train::SlotSummary Summary(int i) override;
  // The optimizer's ApplyFromDevice on slot i.
  void Apply(train::Optimizer& optimizer, int i, std::span<float> params) override;
  void Read(int i, std::span<float> out) override;
  void Write(int i, std::span<const float> in) override;

 private:
  DeviceContext& ctx_;
  size_t slot_elems_;
  std::vector<DeviceBuffer<float>> slots_;
  std::unique_ptr<CudaStagingCopier> copier_;
  std::unique_ptr<collective::StagedAllReduce> staged_;
  std::vector<std::optional<train::SlotSummary>> summaries_;
  PinnedBuffer<float> losses_;  // SetLoss's source, pinned so the copy is truly asynchronous
  // Per slot, recorded on the compute stream by SetLoss: the slot's gradient and loss are
  // complete. The staging copies wait for it rather than for the whole compute stream, which by
  // then may hold the next step's forward and backward (Pipe-SGD overlaps exactly those).
  std::vector<std::unique_ptr<Event>> ready_;
  DeviceBuffer<unsigned long long> first_bad_;
  PinnedBuffer<unsigned long long> host_first_bad_;
};

}  // namespace pipesgd::cuda
