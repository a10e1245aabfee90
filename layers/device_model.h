// A model computing on a device (the layers' GPU backend, layers/cuda), as the rest of pipesgd
// sees it: core/ builds and trains a model.device = CUDA job through these interfaces and never
// through layers/cuda's own types. Every pointer is a DEVICE pointer; the work is queued on the
// device context's stream (core/base/cuda/device.h), in order.
//
// Declared in every build; defined only where the CUDA backend is built (PIPESGD_HAVE_CUDA_BACKEND).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "layers/layer.h"
#include "layers/model.h"
#include "layers/sgd.h"

namespace pipesgd::cuda {
class DeviceContext;  // core/base/cuda/device.h
}  // namespace pipesgd::cuda

namespace pipesgd::layers {

// Which code computes the GPU convolutions.
enum class GpuKernels {
  // cuDNN's convolutions (the ones PyTorch's GPU convolutions use), full FP32 (no TF32),
  // deterministic algorithms chosen by cuDNN's heuristics once per batch size.
  kCudnn,
  // im2col + one cuBLAS strided-batched GEMM (the batch's columns in the workspace).
  kCublas,
};
// Whether kCudnn can run here: this build saw cuDNN's headers and libcudnn.so.<major> loads.
// `why_not` (optional) gets the reason when it cannot. Never throws.
bool CudnnUsable(std::string* why_not = nullptr);
GpuKernels DefaultGpuKernels();             // kCudnn where CudnnUsable(), else kCublas
std::string ToString(GpuKernels kernels);  // "cudnn", "cublas"
// For `pipesgd info`: "cudnn (cuDNN 9.19.0)" or "cublas (no cuDNN: <why>)".
std::string GpuKernelsDescription();

// layers::Model's training and evaluation passes on a device: the same layers, the same
// parameter layout (a CPU parameter vector uploads as is), the same loss.
class DeviceModel {
 public:
  virtual ~DeviceModel() = default;
  virtual size_t num_params() const = 0;
  virtual size_t in_features() const = 0;
  virtual std::string Describe() const = 0;
  // OVERWRITES grads (num_params) with the gradient of the mean loss on x (batch, in) and labels
  // (batch); returns the mean loss (this waits for the stream). `key` seeds the random layers
  // exactly as layers::Model does. REQUIRES 1 <= batch <= the model's max batch.
  virtual float ForwardBackward(const float* params, const float* x, const uint8_t* labels,
                                size_t batch, float* grads, const BatchKey& key) = 0;
  // Forward only, evaluation mode: the loss sum and the correct count, as layers::Model's.
  virtual EvalResult Evaluate(const float* params, const float* x, const uint8_t* labels,
                              size_t batch) = 0;
};

// layers::Sgd on a device: bitwise the CPU's update; its state goes through the host.
class DeviceSgd {
 public:
  virtual ~DeviceSgd() = default;
  virtual void Step(float* params, const float* grads, size_t n) = 0;
  virtual std::vector<float> SaveState() const = 0;
  virtual void LoadState(std::span<const float> state) = 0;
};

// One GPU for the layers: its context (the stream everything runs on) and what it builds.
class Gpu {
 public:
  virtual ~Gpu() = default;
  virtual cuda::DeviceContext& context() = 0;
  // The stack of `layers` from input shape `in`, activations for max_batch samples. Throws what
  // the layer factories throw (Error kInvalidArgument naming the values).
  virtual std::unique_ptr<DeviceModel> MakeModel(std::span<const LayerSpec> layers,
                                                 const Shape& in, size_t max_batch,
                                                 GpuKernels kernels) = 0;
  virtual std::unique_ptr<DeviceSgd> MakeSgd(const SgdOptions& options, size_t num_params) = 0;
};

// GPU `device`. Throws Error(kUnavailable) naming the index and the number of devices when there
// is no such device (or none at all).
std::unique_ptr<Gpu> OpenGpu(int device);

}  // namespace pipesgd::layers
