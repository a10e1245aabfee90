#include "layers/cuda/cublas_loader.h"

#include <string>

#include <fmt/format.h>

#include "core/base/error.h"
#include "layers/cuda/library.h"

namespace pipesgd::cuda {
namespace {

CublasApi Load() {
  const Library lib = OpenCudaLibrary(
      fmt::format("libcublas.so.{}", CUBLAS_VER_MAJOR), "cuBLAS", "model.device = CUDA",
      "install the CUDA toolkit's libcublas or add its directory to LD_LIBRARY_PATH");
  CublasApi api{};
  Resolve(lib, "cublasCreate_v2", api.create, "cuBLAS");
  Resolve(lib, "cublasDestroy_v2", api.destroy, "cuBLAS");
  Resolve(lib, "cublasSetStream_v2", api.set_stream, "cuBLAS");
  Resolve(lib, "cublasSetMathMode", api.set_math_mode, "cuBLAS");
  Resolve(lib, "cublasSgemm_v2", api.sgemm, "cuBLAS");
  Resolve(lib, "cublasSgemmStridedBatched", api.sgemm_strided_batched, "cuBLAS");
  Resolve(lib, "cublasGetStatusName", api.status_name, "cuBLAS");
  Resolve(lib, "cublasGetStatusString", api.status_string, "cuBLAS");
  return api;
}

}  // namespace

const CublasApi& Cublas() { return LoadedOnce<CublasApi, Load>(); }

}  // namespace pipesgd::cuda
