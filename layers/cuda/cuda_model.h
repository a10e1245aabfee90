// The GPU backend of the layers: the same layers, loss and optimizer as layers/ (layer.h,
// model.h, sgd.h), computing on one CUDA device. GEMMs go through cuBLAS (full FP32, no TF32),
// the rest are CUDA kernels (kernels.cu). Parameters and gradients live in one contiguous device
// buffer each, laid out exactly as the CPU model's (layer by layer, each layer's own layout), so
// a CPU parameter vector uploads as is and a GPU gradient downloads into the trainer's buffer.
//
// Shapes are row-major as on the CPU: x (B, in). All pointers passed to Forward/Backward/
// ForwardBackward/Evaluate are DEVICE pointers; everything is queued on the context's stream.
//
// tests/cuda_layers_test.cc checks every layer against the CPU layer where a GPU exists (it
// passed on an H200; docs/gpu.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "layers/cuda/device.h"
#include "layers/device_model.h"
#include "layers/model.h"
#include "layers/sgd.h"

namespace pipesgd::cuda {

// The CUDA twin of layers::Layer (layers/layer.h): same shapes, same parameter layout, same
// Pass (its workspace points to device memory here), every pointer a device pointer, work queued
// on ctx's stream.
class CudaLayer {
 public:
  virtual ~CudaLayer() = default;
  virtual std::string name() const = 0;
  virtual layers::Shape in_shape() const = 0;
  virtual layers::Shape out_shape() const = 0;
  size_t in_features() const { return in_shape().size(); }
  size_t out_features() const { return out_shape().size(); }
  virtual size_t num_params() const = 0;
  // Device scratch bytes for `batch` samples (Pass::workspace), kept from Forward to Backward.
  virtual size_t workspace_bytes(size_t batch) const { return 0; }
  // y (B, out) = layer(x (B, in)), B = pass.batch; params: num_params floats.
  virtual void Forward(Context& ctx, const float* params, const float* x, float* y,
                       const layers::Pass& pass) = 0;
  // OVERWRITES grads (num_params floats) with dLoss/dparams; writes dx (B, in) unless null.
  virtual void Backward(Context& ctx, const float* params, const float* x, const float* y,
                        const float* dy, float* grads, float* dx, const layers::Pass& pass) = 0;
};

// The twins of layers::MakeLinear / MakeRelu / MakeConv2d / MakeMaxPool2d / MakeDropout /
// MakeFlatten: same arguments, same errors (Error kInvalidArgument naming the values).
std::unique_ptr<CudaLayer> MakeCudaLinear(const layers::Shape& in, size_t out_features);
std::unique_ptr<CudaLayer> MakeCudaLinear(size_t in_features, size_t out_features);
std::unique_ptr<CudaLayer> MakeCudaRelu(const layers::Shape& shape);
std::unique_ptr<CudaLayer> MakeCudaRelu(size_t features);
// Which code computes the GPU convolutions, and what is known of cuDNN here (layers/device_model.h).
using layers::CudnnUsable;
using layers::DefaultGpuKernels;
using layers::GpuKernels;
using layers::GpuKernelsDescription;
using layers::ToString;
// Throws Error(kUnavailable) for kCudnn where !CudnnUsable(), with the reason.
std::unique_ptr<CudaLayer> MakeCudaConv2d(const layers::Shape& in, size_t out_channels,
                                          size_t kernel, size_t stride, size_t padding,
                                          GpuKernels kernels = DefaultGpuKernels());
std::unique_ptr<CudaLayer> MakeCudaMaxPool2d(const layers::Shape& in, size_t kernel,
                                             size_t stride);
std::unique_ptr<CudaLayer> MakeCudaDropout(const layers::Shape& shape, float p);
std::unique_ptr<CudaLayer> MakeCudaFlatten(const layers::Shape& in);
// The twin of layers::MakeLayer: the Make* above for `spec` at input shape `in`.
std::unique_ptr<CudaLayer> MakeCudaLayer(const layers::LayerSpec& spec, const layers::Shape& in,
                                         GpuKernels kernels);

class CudaModel final : public layers::DeviceModel {
 public:
  // As layers::Model: each layer's in_features must equal the previous out_features (Error
  // kInvalidArgument naming both). Allocates activations for max_batch on ctx's device.
  CudaModel(Context& ctx, std::vector<std::unique_ptr<CudaLayer>> layers, size_t max_batch);

  size_t num_params() const override { return num_params_; }
  layers::Shape in_shape() const;
  size_t in_features() const override { return in_shape().size(); }
  size_t num_classes() const;
  std::string Describe() const override;

  // One training forward and backward pass on device x (B, in) and device labels (B):
  // OVERWRITES device grads (num_params) with the gradient of the mean loss; returns the mean
  // loss (this waits for the stream: the loss is needed on the host). `key` seeds the random
  // layers exactly as layers::Model does. REQUIRES 1 <= batch <= max_batch.
  float ForwardBackward(const float* params, const float* x, const uint8_t* labels, size_t batch,
                        float* grads, const layers::BatchKey& key = {}) override;
  // Forward only, evaluation mode: loss sum (double, summed on the host in sample order as the
  // CPU) and correct count. Waits for the stream.
  layers::EvalResult Evaluate(const float* params, const float* x, const uint8_t* labels,
                              size_t batch) override;
  // The logits of the last Forward (device, (batch, classes)), for tests.
  const float* logits() const { return acts_.back().data(); }

 private:
  void RunForward(const float* params, const float* x, size_t batch, bool training,
                  const layers::BatchKey& key);
  layers::Pass LayerPass(size_t i, size_t batch, bool training, const layers::BatchKey& key);
  layers::EvalResult Loss(const uint8_t* labels, size_t batch, bool gradient);

  Context& ctx_;
  std::vector<std::unique_ptr<CudaLayer>> layers_;
  std::vector<size_t> param_offsets_;
  size_t num_params_ = 0;
  size_t max_batch_ = 0;
  std::vector<DeviceBuffer<float>> acts_;        // acts_[i]: input of layer i (entry 0 unused)
  std::vector<DeviceBuffer<float>> grads_acts_;  // same shapes
  std::vector<DeviceBuffer<std::byte>> workspaces_;  // per layer, workspace_bytes(max_batch)
  DeviceBuffer<double> row_loss_;
  DeviceBuffer<uint8_t> correct_;
  PinnedBuffer<double> host_row_loss_;
  PinnedBuffer<uint8_t> host_correct_;
};

// layers::Sgd on the GPU: the momentum buffer is device memory; Step takes device params and
// device grads. Bitwise the CPU's update (same expression, no FMA).
class CudaSgd final : public layers::DeviceSgd {
 public:
  CudaSgd(Context& ctx, const layers::SgdOptions& options, size_t num_params);
  void Step(float* params, const float* grads, size_t n) override;
  // As layers::Sgd (the state is copied through the host; waits for the stream).
  std::vector<float> SaveState() const override;
  void LoadState(std::span<const float> state) override;
  const layers::SgdOptions& options() const { return options_; }

 private:
  Context& ctx_;
  layers::SgdOptions options_;
  size_t num_params_;
  DeviceBuffer<float> momentum_buf_;
  bool first_step_ = true;
};

}  // namespace pipesgd::cuda
