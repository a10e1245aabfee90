#include "core/cuda/cuda_gradients.h"

#include <algorithm>
#include <cstdint>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/cuda/gradient_kernels.h"

namespace pipesgd::cuda {

CudaDeviceGradients::CudaDeviceGradients(DeviceContext& ctx, collective::Communicator& comm, int slots,
                                         size_t slot_elems,
                                         const collective::StagingOptions& staging)
    : ctx_(ctx),
      slot_elems_(slot_elems),
      summaries_(static_cast<size_t>(slots)),
      losses_(static_cast<size_t>(slots), ctx.device()),
      first_bad_(1, ctx.device()),
      host_first_bad_(1, ctx.device()) {
  PSGD_CHECK_GE(slots, 1);
  PSGD_CHECK_GE(slot_elems, 1u);
  for (int i = 0; i < slots; ++i) {
    slots_.emplace_back(slot_elems, ctx.device());
    ready_.push_back(std::make_unique<Event>(ctx.device()));
  }
  const size_t segment =
      std::clamp<size_t>(staging.segment_bytes / sizeof(float), 1, slot_elems);
  copier_ = std::make_unique<CudaStagingCopier>(ctx, staging.lanes, segment);
  staged_ = std::make_unique<collective::StagedAllReduce>(comm, *copier_);
}

CudaDeviceGradients::~CudaDeviceGradients() = default;

void CudaDeviceGradients::AllReduce(int i, collective::ReduceOp op, Deadline deadline,
                                    const std::atomic<bool>* abort,
                                    const collective::AllReduceOptions& call) {
  const int device = ctx_.device();
  // The current device is per host thread, and this is the communication thread.
  PSGD_CUDA(cudaSetDevice(device));
  summaries_[i].reset();
  train::SlotSummaryBuilder summary(slot_elems_);
  copier_->UseReadyEvent(ready_[i].get());
  staged_->set_observer([&summary](size_t offset, std::span<const float> values) {
    summary.Add(offset, values);
  });
  struct Unobserve {  // `summary` ends with this call, however it ends
    collective::StagedAllReduce& staged;
    ~Unobserve() { staged.set_observer(nullptr); }
  } unobserve{*staged_};
  staged_->AllReduce(std::span<float>(slot(i), slot_elems_), op, deadline, abort, call);
  summaries_[i] = summary.Get();
}

void CudaDeviceGradients::Compute(train::Objective& objective, int i, int64_t step,
                                  std::span<const float> at) {
  SetLoss(i, objective.ComputeGradientOnDevice(step, at, slot(i)));
}

void CudaDeviceGradients::Apply(train::Optimizer& optimizer, int i, std::span<float> params) {
  optimizer.ApplyFromDevice(params, slot(i));
}

void CudaDeviceGradients::SetLoss(int i, float loss) {
  const int device = ctx_.device();
  // The cell is rewritten only K steps later, after this slot's AllReduce has copied it.
  losses_.data()[i] = loss;
  PSGD_CUDA(cudaMemcpyAsync(slot(i) + slot_elems_ - 1, losses_.data() + i, sizeof(float),
                            cudaMemcpyHostToDevice, ctx_.stream()));
  ready_[i]->Record(ctx_.stream());
}

train::SlotSummary CudaDeviceGradients::Summary(int i) {
  if (summaries_[i]) return *summaries_[i];
  const int device = ctx_.device();
  train::SlotSummary summary;
  PSGD_CUDA(
      gradient_kernels::FirstNonFinite(slot(i), slot_elems_, first_bad_.data(), ctx_.stream()));
  PSGD_CUDA(cudaMemcpyAsync(host_first_bad_.data(), first_bad_.data(), sizeof(uint64_t),
                            cudaMemcpyDeviceToHost, ctx_.stream()));
  PSGD_CUDA(cudaMemcpyAsync(&summary.loss, slot(i) + slot_elems_ - 1, sizeof(float),
                            cudaMemcpyDeviceToHost, ctx_.stream()));
  ctx_.Synchronize("checking a gradient slot for non-finite values");
  const unsigned long long bad = host_first_bad_.data()[0];
  if (bad != UINT64_MAX) {
    summary.first_nonfinite = static_cast<int64_t>(bad);
    PSGD_CUDA(cudaMemcpy(&summary.nonfinite_value, slot(i) + bad, sizeof(float),
                         cudaMemcpyDeviceToHost));
  }
  summaries_[i] = summary;
  return summary;
}

void CudaDeviceGradients::Read(int i, std::span<float> out) {
  PSGD_CHECK_EQ(out.size(), slot_elems_);
  const int device = ctx_.device();
  PSGD_CUDA(cudaMemcpyAsync(out.data(), slot(i), out.size_bytes(), cudaMemcpyDeviceToHost,
                            ctx_.stream()));
  ctx_.Synchronize("reading a gradient slot");
}

void CudaDeviceGradients::Write(int i, std::span<const float> in) {
  PSGD_CHECK_EQ(in.size(), slot_elems_);
  const int device = ctx_.device();
  PSGD_CUDA(cudaMemcpyAsync(slot(i), in.data(), in.size_bytes(), cudaMemcpyHostToDevice,
                            ctx_.stream()));
  ctx_.Synchronize("writing a gradient slot");
  summaries_[i].reset();
}

}  // namespace pipesgd::cuda
