// Launchers of the convolution, pooling and dropout kernels (cnn_kernels.cu). Device pointers,
// asynchronous on `stream`; return cudaGetLastError(). Activations are (B, C, H, W) row-major as
// in layers/layer.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace pipesgd::cuda::kernels {

// Geometry of one Conv2d or MaxPool2d: input (C, H, W), square kernel, stride, zero padding,
// output (OH, OW) per channel.
struct Window {
  int channels, height, width;
  int kernel, stride, padding;
  int out_height, out_width;
};

// col (B, C*k*k, OH*OW): the CPU's Im2col (layers/conv2d.cc) for every sample, patch rows in
// (c, p, q) order, zeros where the window reaches into the padding.
cudaError_t Im2col(const float* x, float* col, size_t batch, const Window& g, cudaStream_t stream);
// dx (B, C, H, W) = the CPU's Col2im of dcol: each input element sums its patch entries in
// (p, q) order, the order the CPU's scatter adds them in, so the sums are bitwise the same.
cudaError_t Col2im(const float* dcol, float* dx, size_t batch, const Window& g,
                   cudaStream_t stream);
// y (B, OC, P) = b[o] on every pixel (the convolution's GEMM then adds onto it).
cudaError_t FillBias(float* y, const float* b, size_t batch, size_t channels, size_t pixels,
                     cudaStream_t stream);
// db[o] = sum over samples (in order) of the sum over pixels (in order) of dy[n][o][pixel], as
// the CPU: one float partial per sample, added in sample order. partial: batch*channels floats
// of scratch.
cudaError_t ConvBiasGrad(const float* dy, float* db, float* partial, size_t batch,
                         size_t channels, size_t pixels, cudaStream_t stream);
// Max pooling (no padding): y and argmax (B, C, OH, OW); argmax is the index within the input
// plane of the first maximum in row-major order (a NaN replaces any running max), as the CPU.
cudaError_t MaxPoolForward(const float* x, float* y, int32_t* argmax, size_t batch,
                           const Window& g, cudaStream_t stream);
// dx (B, C, H, W): each input element sums, in output order, the dy of the windows whose argmax
// it is (the CPU's scatter order), zero elsewhere.
cudaError_t MaxPoolBackward(const float* dy, const int32_t* argmax, float* dx, size_t batch,
                            const Window& g, cudaStream_t stream);
// y[k] = x[k] * mask(k), mask = 1/(1-p) where UnitFloat(Hash(key, first + k)) >= p else 0
// (core/base/rng.h; bitwise the CPU's Dropout). n elements starting at global element `first`.
cudaError_t DropoutApply(const float* x, float* y, size_t n, uint64_t key, uint64_t first,
                         float p, float scale, cudaStream_t stream);

}  // namespace pipesgd::cuda::kernels
