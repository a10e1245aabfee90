// The layers' CUDA context and cuBLAS checks; see device.h.
#include "layers/cuda/device.h"

#include "layers/cuda/cublas_loader.h"
#ifdef PIPESGD_HAVE_CUDNN
#include "layers/cuda/cudnn_loader.h"
#endif

#include <fmt/format.h>

#include "core/base/error.h"

namespace pipesgd::cuda {

void CheckCublas(cublasStatus_t status, const char* call, int device) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  Throw(status == CUBLAS_STATUS_ALLOC_FAILED ? ErrorCode::kIo : ErrorCode::kInternal,
        "cuBLAS call {} failed on device {}: {} ({})", call, device,
        Cublas().status_name(status), Cublas().status_string(status));
}

Context::Context(int device) : DeviceContext(device) {
  PSGD_CUBLAS(Cublas().create(&cublas_));
  PSGD_CUBLAS(Cublas().set_stream(cublas_, stream()));
  // Full FP32 GEMMs: no TF32 tensor-core shortcut (10-bit mantissa), so that the GPU layers stay
  // within 1e-4 of the CPU layers and a GPU step equals a CPU step within float rounding.
  PSGD_CUBLAS(Cublas().set_math_mode(cublas_, CUBLAS_PEDANTIC_MATH));
}

Context::~Context() {
#ifdef PIPESGD_HAVE_CUDNN
  if (cudnn_ != nullptr) Cudnn().destroy(cudnn_);
#endif
  if (cublas_ != nullptr) Cublas().destroy(cublas_);
}

#ifdef PIPESGD_HAVE_CUDNN
cudnnHandle_t Context::cudnn() {
  if (cudnn_ == nullptr) {
    const int device = this->device();
    PSGD_CUDA(cudaSetDevice(device));
    cudnnHandle_t handle = nullptr;
    PSGD_CUDNN(Cudnn().create(&handle));
    cudnn_ = handle;
    PSGD_CUDNN(Cudnn().set_stream(cudnn_, stream()));
  }
  return cudnn_;
}
#endif

}  // namespace pipesgd::cuda
