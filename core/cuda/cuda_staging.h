// The CUDA StagingCopier (core/collective/staged_allreduce.h): L pinned host lanes, a
// device-to-host and a host-to-device copy stream, and per-lane events, so that the two copy
// directions run on the GPU's copy engines while the host ring reduces another segment.
// Ordering without blocking the host: a lane's ToHost waits (cudaStreamWaitEvent) for the lane's
// last ToDevice; Begin() makes the copies wait for everything queued on the compute stream.
//
// The pipeline logic above it runs on the CPU in tests/staged_allreduce_test.cc with
// HostStagingCopier; tests/cuda_staging_test.cc runs this copier where a GPU exists (exact sums on
// an H200; docs/gpu.md).
#pragma once

#include <memory>
#include <vector>

#include "core/collective/staged_allreduce.h"
#include "core/base/cuda/device.h"

namespace pipesgd::cuda {

class CudaStagingCopier final : public collective::StagingCopier {
 public:
  // `compute` is the stream that produces the device data (DeviceContext::stream()).
  CudaStagingCopier(DeviceContext& ctx, int lanes, size_t segment_elems);
  ~CudaStagingCopier() override;

  int lanes() const override { return static_cast<int>(lanes_.size()); }
  size_t segment_elems() const override { return segment_elems_; }
  float* host(int lane) override { return lanes_[lane].data(); }
  // Begin() makes the copies wait for `ready` (recorded by the producer when the data was
  // complete) instead of everything queued on the compute stream so far, which may already hold
  // the next step's work. For the next Begin() only; the event must outlive it.
  void UseReadyEvent(const Event* ready) { producer_ready_ = ready; }
  void Begin() override;
  void ToHost(int lane, const float* device, size_t n) override;
  void WaitToHost(int lane) override;
  void ToDevice(int lane, float* device, size_t n) override;
  void WaitAll() override;

 private:
  DeviceContext& ctx_;
  size_t segment_elems_;
  std::vector<PinnedBuffer<float>> lanes_;
  Stream d2h_, h2d_;
  Event ready_;  // recorded on the compute stream by Begin()
  const Event* producer_ready_ = nullptr;
  std::vector<std::unique_ptr<Event>> to_host_done_, to_device_done_;
  std::vector<bool> to_device_recorded_;
};

}  // namespace pipesgd::cuda
