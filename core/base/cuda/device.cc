// CUDA runtime wrappers; see device.h. Compiled by the host C++ compiler against the CUDA
// runtime headers (no kernels here).
#include "core/base/cuda/device.h"

#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::cuda {

int CudaDeviceCount(std::string* why_none) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (why_none != nullptr) {
      *why_none = fmt::format("{} ({})", cudaGetErrorName(status), cudaGetErrorString(status));
    }
    cudaGetLastError();  // clear the sticky "no device" state for later calls
    return 0;
  }
  if (count == 0 && why_none != nullptr) *why_none = "the CUDA runtime reports 0 devices";
  return count;
}

std::string CudaDescription() {
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  int driver = 0;
  cudaDriverGetVersion(&driver);  // 0 when no driver is installed
  std::string out = fmt::format("runtime {}.{}, driver {}", runtime / 1000, runtime % 1000 / 10,
                                driver == 0 ? std::string("none")
                                            : fmt::format("{}.{}", driver / 1000,
                                                          driver % 1000 / 10));
  std::string why;
  const int count = CudaDeviceCount(&why);
  if (count == 0) return out + fmt::format("; no CUDA device: {}", why);
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) continue;
    out += fmt::format("; {}: {}, sm_{}{}, {:.0f} GiB", d, prop.name, prop.major, prop.minor,
                       static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  }
  return out;
}

void CheckCuda(cudaError_t status, const char* call, int device) {
  if (status == cudaSuccess) return;
  ErrorCode code = ErrorCode::kInternal;
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver ||
      status == cudaErrorInvalidDevice) {
    code = ErrorCode::kUnavailable;
  } else if (status == cudaErrorMemoryAllocation) {
    code = ErrorCode::kIo;
  }
  Throw(code, "CUDA call {} failed on device {}: {} ({})", call, device,
        cudaGetErrorName(status), cudaGetErrorString(status));
}

template <typename T>
DeviceBuffer<T>::DeviceBuffer(size_t count, int device) : count_(count), device_(device) {
  if (count == 0) return;
  void* p = nullptr;
  try {
    PSGD_CUDA(cudaMalloc(&p, count * sizeof(T)));
  } catch (const Error& e) {
    throw e.Wrap(fmt::format("allocating {} bytes of device memory", count * sizeof(T)));
  }
  data_ = static_cast<T*>(p);
}

template <typename T>
DeviceBuffer<T>::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);  // errors here are stale asynchronous ones; ignore
}

template <typename T>
PinnedBuffer<T>::PinnedBuffer(size_t count, int device) : count_(count), device_(device) {
  if (count == 0) return;
  void* p = nullptr;
  try {
    PSGD_CUDA(cudaMallocHost(&p, count * sizeof(T)));
  } catch (const Error& e) {
    throw e.Wrap(fmt::format("allocating {} bytes of pinned host memory", count * sizeof(T)));
  }
  data_ = static_cast<T*>(p);
}

template <typename T>
PinnedBuffer<T>::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

template class DeviceBuffer<float>;
template class DeviceBuffer<double>;
template class DeviceBuffer<uint8_t>;
template class DeviceBuffer<std::byte>;
template class DeviceBuffer<uint32_t>;
template class DeviceBuffer<unsigned long long>;
template class PinnedBuffer<float>;
template class PinnedBuffer<uint8_t>;
template class PinnedBuffer<double>;
template class PinnedBuffer<std::byte>;
template class PinnedBuffer<unsigned long long>;

Stream::Stream(int device) : device_(device) {
  PSGD_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}
Stream::~Stream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}
void Stream::Synchronize(const char* what) const {
  const int device = device_;
  try {
    PSGD_CUDA(cudaStreamSynchronize(stream_));
  } catch (const Error& e) {
    throw e.Wrap(what);
  }
}

Event::Event(int device) : device_(device) {
  PSGD_CUDA(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}
Event::~Event() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}
void Event::Record(cudaStream_t stream) {
  const int device = device_;
  PSGD_CUDA(cudaEventRecord(event_, stream));
}
void Event::Synchronize(const char* what) const {
  const int device = device_;
  try {
    PSGD_CUDA(cudaEventSynchronize(event_));
  } catch (const Error& e) {
    throw e.Wrap(what);
  }
}

DeviceContext::DeviceContext(int device) : device_(device) {
  std::string why;
  const int count = CudaDeviceCount(&why);
  if (count == 0) {
    Throw(ErrorCode::kUnavailable, "GPU {} requested, but there is no CUDA device: {}", device,
          why);
  }
  if (device < 0 || device >= count) {
    Throw(ErrorCode::kUnavailable, "GPU {} requested, but this machine has {} CUDA device(s) "
          "(valid indices 0..{})", device, count, count - 1);
  }
  PSGD_CUDA(cudaSetDevice(device));
  cudaDeviceProp prop{};
  PSGD_CUDA(cudaGetDeviceProperties(&prop, device));
  description_ = fmt::format("GPU {} ({}, sm_{}{})", device, prop.name, prop.major, prop.minor);
  stream_ = std::make_unique<Stream>(device);
}

DeviceContext::~DeviceContext() = default;

}  // namespace pipesgd::cuda
