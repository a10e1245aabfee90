#include "core/cuda/cuda_staging.h"

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::cuda {

CudaStagingCopier::CudaStagingCopier(DeviceContext& ctx, int lanes, size_t segment_elems)
    : ctx_(ctx),
      segment_elems_(segment_elems),
      d2h_(ctx.device()),
      h2d_(ctx.device()),
      ready_(ctx.device()) {
  for (int i = 0; i < lanes; ++i) {
    lanes_.emplace_back(segment_elems, ctx.device());
    to_host_done_.push_back(std::make_unique<Event>(ctx.device()));
    to_device_done_.push_back(std::make_unique<Event>(ctx.device()));
  }
  to_device_recorded_.assign(static_cast<size_t>(lanes), false);
}

CudaStagingCopier::~CudaStagingCopier() {
  // Copies may still be queued after an error: let them finish before the lanes are freed.
  cudaStreamSynchronize(d2h_.get());
  cudaStreamSynchronize(h2d_.get());
}

void CudaStagingCopier::Begin() {
  const int device = ctx_.device();
  cudaEvent_t ready = nullptr;
  if (producer_ready_ != nullptr) {
    ready = producer_ready_->get();
    producer_ready_ = nullptr;
  } else {
    ready_.Record(ctx_.stream());
    ready = ready_.get();
  }
  PSGD_CUDA(cudaStreamWaitEvent(d2h_.get(), ready, 0));
  // A host-to-device copy must not overwrite data the compute stream still reads either.
  PSGD_CUDA(cudaStreamWaitEvent(h2d_.get(), ready, 0));
}

void CudaStagingCopier::ToHost(int lane, const float* device_data, size_t n) {
  PSGD_CHECK_LE(n, segment_elems_);
  const int device = ctx_.device();
  if (to_device_recorded_[lane]) {
    PSGD_CUDA(cudaStreamWaitEvent(d2h_.get(), to_device_done_[lane]->get(), 0));
  }
  PSGD_CUDA(cudaMemcpyAsync(lanes_[lane].data(), device_data, n * sizeof(float),
                            cudaMemcpyDeviceToHost, d2h_.get()));
  to_host_done_[lane]->Record(d2h_.get());
}

void CudaStagingCopier::WaitToHost(int lane) {
  to_host_done_[lane]->Synchronize("a device-to-host staging copy");
}

void CudaStagingCopier::ToDevice(int lane, float* device_data, size_t n) {
  PSGD_CHECK_LE(n, segment_elems_);
  const int device = ctx_.device();
  PSGD_CUDA(cudaMemcpyAsync(device_data, lanes_[lane].data(), n * sizeof(float),
                            cudaMemcpyHostToDevice, h2d_.get()));
  to_device_done_[lane]->Record(h2d_.get());
  to_device_recorded_[lane] = true;
}

void CudaStagingCopier::WaitAll() {
  d2h_.Synchronize("the device-to-host staging copies");
  h2d_.Synchronize("the host-to-device staging copies");
  // Later compute (the optimizer step) must see the reduced values: the compute stream waits
  // for the last host-to-device copy.
  const int device = ctx_.device();
  ready_.Record(h2d_.get());
  PSGD_CUDA(cudaStreamWaitEvent(ctx_.stream(), ready_.get(), 0));
}

}  // namespace pipesgd::cuda
