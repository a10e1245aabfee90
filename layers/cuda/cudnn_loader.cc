#include "layers/cuda/cudnn_loader.h"

#include <string>

#include <fmt/format.h>

#include "core/base/error.h"
#include "layers/cuda/library.h"

namespace pipesgd::cuda {
namespace {

CudnnApi Load() {
  constexpr const char* kWhat = "cuDNN";
  const Library lib =
      OpenCudaLibrary(fmt::format("libcudnn.so.{}", CUDNN_MAJOR), kWhat,
                      "model.device = CUDA with model.gpu_kernels = CUDNN",
                      "install cuDNN (it ships with the CUDA toolkit here) or add its directory to "
                      "LD_LIBRARY_PATH, or set model.gpu_kernels = CUBLAS");
  CudnnApi api{};
  Resolve(lib, "cudnnGetVersion", api.get_version, kWhat);
  Resolve(lib, "cudnnGetErrorString", api.error_string, kWhat);
  Resolve(lib, "cudnnCreate", api.create, kWhat);
  Resolve(lib, "cudnnDestroy", api.destroy, kWhat);
  Resolve(lib, "cudnnSetStream", api.set_stream, kWhat);
  Resolve(lib, "cudnnCreateTensorDescriptor", api.create_tensor, kWhat);
  Resolve(lib, "cudnnSetTensor4dDescriptor", api.set_tensor_4d, kWhat);
  Resolve(lib, "cudnnDestroyTensorDescriptor", api.destroy_tensor, kWhat);
  Resolve(lib, "cudnnCreateFilterDescriptor", api.create_filter, kWhat);
  Resolve(lib, "cudnnSetFilter4dDescriptor", api.set_filter_4d, kWhat);
  Resolve(lib, "cudnnDestroyFilterDescriptor", api.destroy_filter, kWhat);
  Resolve(lib, "cudnnCreateConvolutionDescriptor", api.create_convolution, kWhat);
  Resolve(lib, "cudnnSetConvolution2dDescriptor", api.set_convolution_2d, kWhat);
  Resolve(lib, "cudnnSetConvolutionMathType", api.set_convolution_math_type, kWhat);
  Resolve(lib, "cudnnDestroyConvolutionDescriptor", api.destroy_convolution, kWhat);
  Resolve(lib, "cudnnGetConvolution2dForwardOutputDim", api.forward_output_dim, kWhat);
  Resolve(lib, "cudnnGetConvolutionForwardAlgorithm_v7", api.forward_algorithms, kWhat);
  Resolve(lib, "cudnnGetConvolutionBackwardDataAlgorithm_v7", api.backward_data_algorithms, kWhat);
  Resolve(lib, "cudnnGetConvolutionBackwardFilterAlgorithm_v7", api.backward_filter_algorithms,
          kWhat);
  Resolve(lib, "cudnnConvolutionForward", api.forward, kWhat);
  Resolve(lib, "cudnnConvolutionBackwardData", api.backward_data, kWhat);
  Resolve(lib, "cudnnConvolutionBackwardFilter", api.backward_filter, kWhat);
  Resolve(lib, "cudnnConvolutionBackwardBias", api.backward_bias, kWhat);
  Resolve(lib, "cudnnAddTensor", api.add_tensor, kWhat);
  // cudnnGetVersion is major * 10000 + minor * 100 + patch in cuDNN 9.
  const size_t version = api.get_version();
  if (version / 10000 != CUDNN_MAJOR) {
    Throw(ErrorCode::kUnavailable,
          "cuDNN: {} reports version {}, expected major version {} (this pipesgd was built "
          "with cuDNN {}.{}.{})",
          lib.path, version, CUDNN_MAJOR, CUDNN_MAJOR, CUDNN_MINOR, CUDNN_PATCHLEVEL);
  }
  return api;
}

}  // namespace

const CudnnApi& Cudnn() { return LoadedOnce<CudnnApi, Load>(); }

void CheckCudnn(cudnnStatus_t status, const char* call, int device) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  Throw(status == CUDNN_STATUS_ALLOC_FAILED ? ErrorCode::kIo : ErrorCode::kInternal,
        "cuDNN call {} failed on device {}: {} (status {})", call, device,
        Cudnn().error_string(status), static_cast<int>(status));
}

}  // namespace pipesgd::cuda
