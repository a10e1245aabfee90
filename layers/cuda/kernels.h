// Launchers of the GPU backend's CUDA kernels (kernels.cu). Plain declarations so that the host
// C++ code includes no CUDA device headers beyond cuda_runtime.h. Every pointer is device memory
// unless named host_*; every launch is asynchronous on `stream`. The launchers return the
// launch status (cudaGetLastError()); callers check it with PSGD_CUDA.
//
// Float arithmetic is written with explicit round-to-nearest intrinsics (no fused multiply-add)
// in the same order as the CPU code, so that elementwise results match the CPU bit for bit
// where the CPU code is elementwise too (ReLU, bias, SGD, loss gradient up to exp()).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace pipesgd::cuda::kernels {

// y[i] = x[i] < 0 ? 0 : x[i]   (n elements)
cudaError_t ReluForward(const float* x, float* y, size_t n, cudaStream_t stream);
// dx[i] = x[i] > 0 ? dy[i] : 0
cudaError_t ReluBackward(const float* x, const float* dy, float* dx, size_t n,
                         cudaStream_t stream);
// y (rows, cols) += b (cols) on every row.
cudaError_t AddBias(float* y, const float* b, size_t rows, size_t cols, cudaStream_t stream);
// db[c] = sum over rows r (in order 0..rows-1) of dy[r * cols + c].
cudaError_t ColumnSums(const float* dy, float* db, size_t rows, size_t cols,
                       cudaStream_t stream);
// Softmax cross-entropy of logits (batch, classes) against labels, per row in double as the CPU
// (layers/model.cc): row_loss[i] = -log softmax(row)[label]; correct[i] = argmax == label (lowest
// index on ties); if dlogits is not null, dlogits (batch, classes) = (softmax - onehot) * scale.
cudaError_t SoftmaxCrossEntropy(const float* logits, const uint8_t* labels, size_t batch,
                                size_t classes, double scale, float* dlogits, double* row_loss,
                                uint8_t* correct, cudaStream_t stream);
// One SGD step over n parameters, torch.optim.SGD semantics (layers/sgd.h); buf may be null
// when momentum == 0.
cudaError_t SgdStep(float* w, const float* g, float* buf, size_t n, float lr, float momentum,
                    float weight_decay, bool first_step, cudaStream_t stream);

}  // namespace pipesgd::cuda::kernels
