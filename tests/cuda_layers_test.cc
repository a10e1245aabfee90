// GPU tier: every CUDA layer, the loss and SGD against the CPU implementation on the same inputs
// (relative error under 1e-4 for GEMM-based results, bitwise where both sides do the same
// elementwise float operations), and one whole training step on the GPU against the CPU step.
// Skips with a message where there is no CUDA device (as on the machine this was written on:
// these tests have NOT been run there).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "layers/cuda/cublas_loader.h"
#include "layers/cuda/cuda_model.h"
#ifdef PIPESGD_HAVE_CUDNN
#include "layers/cuda/cudnn_loader.h"
#endif
#include "layers/cuda/device.h"
#include "layers/layer.h"
#include "layers/model.h"
#include "core/base/rng.h"
#include "layers/sgd.h"
#include "tests/support/cuda_skip.h"

namespace pipesgd {
namespace {

using ::testing::HasSubstr;
using cuda::Context;
using cuda::DeviceBuffer;

constexpr double kRelTol = 1e-4;

std::vector<float> Random(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  pipesgd::Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = rng.Uniform(lo, hi);
  return v;
}

DeviceBuffer<float> Upload(Context& ctx, const std::vector<float>& v) {
  const int device = ctx.device();
  DeviceBuffer<float> d(std::max<size_t>(v.size(), 1), device);
  if (!v.empty()) {
    PSGD_CUDA(cudaMemcpy(d.data(), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
    // A copy from pageable memory may still be in flight when cudaMemcpy returns, and
    // the context's stream does not wait for the legacy default stream.
    PSGD_CUDA(cudaDeviceSynchronize());
  }
  return d;
}

std::vector<float> Download(Context& ctx, const float* d, size_t n) {
  const int device = ctx.device();
  ctx.Synchronize("test download");
  std::vector<float> v(n);
  if (n > 0) PSGD_CUDA(cudaMemcpy(v.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  return v;
}

// max |a - b| / max(max |b|, tiny): the error relative to the magnitude of the reference.
double RelError(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double scale = 1e-30, err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    err = std::max(err, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  return err / scale;
}

// Runs the CPU layer and the CUDA layer on the same params, x and dy, in training mode with the
// same Pass key and first row (so Dropout draws the same mask); compares y, grads and dx.
void CompareLayer(const layers::Layer& cpu, cuda::CudaLayer& gpu, size_t batch, uint64_t seed) {
  Context ctx(0);
  const int device = ctx.device();
  ASSERT_EQ(cpu.num_params(), gpu.num_params());
  ASSERT_EQ(cpu.in_shape(), gpu.in_shape());
  ASSERT_EQ(cpu.out_shape(), gpu.out_shape());
  std::vector<float> params(cpu.num_params());
  pipesgd::Rng rng(seed);
  cpu.Init(params, rng);
  const std::vector<float> x = Random(batch * cpu.in_features(), seed + 1);
  const std::vector<float> dy = Random(batch * cpu.out_features(), seed + 2);
  std::vector<float> y(batch * cpu.out_features()), grads(cpu.num_params()),
      dx(batch * cpu.in_features());
  std::vector<std::byte> workspace(cpu.workspace_bytes(batch));
  layers::Pass pass;
  pass.batch = batch;
  pass.training = true;
  pass.key = pipesgd::RandomKey(seed, 3, 1);
  pass.first_row = 5 * batch;
  pass.workspace = workspace;
  cpu.Forward(params, x.data(), y.data(), pass);
  cpu.Backward(params, x.data(), y.data(), dy.data(), grads, dx.data(), pass);

  auto d_params = Upload(ctx, params);
  auto d_x = Upload(ctx, x);
  auto d_dy = Upload(ctx, dy);
  DeviceBuffer<float> d_y(std::max<size_t>(y.size(), 1), device),
      d_grads(std::max<size_t>(grads.size(), 1), device), d_dx(std::max<size_t>(dx.size(), 1), device);
  DeviceBuffer<std::byte> d_workspace(gpu.workspace_bytes(batch), device);
  layers::Pass gpu_pass = pass;
  gpu_pass.workspace = std::span<std::byte>(d_workspace.data(), gpu.workspace_bytes(batch));
  gpu.Forward(ctx, d_params.data(), d_x.data(), d_y.data(), gpu_pass);
  gpu.Backward(ctx, d_params.data(), d_x.data(), d_y.data(), d_dy.data(), d_grads.data(),
               d_dx.data(), gpu_pass);
  EXPECT_LT(RelError(Download(ctx, d_y.data(), y.size()), y), kRelTol) << cpu.name() << " y";
  if (!grads.empty()) {
    EXPECT_LT(RelError(Download(ctx, d_grads.data(), grads.size()), grads), kRelTol)
        << cpu.name() << " grads";
  }
  EXPECT_LT(RelError(Download(ctx, d_dx.data(), dx.size()), dx), kRelTol) << cpu.name() << " dx";
}

TEST(CudaLayers, LinearMatchesCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  // Odd sizes so that row-major/column-major mix-ups cannot cancel out.
  CompareLayer(*layers::MakeLinear(37, 13), *cuda::MakeCudaLinear(37, 13), 5, 1);
  CompareLayer(*layers::MakeLinear(784, 256), *cuda::MakeCudaLinear(784, 256), 64, 2);
}

TEST(CudaLayers, ReluMatchesCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  CompareLayer(*layers::MakeRelu(101), *cuda::MakeCudaRelu(101), 7, 3);
}

// The CUDA convolutional layers against their CPU versions: odd sizes, stride and padding
// that leave partial windows, overlapping pooling windows (stride < kernel), dropout with the
// same key and global rows (bitwise the same mask), flatten.
// The CPU side is the im2col + OpenBLAS reference, whose NaN rule the CUDA pooling shares.
constexpr layers::CpuKernels kReference = layers::CpuKernels::kOpenBlas;

// Both GPU convolutions (cuBLAS im2col and, where built, cuDNN), including the CNN config's
// second layer at batch 64 and 256.
TEST(CudaLayers, Conv2dMatchesCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  std::vector<cuda::GpuKernels> kinds = {cuda::GpuKernels::kCublas};
  std::string why_not;
  if (cuda::CudnnUsable(&why_not)) {
    kinds.push_back(cuda::GpuKernels::kCudnn);
  } else {
    std::printf("cuDNN not usable here (%s): only the cuBLAS convolution is compared\n",
                why_not.c_str());
  }
  for (const cuda::GpuKernels kind : kinds) {
    SCOPED_TRACE(cuda::ToString(kind));
    const layers::Shape in{3, 11, 9};
    CompareLayer(*layers::MakeConv2d(in, 5, 3, 2, 1, kReference),
                 *cuda::MakeCudaConv2d(in, 5, 3, 2, 1, kind), 4, 11);
    const layers::Shape mnist{1, 28, 28};
    CompareLayer(*layers::MakeConv2d(mnist, 32, 5, 1, 2, kReference),
                 *cuda::MakeCudaConv2d(mnist, 32, 5, 1, 2, kind), 8, 12);
    const layers::Shape second{16, 14, 14};
    for (const size_t batch : {64, 256}) {
      CompareLayer(*layers::MakeConv2d(second, 32, 5, 1, 2, kReference),
                   *cuda::MakeCudaConv2d(second, 32, 5, 1, 2, kind), batch, 13);
    }
  }
}

// What runs without a GPU: where the build has cuDNN's headers, the library named by them
// loads (it ships with the toolkit) and reports their major version, and a cuDNN layer is
// built without touching a device (its descriptors wait for the first step).
TEST(CudaLayers, CudnnLoadsWithoutADevice) {
#ifdef PIPESGD_HAVE_CUDNN
  std::string why_not;
  ASSERT_TRUE(cuda::CudnnUsable(&why_not)) << why_not;
  EXPECT_EQ(cuda::DefaultGpuKernels(), cuda::GpuKernels::kCudnn);
  EXPECT_EQ(cuda::Cudnn().get_version() / 10000, static_cast<size_t>(CUDNN_MAJOR));
  EXPECT_THAT(cuda::GpuKernelsDescription(),
              ::testing::StartsWith(fmt::format("cudnn (cuDNN {}.", CUDNN_MAJOR)));
  auto conv = cuda::MakeCudaConv2d({16, 14, 14}, 32, 5, 1, 2, cuda::GpuKernels::kCudnn);
  EXPECT_EQ(conv->name(), "conv2d(16x14x14->32x14x14, k5 s1 p2)");
  EXPECT_EQ(conv->num_params(), 32u * 16 * 25 + 32);
  // The im2col path's bound: columns (B, C*K*K, OH*OW) and the bias partial sums (B, OC).
  EXPECT_EQ(conv->workspace_bytes(2), (2u * 400 * 196 + 2 * 32) * sizeof(float));
  // A failing status names the call, the device and cuDNN's text.
  try {
    const int device = 0;
    PSGD_CUDNN(CUDNN_STATUS_BAD_PARAM);
    ADD_FAILURE() << "CUDNN_STATUS_BAD_PARAM accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal);
    EXPECT_THAT(e.what(), HasSubstr("cuDNN call CUDNN_STATUS_BAD_PARAM failed on device 0"));
    EXPECT_THAT(e.what(), HasSubstr("BAD_PARAM"));
  }
#else
  std::string why_not;
  EXPECT_FALSE(cuda::CudnnUsable(&why_not));
  EXPECT_THAT(why_not, HasSubstr("built without cuDNN"));
  EXPECT_EQ(cuda::DefaultGpuKernels(), cuda::GpuKernels::kCublas);
#endif
}

TEST(CudaLayers, MaxPool2dMatchesCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  const layers::Shape in{4, 9, 7};
  CompareLayer(*layers::MakeMaxPool2d(in, 2, 2, kReference), *cuda::MakeCudaMaxPool2d(in, 2, 2),
               3, 13);
  CompareLayer(*layers::MakeMaxPool2d(in, 3, 2, kReference), *cuda::MakeCudaMaxPool2d(in, 3, 2),
               3, 14);
}

TEST(CudaLayers, DropoutAndFlattenMatchCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  const layers::Shape in{6, 5, 5};
  CompareLayer(*layers::MakeDropout(in, 0.3f), *cuda::MakeCudaDropout(in, 0.3f), 7, 15);
  CompareLayer(*layers::MakeFlatten(in), *cuda::MakeCudaFlatten(in), 7, 16);
}

// A two-layer MLP: one forward/backward on both, then one SGD step with momentum and weight
// decay; the GPU's loss, gradient and new parameters equal the CPU's within 1e-4 relative (the
// GEMMs sum in a different order; everything elementwise is the same float expression).
TEST(CudaModel, TrainingStepMatchesCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  Context ctx(0);
  const size_t in = 64, hidden = 32, classes = 10, batch = 16;
  std::vector<std::unique_ptr<layers::Layer>> cpu_layers;
  cpu_layers.push_back(layers::MakeLinear(in, hidden));
  cpu_layers.push_back(layers::MakeRelu(hidden));
  cpu_layers.push_back(layers::MakeLinear(hidden, classes));
  layers::Model cpu(std::move(cpu_layers), batch);
  std::vector<std::unique_ptr<cuda::CudaLayer>> gpu_layers;
  gpu_layers.push_back(cuda::MakeCudaLinear(in, hidden));
  gpu_layers.push_back(cuda::MakeCudaRelu(hidden));
  gpu_layers.push_back(cuda::MakeCudaLinear(hidden, classes));
  cuda::CudaModel gpu(ctx, std::move(gpu_layers), batch);
  ASSERT_EQ(cpu.num_params(), gpu.num_params());

  std::vector<float> params(cpu.num_params());
  cpu.Init(params, 42);
  const std::vector<float> x = Random(batch * in, 7, 0.0f, 1.0f);
  std::vector<uint8_t> labels(batch);
  for (size_t i = 0; i < batch; ++i) labels[i] = static_cast<uint8_t>((i * 7) % classes);

  std::vector<float> grads(cpu.num_params());
  const float cpu_loss = cpu.ForwardBackward(params, x.data(), labels.data(), batch, grads);
  const layers::SgdOptions sgd_options{0.1f, 0.9f, 5e-4f};
  std::vector<float> cpu_params = params;
  layers::Sgd cpu_sgd(sgd_options, params.size());
  cpu_sgd.Step(cpu_params, grads);
  cpu_sgd.Step(cpu_params, grads);  // twice: the momentum buffer's second-step path too

  auto d_params = Upload(ctx, params);
  auto d_x = Upload(ctx, x);
  const int device = 0;
  DeviceBuffer<uint8_t> d_labels(batch, device);
  PSGD_CUDA(cudaMemcpy(d_labels.data(), labels.data(), batch, cudaMemcpyHostToDevice));
  PSGD_CUDA(cudaDeviceSynchronize());
  DeviceBuffer<float> d_grads(gpu.num_params(), device);
  const float gpu_loss = gpu.ForwardBackward(d_params.data(), d_x.data(), d_labels.data(), batch,
                                             d_grads.data());
  EXPECT_NEAR(gpu_loss, cpu_loss, 1e-5 * std::fabs(cpu_loss));
  EXPECT_LT(RelError(Download(ctx, d_grads.data(), grads.size()), grads), kRelTol);
  cuda::CudaSgd gpu_sgd(ctx, sgd_options, gpu.num_params());
  gpu_sgd.Step(d_params.data(), d_grads.data(), gpu.num_params());
  gpu_sgd.Step(d_params.data(), d_grads.data(), gpu.num_params());
  EXPECT_LT(RelError(Download(ctx, d_params.data(), params.size()), cpu_params), kRelTol);

  const layers::EvalResult cpu_eval = cpu.Evaluate(params, x.data(), labels.data(), batch);
  auto d_params0 = Upload(ctx, params);
  const layers::EvalResult gpu_eval = gpu.Evaluate(d_params0.data(), d_x.data(), d_labels.data(), batch);
  EXPECT_EQ(gpu_eval.count, cpu_eval.count);
  EXPECT_EQ(gpu_eval.correct, cpu_eval.correct);
  EXPECT_NEAR(gpu_eval.loss_sum, cpu_eval.loss_sum, 1e-5 * std::fabs(cpu_eval.loss_sum));
}

// A small CNN (conv-relu-pool twice, flatten, dropout, linear), one training step with the
// same BatchKey on both: the same dropout mask, loss and gradient within 1e-4 relative.
TEST(CudaModel, CnnTrainingStepMatchesCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  Context ctx(0);
  const size_t batch = 8, classes = 10;
  const layers::Shape in{1, 28, 28};
  std::vector<std::unique_ptr<layers::Layer>> cpu_layers;
  std::vector<std::unique_ptr<cuda::CudaLayer>> gpu_layers;
  layers::Shape shape = in;
  auto add = [&](std::unique_ptr<layers::Layer> cpu, std::unique_ptr<cuda::CudaLayer> gpu) {
    shape = cpu->out_shape();
    cpu_layers.push_back(std::move(cpu));
    gpu_layers.push_back(std::move(gpu));
  };
  add(layers::MakeConv2d(shape, 8, 5, 1, 2, kReference), cuda::MakeCudaConv2d(shape, 8, 5, 1, 2));
  add(layers::MakeRelu(shape), cuda::MakeCudaRelu(shape));
  add(layers::MakeMaxPool2d(shape, 2, 2, kReference), cuda::MakeCudaMaxPool2d(shape, 2, 2));
  add(layers::MakeConv2d(shape, 16, 3, 1, 1, kReference),
      cuda::MakeCudaConv2d(shape, 16, 3, 1, 1));
  add(layers::MakeRelu(shape), cuda::MakeCudaRelu(shape));
  add(layers::MakeMaxPool2d(shape, 2, 2, kReference), cuda::MakeCudaMaxPool2d(shape, 2, 2));
  add(layers::MakeFlatten(shape), cuda::MakeCudaFlatten(shape));
  add(layers::MakeDropout(shape, 0.25f), cuda::MakeCudaDropout(shape, 0.25f));
  add(layers::MakeLinear(shape, classes), cuda::MakeCudaLinear(shape, classes));
  layers::Model cpu(std::move(cpu_layers), batch);
  cuda::CudaModel gpu(ctx, std::move(gpu_layers), batch);
  ASSERT_EQ(cpu.num_params(), gpu.num_params());
  std::vector<float> params(cpu.num_params());
  cpu.Init(params, 3);
  const std::vector<float> x = Random(batch * in.size(), 21, -1.0f, 2.0f);
  std::vector<uint8_t> labels(batch);
  for (size_t i = 0; i < batch; ++i) labels[i] = static_cast<uint8_t>((i * 3) % classes);
  const layers::BatchKey key{.seed = 9, .step = 17, .first_row = 2 * batch};
  std::vector<float> grads(cpu.num_params());
  const float cpu_loss = cpu.ForwardBackward(params, x.data(), labels.data(), batch, grads, key);

  auto d_params = Upload(ctx, params);
  auto d_x = Upload(ctx, x);
  DeviceBuffer<uint8_t> d_labels(batch, 0);
  const int device = 0;
  PSGD_CUDA(cudaMemcpy(d_labels.data(), labels.data(), batch, cudaMemcpyHostToDevice));
  PSGD_CUDA(cudaDeviceSynchronize());
  DeviceBuffer<float> d_grads(gpu.num_params(), device);
  const float gpu_loss = gpu.ForwardBackward(d_params.data(), d_x.data(), d_labels.data(), batch,
                                             d_grads.data(), key);
  EXPECT_NEAR(gpu_loss, cpu_loss, 1e-4 * std::fabs(cpu_loss));
  EXPECT_LT(RelError(Download(ctx, d_grads.data(), grads.size()), grads), kRelTol);
}

// With the same gradient the GPU's SGD update is bitwise the CPU's: same expression, one
// rounding per operation on both sides (-ffp-contract=off on the CPU, --fmad=false and explicit
// _rn intrinsics on the GPU).
TEST(CudaSgd, BitwiseEqualToCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  Context ctx(0);
  const size_t n = 10007;
  std::vector<float> w = Random(n, 5), g = Random(n, 6);
  for (const layers::SgdOptions options :
       {layers::SgdOptions{0.05f, 0.0f, 0.0f}, layers::SgdOptions{0.05f, 0.9f, 1e-4f}}) {
    std::vector<float> cpu_w = w;
    layers::Sgd cpu(options, n);
    auto d_w = Upload(ctx, w);
    auto d_g = Upload(ctx, g);
    cuda::CudaSgd gpu(ctx, options, n);
    for (int step = 0; step < 3; ++step) {
      cpu.Step(cpu_w, g);
      gpu.Step(d_w.data(), d_g.data(), n);
    }
    const std::vector<float> got = Download(ctx, d_w.data(), n);
    EXPECT_EQ(std::memcmp(got.data(), cpu_w.data(), n * sizeof(float)), 0)
        << "momentum " << options.momentum;
    EXPECT_EQ(gpu.SaveState(), cpu.SaveState());
  }
}

// Errors from CUDA calls name the call, the CUDA error and the device.
TEST(CudaDevice, BadDeviceIndexIsAClearError) {
  PSGD_REQUIRE_CUDA_DEVICE();
  try {
    Context ctx(1000);
    FAIL() << "GPU 1000 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GPU 1000"), std::string::npos) << e.what();
  }
}

// Runs everywhere: without a device the count is 0 with a reason, and a Context is refused with
// kUnavailable naming the index (the message a user with model.device = CUDA and no GPU sees).
TEST(CudaDevice, NoDeviceIsReportedNotCrashed) {
  std::string why;
  const int count = cuda::CudaDeviceCount(&why);
  if (count > 0) GTEST_SKIP() << "this machine has " << count << " CUDA device(s)";
  EXPECT_FALSE(why.empty());
  try {
    Context ctx(0);
    FAIL() << "a context without a device";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
    EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
  }
}

// Runs everywhere (no GPU needed): cuBLAS is opened at run time, not linked, and every symbol the
// layers call resolves in the toolkit's library; its status strings work without a device.
TEST(CublasLoader, OpensTheToolkitsCublas) {
  const cuda::CublasApi& api = cuda::Cublas();
  ASSERT_NE(api.sgemm, nullptr);
  ASSERT_NE(api.sgemm_strided_batched, nullptr);
  EXPECT_STREQ(api.status_name(CUBLAS_STATUS_NOT_INITIALIZED), "CUBLAS_STATUS_NOT_INITIALIZED");
  EXPECT_EQ(&cuda::Cublas(), &api);  // loaded once
}

}  // namespace
}  // namespace pipesgd
