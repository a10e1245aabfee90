// Kernels behind CudaDeviceGradients (cuda_gradients.h). Device pointers; async on `stream`;
// return cudaGetLastError().
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace pipesgd::cuda::gradient_kernels {

// *first_bad = the lowest index i < n with a non-finite x[i], or UINT64_MAX when there is none
// (*first_bad is reset first, on the same stream).
cudaError_t FirstNonFinite(const float* x, size_t n, unsigned long long* first_bad,
                           cudaStream_t stream);

}  // namespace pipesgd::cuda::gradient_kernels
