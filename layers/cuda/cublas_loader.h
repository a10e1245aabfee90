// cuBLAS, opened at run time (dlopen) on first use instead of linked: libcublasLt alone is over
// 500 MB, and merely loading it costs every pipesgd process (CPU jobs, tests, the launcher) about
// 0.6 s and 200 MB of memory (measured here: a no-op program linked with -lcublas). Only the
// functions the GPU layers call are resolved.
#pragma once

#include <cublas_v2.h>

namespace pipesgd::cuda {

struct CublasApi {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasDestroy_v2) destroy;
  decltype(&cublasSetStream_v2) set_stream;
  decltype(&cublasSetMathMode) set_math_mode;
  decltype(&cublasSgemm_v2) sgemm;
  decltype(&cublasSgemmStridedBatched) sgemm_strided_batched;
  decltype(&cublasGetStatusName) status_name;
  decltype(&cublasGetStatusString) status_string;
};

// The loaded API (loaded once, thread-safe). Throws Error(kUnavailable) naming the library
// (libcublas.so.<major>) and the loader's reason when it cannot be opened or lacks a symbol.
const CublasApi& Cublas();

}  // namespace pipesgd::cuda
