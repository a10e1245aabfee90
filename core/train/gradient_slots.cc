#include "core/train/gradient_slots.h"

#include <algorithm>
#include <cmath>

#include "core/base/check.h"
#include "core/train/trainer.h"

namespace pipesgd::train {

void SlotSummaryBuilder::Add(size_t offset, std::span<const float> values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) &&
        (summary_.first_nonfinite < 0 ||
         offset + i < static_cast<size_t>(summary_.first_nonfinite))) {
      summary_.first_nonfinite = static_cast<int64_t>(offset + i);
      summary_.nonfinite_value = values[i];
      break;  // later ones in this piece are higher
    }
  }
  if (offset + values.size() == elems_ && !values.empty()) summary_.loss = values.back();
}

HostGradientSlots::HostGradientSlots(collective::Communicator& comm,
                                     collective::GradientReducer& reducer, int slots,
                                     size_t slot_elems)
    : reducer_(reducer), slot_elems_(slot_elems) {
  PSGD_CHECK_GE(slots, 1);
  PSGD_CHECK_GE(slot_elems, 1u);
  buffers_.assign(static_cast<size_t>(slots), std::vector<float>(slot_elems, 0.0f));
  for (auto& buffer : buffers_) regions_.push_back(comm.RegisterMemory(buffer));
}

void HostGradientSlots::Compute(Objective& objective, int i, int64_t step,
                                std::span<const float> at) {
  std::span<float> slot = host_slot(i);
  slot.back() = objective.ComputeGradient(step, at, slot.first(slot_elems_ - 1));
}

void HostGradientSlots::AllReduce(int i, collective::ReduceOp op, Deadline deadline,
                                  const std::atomic<bool>* abort,
                                  const collective::AllReduceOptions& call) {
  reducer_.AllReduce(host_slot(i), op, deadline, abort, call);
}

SlotSummary HostGradientSlots::Summary(int i) {
  SlotSummaryBuilder summary(slot_elems_);
  summary.Add(0, host_slot(i));
  return summary.Get();
}

void HostGradientSlots::Apply(Optimizer& optimizer, int i, std::span<float> params) {
  optimizer.Apply(params, host_slot(i).first(slot_elems_ - 1));
}

void HostGradientSlots::Read(int i, std::span<float> out) {
  PSGD_CHECK_EQ(out.size(), slot_elems_);
  const std::span<const float> slot = host_slot(i);
  std::copy(slot.begin(), slot.end(), out.begin());
}

void HostGradientSlots::Write(int i, std::span<const float> in) {
  PSGD_CHECK_EQ(in.size(), slot_elems_);
  std::copy(in.begin(), in.end(), host_slot(i).begin());
}

}  // namespace pipesgd::train
