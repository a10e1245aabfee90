// The layers' CUDA context: a DeviceContext (core/base/cuda/device.h: devices, memory, streams,
// events) with the cuBLAS handle and, where built, the cuDNN handle bound to its stream.
//
// Compiled only when CMake finds the CUDA toolkit (PIPESGD_CUDA=AUTO|ON, see the top-level
// CMakeLists.txt); the binaries then link libcudart and libcublas but run on machines without a
// GPU or driver: CudaDeviceCount() returns 0 there and nothing else is called.
//
// Run on an H200 (docs/gpu.md); the development and CI machines have no GPU.
#pragma once

#include <cublas_v2.h>
#ifdef PIPESGD_HAVE_CUDNN
#include <cudnn.h>
#endif

#include "core/base/cuda/device.h"

namespace pipesgd::cuda {

// As CheckCuda, for a cuBLAS status ("CUBLAS_STATUS_EXECUTION_FAILED").
void CheckCublas(cublasStatus_t status, const char* call, int device);
#define PSGD_CUBLAS(call) ::pipesgd::cuda::CheckCublas((call), #call, device)

// One device, one compute stream and one cuBLAS handle bound to it: what the layers, the loss
// and the optimizer run on. Everything they queue runs in order on stream().
class Context : public DeviceContext {
 public:
  // As DeviceContext; also creates the cuBLAS handle (full FP32 math) on the stream.
  explicit Context(int device);
  ~Context() override;

  cublasHandle_t cublas() const { return cublas_; }
#ifdef PIPESGD_HAVE_CUDNN
  // Made on first use (loading cuDNN), on this context's stream.
  cudnnHandle_t cudnn();
#endif

 private:
  cublasHandle_t cublas_ = nullptr;
#ifdef PIPESGD_HAVE_CUDNN
  cudnnHandle_t cudnn_ = nullptr;
#endif
};

}  // namespace pipesgd::cuda
