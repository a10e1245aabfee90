// AllReduce of a buffer the ring cannot touch directly (GPU memory over a transport that moves
// host memory: TCP, UCX without CUDA), by staging it through host buffers segment by segment:
//
//   segment:   0        1        2        3
//   D2H        [0]      [1]      [2]      [3]
//   ring             [0]      [1]      [2]      [3]
//   H2D                    [0]      [1]      [2]      [3]
//
// While the ring reduces segment i in host staging lane i mod L, the copier already moves
// segment i+1 (up to i+L-1) device-to-host into the next lane(s) and segment i-1 host-to-device
// out of its lane, so with L >= 2 lanes the two copies hide behind the network. A lane is
// refilled only after its previous host-to-device copy has finished reading it (the copier
// orders that itself, on the GPU without blocking the host).
//
// The copies are behind StagingCopier so that this pipeline's logic runs, and is tested, on the
// CPU (HostStagingCopier: plain memcpy, executed lazily in issue order so a missing wait shows up
// as a wrong sum); core/cuda/cuda_staging.h is the CUDA copier (pinned lanes, two copy
// streams and events), tested on an H200 by tests/cuda_staging_test.cc.
//
// The reduction itself is the host ring's (Communicator::AllReduce on each staged segment), so
// results are those of the host ring: integer sums below 2^24 are exact, codecs apply per
// segment. Not done (see docs/gpu.md): reducing received chunks on the GPU inside the ring, and
// ibverbs GPUDirect without staging (the ring's reduction reads its buffer on the CPU).
// The trainer's device gradient slots (core/cuda/cuda_gradients.h) are reduced through this.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/base/deadline.h"
#include "core/collective/ring_allreduce.h"

namespace pipesgd::collective {

// Asynchronous copies between "device" memory and L host staging lanes of segment_elems floats.
class StagingCopier {
 public:
  virtual ~StagingCopier() = default;
  virtual int lanes() const = 0;
  virtual size_t segment_elems() const = 0;
  // The staging buffer of `lane` (segment_elems floats, registered-able host memory).
  virtual float* host(int lane) = 0;
  // Called once before a staged collective: later copies see what the producer of the device
  // data (e.g. the compute stream) wrote before this call.
  virtual void Begin() = 0;
  // Queues device[0, n) -> host(lane)[0, n); starts only after the lane's previous ToDevice has
  // finished reading host(lane).
  virtual void ToHost(int lane, const float* device, size_t n) = 0;
  // Blocks until the lane's last ToHost is complete (its host buffer holds the data).
  virtual void WaitToHost(int lane) = 0;
  // Queues host(lane)[0, n) -> device[0, n).
  virtual void ToDevice(int lane, float* device, size_t n) = 0;
  // Blocks until every queued copy is complete.
  virtual void WaitAll() = 0;
};

// The CPU stand-in for tests: "device" memory is ordinary memory; copies are plain memcpy,
// deferred until a wait, then run in the order they were queued (a valid serial order of what a
// GPU's copy streams would do), so reading a lane before WaitToHost sees stale data. Logs every
// call ("to_host lane L n N", "wait_to_host lane L", "to_device lane L n N", "wait_all") for
// tests that check the overlap order.
class HostStagingCopier final : public StagingCopier {
 public:
  HostStagingCopier(int lanes, size_t segment_elems);
  int lanes() const override { return static_cast<int>(lanes_.size()); }
  size_t segment_elems() const override { return segment_elems_; }
  float* host(int lane) override { return lanes_[lane].data(); }
  void Begin() override { log_.push_back("begin"); }
  void ToHost(int lane, const float* device, size_t n) override;
  void WaitToHost(int lane) override;
  void ToDevice(int lane, float* device, size_t n) override;
  void WaitAll() override;
  const std::vector<std::string>& log() const { return log_; }
  // The most copies that were queued and not yet run at once (>= 2 means overlap happened).
  size_t max_pending() const { return max_pending_; }

 private:
  struct Copy {
    float* dst;
    const float* src;
    size_t n;
    int lane;
    bool to_host;
  };
  void RunUntil(size_t index);  // runs pending_[0, index]

  size_t segment_elems_;
  std::vector<std::vector<float>> lanes_;
  std::vector<Copy> pending_;
  std::vector<std::string> log_;
  size_t max_pending_ = 0;
};

struct StagingOptions {
  // Segment size: the unit of the copy/ring/copy pipeline (bytes, multiple of 4, >= 4). Bigger
  // segments waste less per ring call; smaller ones overlap sooner. Default 4 MiB.
  uint64_t segment_bytes = 4 << 20;
  int lanes = 2;  // host staging buffers, >= 2
};

// Registers the copier's lanes with comm's transport once (so RDMA transports need no per-call
// registration) and runs staged collectives. Both must outlive it. As a GradientReducer it reduces
// a span of DEVICE memory (the device gradient slots, core/cuda/cuda_gradients.h): the span is
// never read on the host.
class StagedAllReduce final : public GradientReducer {
 public:
  // Throws Error(kInvalidArgument) when the copier has fewer than 2 lanes or no segment, or the
  // communicator uses error feedback (its residual is per call size; segments would reset it).
  StagedAllReduce(Communicator& comm, StagingCopier& copier);
  ~StagedAllReduce();

  // As Communicator::AllReduce on the device buffer data[0, count): every rank calls it in the
  // same order with the same count. call.exact_tail counts from the end of the whole buffer.
  // Each segment is one collective on comm (sequence numbers advance by the segment count).
  // Throws what Communicator::AllReduce throws; the copier is drained before it returns or
  // throws.
  // `reduced` (optional) sees each segment's result in its host lane, after the ring and before
  // the host-to-device copy: (offset of the segment in data, its values). Segments come in order.
  using SegmentObserver = std::function<void(size_t offset, std::span<const float> values)>;
  void AllReduce(float* data, size_t count, ReduceOp op, Deadline deadline,
                 const std::atomic<bool>* abort = nullptr, const AllReduceOptions& call = {},
                 const SegmentObserver& reduced = nullptr);
  // The same on device memory data[0, data.size()), with the observer set_observer gave.
  void AllReduce(std::span<float> data, ReduceOp op, Deadline deadline,
                 const std::atomic<bool>* abort, const AllReduceOptions& call) override {
    AllReduce(data.data(), data.size(), op, deadline, abort, call, observer_);
  }
  void set_observer(SegmentObserver observer) { observer_ = std::move(observer); }
  // What the last AllReduce sent, summed over its segments.
  const WireStats& last_wire_stats() const override { return stats_; }

 private:
  Communicator& comm_;
  StagingCopier& copier_;
  std::vector<std::unique_ptr<transport::MemoryRegion>> regions_;
  WireStats stats_;
  SegmentObserver observer_;
};

}  // namespace pipesgd::collective
