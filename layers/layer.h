// Layers on the CPU (OpenBLAS sgemm), written as stateless functions of their parameters so that
// one contiguous parameter buffer and one contiguous gradient buffer cover the whole model
// (llm.c's arenas): the trainer can AllReduce the gradient in one call and keep several gradient
// buffers (one per pipeline slot) without copying.
//
// Activations are row-major (B, C, H, W): B samples, each a Shape of C*H*W floats in (c, h, w)
// order (PyTorch's NCHW). A flat vector of n features is the shape (n, 1, 1). Each layer is built
// for one input shape and knows its output shape, so a model checks once, at construction, that
// its layers chain. Layers know nothing of the network or of training; see layers/model.h for the
// stack and the loss.
//
// A backend (the CPU here, CUDA elsewhere) implements this same interface; pointers then point
// into that backend's memory. Everything a call needs besides its buffers travels in Pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "core/base/rng.h"

namespace pipesgd::layers {

// The shape of one sample's activation: channels x height x width.
struct Shape {
  size_t channels = 1;
  size_t height = 1;
  size_t width = 1;

  size_t size() const { return channels * height * width; }  // floats per sample
  bool operator==(const Shape&) const = default;
};

// "32x14x14".
std::string ToString(const Shape& shape);

// The output shapes of the spatial layers, once for the layers themselves and for the config's
// checks of a model before any layer is built (core/job/config_validate.cc).
// REQUIRES kernel <= height + 2 * padding and kernel <= width + 2 * padding, stride >= 1.
Shape Conv2dOutShape(const Shape& in, size_t out_channels, size_t kernel, size_t stride,
                     size_t padding);
// REQUIRES kernel <= height and kernel <= width, stride >= 1.
Shape MaxPool2dOutShape(const Shape& in, size_t kernel, size_t stride);

// Everything about one Forward/Backward call besides its buffers. Backward must get the same
// Pass (same batch, training flag, key, first_row and workspace) as the Forward it follows.
struct Pass {
  size_t batch = 0;  // samples in x, >= 1
  // Training applies the layers' training behaviour (Dropout drops); evaluation is deterministic
  // and identity for Dropout.
  bool training = false;
  // This layer's random key for this step (Model derives it from the run's seed, the global
  // step and the layer's index; see RandomKey in core/base/rng.h). Random numbers are a pure
  // function of (key, global sample row, element), never a stream carried between steps, so a
  // run is reproducible and a resumed run draws exactly what the uninterrupted one would have.
  uint64_t key = 0;
  // Global row of x's first sample within the global batch (rank * per-rank batch): with it the
  // random numbers of a sample do not depend on which rank computes it.
  uint64_t first_row = 0;
  // workspace_bytes(batch) bytes, aligned for any scalar type, owned by the caller and kept
  // unchanged from Forward to the matching Backward (e.g. the max-pool argmax). Empty when the
  // layer needs none.
  std::span<std::byte> workspace;
};

class Layer {
 public:
  virtual ~Layer() = default;

  // Human-readable, e.g. "linear(784->256)" or "conv2d(1x28x28->32x28x28, k5 s1 p2)".
  virtual std::string name() const = 0;
  virtual Shape in_shape() const = 0;
  virtual Shape out_shape() const = 0;
  size_t in_features() const { return in_shape().size(); }
  size_t out_features() const { return out_shape().size(); }
  // Number of float parameters this layer owns in the model's parameter buffer.
  virtual size_t num_params() const = 0;
  // The layer's weight matrix, when its parameters begin with one (rows x cols, row-major): what
  // a low-rank gradient compressor (PowerSGD) may approximate. Zero rows: none.
  struct WeightMatrix {
    size_t rows = 0, cols = 0;
  };
  virtual WeightMatrix weight_matrix() const { return {}; }
  // Bytes of scratch memory Forward and Backward need for `batch` samples (Pass::workspace).
  virtual size_t workspace_bytes(size_t batch) const { return 0; }

  // Writes the seeded initial parameters (num_params floats).
  virtual void Init(std::span<float> params, Rng& rng) const = 0;

  // y (B, out) = layer(x (B, in)), B = pass.batch.
  virtual void Forward(std::span<const float> params, const float* x, float* y,
                       const Pass& pass) const = 0;

  // Given the forward input x (B, in), output y (B, out) and upstream gradient dy (B, out):
  // OVERWRITES grads (num_params floats) with dLoss/dparams, and writes dx (B, in) unless dx is
  // null (the first layer needs no input gradient).
  virtual void Backward(std::span<const float> params, const float* x, const float* y,
                        const float* dy, std::span<float> grads, float* dx,
                        const Pass& pass) const = 0;
};

// Fully connected: y = x W^T + b on the input flattened to in.size() features (in (c, h, w)
// order, what Flatten produces), W (out, in) row-major, then b (out); output shape (out, 1, 1).
// Parameters laid out as [W, b]. Init as PyTorch's nn.Linear: W, b ~ U(-1/sqrt(in), 1/sqrt(in)).
// Throws Error(kInvalidArgument) for a zero size.
std::unique_ptr<Layer> MakeLinear(const Shape& in, size_t out_features);
std::unique_ptr<Layer> MakeLinear(size_t in_features, size_t out_features);

// y = max(x, 0), elementwise, same shape; no parameters. The gradient at exactly 0 is 0.
std::unique_ptr<Layer> MakeRelu(const Shape& shape);
std::unique_ptr<Layer> MakeRelu(size_t features);

// 2-D convolution (cross-correlation, as PyTorch's nn.Conv2d with groups 1, dilation 1) of the
// input shape (C_in, H, W) with a square kernel, stride and zero padding on every side:
//   y[n][o][i][j] = b[o] + sum_{c,p,q} W[o][c][p][q] * x_pad[n][c][i*stride + p][j*stride + q]
// Output (out_channels, OH, OW), OH = (H + 2*padding - kernel) / stride + 1 (floor), OW alike.
// Parameters [W (out_channels, C_in, kernel, kernel) row-major, b (out_channels)]. Init as
// PyTorch's default: W, b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = C_in*kernel*kernel, W
// first. `kernels` says which code computes it (CpuKernels below).
// Throws Error(kInvalidArgument) naming the values for a zero size, kernel, stride or channel
// count, or a kernel larger than the padded input; Error(kUnavailable) for kOneDnn in a build
// without oneDNN.
enum class CpuKernels {
  // oneDNN's direct convolutions in its blocked layouts, the library PyTorch's CPU
  // convolutions come from (Debian libdnnl-dev). Threads: OpenMP's (OMP_NUM_THREADS).
  kOneDnn,
  // im2col + OpenBLAS sgemm, one sample at a time (Chellapilla et al. 2006): the reference the
  // oneDNN layer is tested against, and the fallback of builds without oneDNN.
  kOpenBlas,
};
bool HaveOneDnn();                // this build has the oneDNN layers
// The threads a oneDNN primitive run from the calling thread would use (OpenMP's count); 0
// without oneDNN or where its runtime is not OpenMP.
int OneDnnThreads();
// Sets that count for primitives run from the calling thread (OpenMP keeps it per thread);
// false without oneDNN, where its runtime is not OpenMP, or for a count below 1.
bool SetOneDnnThreads(int threads);
CpuKernels DefaultCpuKernels();  // kOneDnn where HaveOneDnn(), else kOpenBlas
std::string ToString(CpuKernels kernels);  // "onednn", "openblas"
std::unique_ptr<Layer> MakeConv2d(const Shape& in, size_t out_channels, size_t kernel,
                                  size_t stride, size_t padding,
                                  CpuKernels kernels = DefaultCpuKernels());

// Max pooling over kernel x kernel windows with the given stride, per channel, no padding
// (PyTorch's nn.MaxPool2d(kernel, stride), floor mode): output (C, OH, OW),
// OH = (H - kernel) / stride + 1. Scanning a window in row-major order, a value replaces the
// running maximum iff it is greater or NaN (PyTorch's CPU rule): the first of equal maxima wins
// and a NaN wins over every number (the last NaN, if several). The gradient goes to that one
// input, summed where windows overlap. Workspace: the argmax of every output (int32 index
// h*W + w within its input plane). No parameters.
// With kOneDnn (oneDNN's pooling) the same but for NaNs, which never win: a window holding
// both a NaN and a number yields its largest number, one of NaNs only the lowest float
// (-FLT_MAX). A diverged model still shows as a non-finite loss: its NaN weights reach the
// loss through every layer with parameters.
// Throws Error(kInvalidArgument) naming the values for a zero kernel or stride, or a kernel
// larger than the input; Error(kUnavailable) for kOneDnn in a build without oneDNN.
std::unique_ptr<Layer> MakeMaxPool2d(const Shape& in, size_t kernel, size_t stride,
                                     CpuKernels kernels = DefaultCpuKernels());

// Inverted dropout (Srivastava et al. 2014; PyTorch's nn.Dropout): when training, element j of
// global row r is kept iff UnitFloat(Hash(pass.key, r * shape.size() + j)) >= p (core/base/rng.h)
// and y = x * mask with mask 1/(1-p) (float) where kept, 0 where dropped; identity when not
// training. Same shape, no parameters, no workspace: Backward recomputes the mask from the Pass.
// Throws Error(kInvalidArgument) for p outside [0, 1).
std::unique_ptr<Layer> MakeDropout(const Shape& shape, float p);

// (C, H, W) -> (C*H*W, 1, 1); the floats are unchanged (already in (c, h, w) order).
std::unique_ptr<Layer> MakeFlatten(const Shape& in);

// A layer as a model's description gives it, before it is built for the CPU (MakeLayer) or a
// device (layers/device_model.h): one description, so that both stacks have the same shapes and
// the same parameter layout.
struct LayerSpec {
  enum class Kind { kLinear, kRelu, kConv2d, kMaxPool2d, kDropout, kFlatten };
  Kind kind = Kind::kRelu;
  size_t out_features = 0;  // linear
  size_t out_channels = 0;  // conv2d
  size_t kernel = 0;        // conv2d, max_pool2d
  size_t stride = 0;        // conv2d, max_pool2d
  size_t padding = 0;       // conv2d
  float p = 0;              // dropout
};
// The Make* above for `spec` at input shape `in`; throws what they throw.
std::unique_ptr<Layer> MakeLayer(const LayerSpec& spec, const Shape& in, CpuKernels kernels);

}  // namespace pipesgd::layers
