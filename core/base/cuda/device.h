// CUDA devices for every part of pipesgd that runs on one (the layers' GPU backend, layers/cuda;
// the collective's GPU side, core/cuda): finding devices, checking CUDA runtime calls through the
// project's error mechanism, RAII owners for device memory, pinned host memory, streams and
// events, and a DeviceContext (one device and its stream). cuBLAS and cuDNN are the layers'
// (layers/cuda/device.h: Context).
//
// Compiled only when CMake finds the CUDA toolkit (PIPESGD_CUDA=AUTO|ON, see the top-level
// CMakeLists.txt); the binaries then link libcudart and libcublas but run on machines without a
// GPU or driver: CudaDeviceCount() returns 0 there and nothing else is called.
//
// Run on an H200 (docs/gpu.md); the development and CI machines have no GPU.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include <cuda_runtime.h>

namespace pipesgd::cuda {

// CUDA devices usable by this process (0 when there is no GPU, no driver, or the driver is too
// old for the runtime; never throws). `why_none` (optional) gets the runtime's reason for 0.
int CudaDeviceCount(std::string* why_none = nullptr);

// For `pipesgd info`: the runtime version this was built with, the driver, and each device
// ("0: NVIDIA H200, sm_90, 139 GiB"), or why there is none.
std::string CudaDescription();

// Throws Error(kInternal) "CUDA call <call> failed on device <device>: <name> (<description>)"
// when `status` is not cudaSuccess; kUnavailable for "no device"/"insufficient driver", and
// kIo for out-of-memory (so that a full GPU reads as a resource problem, not a bug).
void CheckCuda(cudaError_t status, const char* call, int device);

// PSGD_CUDA(cudaMemcpy(...)) checks the call and names it in the error; `device` must be in
// scope (the device index the call runs on).
#define PSGD_CUDA(call) ::pipesgd::cuda::CheckCuda((call), #call, device)

// Device memory of `count` elements of T (cudaMalloc), on the device current when constructed.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t count, int device);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    std::swap(device_, other.device_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
  int device_ = 0;
};

// Page-locked host memory of `count` elements (cudaMallocHost), so that cudaMemcpyAsync from or
// to it really is asynchronous and runs at full PCIe/NVLink-C2C speed.
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(size_t count, int device);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    std::swap(device_, other.device_);
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  T* data() const { return data_; }
  size_t size() const { return count_; }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
  int device_ = 0;
};

class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  // Blocks until everything queued so far has run; throws the first asynchronous error.
  void Synchronize(const char* what) const;

 private:
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

class Event {
 public:
  explicit Event(int device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }
  void Record(cudaStream_t stream);
  void Synchronize(const char* what) const;

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = 0;
};

// One device and one stream on it: what the collective's GPU side (core/cuda) queues its copies
// and kernels on. The layers' Context (layers/cuda/device.h) adds cuBLAS and cuDNN to it.
class DeviceContext {
 public:
  // Selects `device` (cudaSetDevice). Throws Error(kUnavailable) naming the index and the number
  // of devices when there is no such device (or none at all), kInternal for a failing call.
  explicit DeviceContext(int device);
  virtual ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_->get(); }
  // e.g. "GPU 0 (NVIDIA H200, sm_90)".
  const std::string& description() const { return description_; }
  void Synchronize(const char* what) const { stream_->Synchronize(what); }

 private:
  int device_;
  std::string description_;
  std::unique_ptr<Stream> stream_;
};

}  // namespace pipesgd::cuda
