// Convolution (im2col/col2im), max pooling and dropout kernels; see cnn_kernels.h.
#include "layers/cuda/cnn_kernels.h"

#include <cstdint>

#include "core/base/rng.h"

namespace pipesgd::cuda::kernels {
namespace {

constexpr int kThreads = 256;

unsigned Blocks(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < 65535 * 16 ? blocks : 65535 * 16));
}

#define GRID_LOOP(i, n)                                                      \
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < (n); \
       i += size_t{gridDim.x} * blockDim.x)

// One thread per col element: (n, c, p, q, i, j).
__global__ void Im2colKernel(const float* x, float* col, size_t batch, Window g) {
  const size_t pixels = size_t(g.out_height) * g.out_width;
  const size_t patch = size_t(g.channels) * g.kernel * g.kernel;
  const size_t total = batch * patch * pixels;
  GRID_LOOP(idx, total) {
    const size_t pix = idx % pixels;
    const size_t row = (idx / pixels) % patch;
    const size_t n = idx / (pixels * patch);
    const int q = int(row % g.kernel), p = int((row / g.kernel) % g.kernel);
    const int c = int(row / (size_t(g.kernel) * g.kernel));
    const int i = int(pix / g.out_width), j = int(pix % g.out_width);
    const int r = i * g.stride + p - g.padding, s = j * g.stride + q - g.padding;
    float v = 0.0f;
    if (r >= 0 && r < g.height && s >= 0 && s < g.width) {
      v = x[((n * g.channels + c) * g.height + r) * g.width + s];
    }
    col[idx] = v;
  }
}

// One thread per input element; sums its patch entries in (p, q) order.
__global__ void Col2imKernel(const float* dcol, float* dx, size_t batch, Window g) {
  const size_t pixels = size_t(g.out_height) * g.out_width;
  const size_t patch = size_t(g.channels) * g.kernel * g.kernel;
  const size_t total = batch * g.channels * g.height * g.width;
  GRID_LOOP(idx, total) {
    const int s = int(idx % g.width);
    const int r = int((idx / g.width) % g.height);
    const int c = int((idx / (size_t(g.width) * g.height)) % g.channels);
    const size_t n = idx / (size_t(g.width) * g.height * g.channels);
    const float* d = dcol + n * patch * pixels;
    float sum = 0.0f;
    for (int p = 0; p < g.kernel; ++p) {
      const int ti = r + g.padding - p;  // = i * stride
      if (ti < 0 || ti % g.stride != 0 || ti / g.stride >= g.out_height) continue;
      const int i = ti / g.stride;
      for (int q = 0; q < g.kernel; ++q) {
        const int tj = s + g.padding - q;
        if (tj < 0 || tj % g.stride != 0 || tj / g.stride >= g.out_width) continue;
        const int j = tj / g.stride;
        sum = __fadd_rn(sum, d[((size_t(c) * g.kernel + p) * g.kernel + q) * pixels +
                               size_t(i) * g.out_width + j]);
      }
    }
    dx[idx] = sum;
  }
}

__global__ void FillBiasKernel(float* y, const float* b, size_t batch, size_t channels,
                               size_t pixels) {
  GRID_LOOP(idx, batch * channels * pixels) { y[idx] = b[(idx / pixels) % channels]; }
}

// One block per output channel: each thread sums whole samples (pixels in order) into partial
// (channels, batch); thread 0 then adds them in sample order. The CPU's arithmetic exactly: a
// float sum per sample, then db += sum in sample order.
__global__ void ConvBiasGradKernel(const float* dy, float* db, size_t batch, size_t channels,
                                   size_t pixels, float* partial) {
  const size_t o = blockIdx.x;
  for (size_t n = threadIdx.x; n < batch; n += blockDim.x) {
    const float* row = dy + (n * channels + o) * pixels;
    float sum = 0.0f;
    for (size_t i = 0; i < pixels; ++i) sum = __fadd_rn(sum, row[i]);
    partial[o * batch + n] = sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (size_t n = 0; n < batch; ++n) total = __fadd_rn(total, partial[o * batch + n]);
    db[o] = total;
  }
}

__global__ void MaxPoolForwardKernel(const float* x, float* y, int32_t* argmax, size_t batch,
                                     Window g) {
  const size_t out_plane = size_t(g.out_height) * g.out_width;
  const size_t in_plane = size_t(g.height) * g.width;
  GRID_LOOP(idx, batch * g.channels * out_plane) {
    const size_t plane = idx / out_plane;
    const int i = int((idx % out_plane) / g.out_width), j = int(idx % g.out_width);
    const float* xp = x + plane * in_plane;
    int best = i * g.stride * g.width + j * g.stride;
    float best_value = xp[best];
    for (int p = 0; p < g.kernel; ++p) {
      const int row = (i * g.stride + p) * g.width + j * g.stride;
      for (int q = 0; q < g.kernel; ++q) {
        const float v = xp[row + q];
        if (v > best_value || isnan(v)) {
          best_value = v;
          best = row + q;
        }
      }
    }
    y[idx] = best_value;
    argmax[idx] = best;
  }
}

// One thread per input element: the windows that contain it, in output (row-major) order.
__global__ void MaxPoolBackwardKernel(const float* dy, const int32_t* argmax, float* dx,
                                      size_t batch, Window g) {
  const size_t out_plane = size_t(g.out_height) * g.out_width;
  const size_t in_plane = size_t(g.height) * g.width;
  GRID_LOOP(idx, batch * g.channels * in_plane) {
    const size_t plane = idx / in_plane;
    const int local = int(idx % in_plane);
    const int r = local / g.width, s = local % g.width;
    // Windows i with i*stride <= r < i*stride + kernel.
    const int i_lo = r - g.kernel + 1 <= 0 ? 0 : (r - g.kernel + 1 + g.stride - 1) / g.stride;
    const int i_hi = min(r / g.stride, g.out_height - 1);
    const int j_lo = s - g.kernel + 1 <= 0 ? 0 : (s - g.kernel + 1 + g.stride - 1) / g.stride;
    const int j_hi = min(s / g.stride, g.out_width - 1);
    float sum = 0.0f;
    for (int i = i_lo; i <= i_hi; ++i) {
      for (int j = j_lo; j <= j_hi; ++j) {
        const size_t o = plane * out_plane + size_t(i) * g.out_width + j;
        if (argmax[o] == local) sum = __fadd_rn(sum, dy[o]);
      }
    }
    dx[idx] = sum;
  }
}

__global__ void DropoutKernel(const float* x, float* y, size_t n, uint64_t key, uint64_t first,
                              float p, float scale) {
  GRID_LOOP(k, n) {
    const float mask = pipesgd::UnitFloat(pipesgd::Hash(key, first + k)) >= p ? scale : 0.0f;
    y[k] = __fmul_rn(x[k], mask);
  }
}

}  // namespace

cudaError_t Im2col(const float* x, float* col, size_t batch, const Window& g,
                   cudaStream_t stream) {
  const size_t total = batch * size_t(g.channels) * g.kernel * g.kernel * g.out_height * g.out_width;
  Im2colKernel<<<Blocks(total), kThreads, 0, stream>>>(x, col, batch, g);
  return cudaGetLastError();
}
cudaError_t Col2im(const float* dcol, float* dx, size_t batch, const Window& g,
                   cudaStream_t stream) {
  const size_t total = batch * size_t(g.channels) * g.height * g.width;
  Col2imKernel<<<Blocks(total), kThreads, 0, stream>>>(dcol, dx, batch, g);
  return cudaGetLastError();
}
cudaError_t FillBias(float* y, const float* b, size_t batch, size_t channels, size_t pixels,
                     cudaStream_t stream) {
  FillBiasKernel<<<Blocks(batch * channels * pixels), kThreads, 0, stream>>>(y, b, batch,
                                                                             channels, pixels);
  return cudaGetLastError();
}
cudaError_t ConvBiasGrad(const float* dy, float* db, float* partial, size_t batch,
                         size_t channels, size_t pixels, cudaStream_t stream) {
  ConvBiasGradKernel<<<static_cast<unsigned>(channels), kThreads, 0, stream>>>(
      dy, db, batch, channels, pixels, partial);
  return cudaGetLastError();
}
cudaError_t MaxPoolForward(const float* x, float* y, int32_t* argmax, size_t batch,
                           const Window& g, cudaStream_t stream) {
  const size_t total = batch * size_t(g.channels) * g.out_height * g.out_width;
  MaxPoolForwardKernel<<<Blocks(total), kThreads, 0, stream>>>(x, y, argmax, batch, g);
  return cudaGetLastError();
}
cudaError_t MaxPoolBackward(const float* dy, const int32_t* argmax, float* dx, size_t batch,
                            const Window& g, cudaStream_t stream) {
  const size_t total = batch * size_t(g.channels) * g.height * g.width;
  MaxPoolBackwardKernel<<<Blocks(total), kThreads, 0, stream>>>(dy, argmax, dx, batch, g);
  return cudaGetLastError();
}
cudaError_t DropoutApply(const float* x, float* y, size_t n, uint64_t key, uint64_t first,
                         float p, float scale, cudaStream_t stream) {
  DropoutKernel<<<Blocks(n), kThreads, 0, stream>>>(x, y, n, key, first, p, scale);
  return cudaGetLastError();
}

}  // namespace pipesgd::cuda::kernels
