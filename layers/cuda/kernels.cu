// CUDA kernels of the GPU backend (see kernels.h). Grid-stride loops; 256 threads per block.
#include "layers/cuda/kernels.h"

#include <cstdint>

namespace pipesgd::cuda::kernels {
namespace {

constexpr int kThreads = 256;

unsigned Blocks(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? (blocks == 0 ? 1 : blocks) : 65535 * 16);
}

__global__ void ReluForwardKernel(const float* x, float* y, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    y[i] = v < 0.0f ? 0.0f : v;  // NaN passes through, as on the CPU
  }
}

__global__ void ReluBackwardKernel(const float* x, const float* dy, float* dx, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
  }
}

__global__ void AddBiasKernel(float* y, const float* b, size_t rows, size_t cols) {
  const size_t n = rows * cols;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    y[i] = __fadd_rn(y[i], b[i % cols]);
  }
}

// One thread per column, rows summed in order: the same order (and so the same float result) as
// the CPU's loop; the batch is small (<= a few thousand rows), the columns many.
__global__ void ColumnSumsKernel(const float* dy, float* db, size_t rows, size_t cols) {
  for (size_t c = blockIdx.x * size_t{blockDim.x} + threadIdx.x; c < cols;
       c += size_t{gridDim.x} * blockDim.x) {
    float sum = 0.0f;
    for (size_t r = 0; r < rows; ++r) sum = __fadd_rn(sum, dy[r * cols + c]);
    db[c] = sum;
  }
}

// One thread per row (classes is small: 10 for Fashion-MNIST), in double as on the CPU.
__global__ void SoftmaxCrossEntropyKernel(const float* logits, const uint8_t* labels,
                                          size_t batch, size_t classes, double scale,
                                          float* dlogits, double* row_loss, uint8_t* correct) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < batch;
       i += size_t{gridDim.x} * blockDim.x) {
    const float* row = logits + i * classes;
    const size_t label = labels[i];
    float max = row[0];
    size_t best = 0;
    for (size_t c = 1; c < classes; ++c) {
      if (row[c] > max) max = row[c];
      if (row[c] > row[best]) best = c;
    }
    double sum = 0.0;
    for (size_t c = 0; c < classes; ++c) sum += exp(static_cast<double>(row[c]) - max);
    if (dlogits != nullptr) {
      float* drow = dlogits + i * classes;
      for (size_t c = 0; c < classes; ++c) {
        const double p = exp(static_cast<double>(row[c]) - max) / sum;
        const double onehot = c == label ? 1.0 : 0.0;
        drow[c] = static_cast<float>((p - onehot) * scale);
      }
    }
    if (row_loss != nullptr) row_loss[i] = log(sum) - (static_cast<double>(row[label]) - max);
    if (correct != nullptr) correct[i] = best == label ? 1 : 0;
  }
}

__global__ void SgdStepKernel(float* w, const float* g, float* buf, size_t n, float lr,
                              float momentum, float wd, bool first_step) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    // Same expression tree as layers/sgd.cc, rounded step by step (no FMA).
    const float gi = wd != 0.0f ? __fadd_rn(g[i], __fmul_rn(wd, w[i])) : g[i];
    if (momentum == 0.0f) {
      w[i] = __fsub_rn(w[i], __fmul_rn(lr, gi));
    } else {
      const float b = first_step ? gi : __fadd_rn(__fmul_rn(momentum, buf[i]), gi);
      buf[i] = b;
      w[i] = __fsub_rn(w[i], __fmul_rn(lr, b));
    }
  }
}

}  // namespace

cudaError_t ReluForward(const float* x, float* y, size_t n, cudaStream_t stream) {
  ReluForwardKernel<<<Blocks(n), kThreads, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}
cudaError_t ReluBackward(const float* x, const float* dy, float* dx, size_t n,
                         cudaStream_t stream) {
  ReluBackwardKernel<<<Blocks(n), kThreads, 0, stream>>>(x, dy, dx, n);
  return cudaGetLastError();
}
cudaError_t AddBias(float* y, const float* b, size_t rows, size_t cols, cudaStream_t stream) {
  AddBiasKernel<<<Blocks(rows * cols), kThreads, 0, stream>>>(y, b, rows, cols);
  return cudaGetLastError();
}
cudaError_t ColumnSums(const float* dy, float* db, size_t rows, size_t cols,
                       cudaStream_t stream) {
  ColumnSumsKernel<<<Blocks(cols), kThreads, 0, stream>>>(dy, db, rows, cols);
  return cudaGetLastError();
}
cudaError_t SoftmaxCrossEntropy(const float* logits, const uint8_t* labels, size_t batch,
                                size_t classes, double scale, float* dlogits, double* row_loss,
                                uint8_t* correct, cudaStream_t stream) {
  SoftmaxCrossEntropyKernel<<<Blocks(batch), kThreads, 0, stream>>>(
      logits, labels, batch, classes, scale, dlogits, row_loss, correct);
  return cudaGetLastError();
}
cudaError_t SgdStep(float* w, const float* g, float* buf, size_t n, float lr, float momentum,
                    float weight_decay, bool first_step, cudaStream_t stream) {
  SgdStepKernel<<<Blocks(n), kThreads, 0, stream>>>(w, g, buf, n, lr, momentum, weight_decay,
                                                    first_step);
  return cudaGetLastError();
}

}  // namespace pipesgd::cuda::kernels
