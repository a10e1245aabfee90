#include "core/cuda/gradient_kernels.h"

#include <cstdint>

namespace pipesgd::cuda::gradient_kernels {
namespace {

constexpr int kThreads = 256;

__global__ void FirstNonFiniteKernel(const float* x, size_t n, unsigned long long* first_bad) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    // Exponent all ones: Inf or NaN (isfinite, without relying on fast-math settings).
    if ((__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
    }
  }
}

}  // namespace

cudaError_t FirstNonFinite(const float* x, size_t n, unsigned long long* first_bad,
                           cudaStream_t stream) {
  const unsigned long long none = UINT64_MAX;
  cudaError_t status =
      cudaMemcpyAsync(first_bad, &none, sizeof(none), cudaMemcpyHostToDevice, stream);
  if (status != cudaSuccess) return status;
  if (n == 0) return cudaSuccess;
  const size_t blocks = (n + kThreads - 1) / kThreads;
  FirstNonFiniteKernel<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kThreads, 0,
                         stream>>>(x, n, first_bad);
  return cudaGetLastError();
}

}  // namespace pipesgd::cuda::gradient_kernels
