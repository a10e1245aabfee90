// GPU tier: the CUDA codecs (core/cuda/cuda_codec.h) against the CPU codecs: bitwise
// the same encoded bytes, the same decoded floats, the same DecodeAdd sums and saturation counts,
// on values that reach every branch (subnormals, fp16 saturation, ties, q8's double path).
// Skips with a message without a CUDA device (NOT run on the machine this was written on).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/base/error.h"
#include "core/collective/codec.h"
#include "core/cuda/cuda_codec.h"
#include "layers/cuda/device.h"
#include "core/base/rng.h"
#include "tests/support/cuda_skip.h"

namespace pipesgd {
namespace {

using cuda::Context;
using cuda::DeviceBuffer;

// Random values over many magnitudes plus the edge cases of each format.
std::vector<float> Values(size_t n, uint64_t seed, float span) {
  pipesgd::Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) {
    const float mag = std::ldexp(1.0f, static_cast<int>(rng.Below(60)) - 40);
    x = rng.Uniform(-span, span) * mag;
  }
  const float edges[] = {0.0f, -0.0f, 65504.0f, 65519.0f, 65520.0f, -70000.0f, 0x1p-24f,
                         0x1p-25f, 0x1.8p-25f, 0x1p-14f, 0x1.ffp+127f, 1.0f + 0x1p-8f,
                         std::numeric_limits<float>::denorm_min()};
  for (size_t i = 0; i < std::size(edges) && i < n; ++i) v[i * 7 % n] = edges[i];
  return v;
}

void CheckCodec(const CodecOptions& options, const std::vector<float>& src) {
  Context ctx(0);
  const int device = ctx.device();
  auto cpu = MakeCodec(options);
  cuda::CudaCodec gpu(ctx, options);
  const size_t n = src.size(), bytes = cpu->EncodedBytes(n);
  std::vector<std::byte> want(bytes);
  const EncodeStats cpu_stats = cpu->Encode(src, want, 12345);

  DeviceBuffer<float> d_src(n, device), d_out(n, device);
  DeviceBuffer<std::byte> d_enc(bytes, device);
  PSGD_CUDA(cudaMemcpy(d_src.data(), src.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  // A copy from pageable memory may still be in flight when cudaMemcpy returns, and
  // the context's stream does not wait for the legacy default stream.
  PSGD_CUDA(cudaDeviceSynchronize());
  const EncodeStats gpu_stats = gpu.Encode(d_src.data(), n, d_enc.data(), 12345);
  ctx.Synchronize("test");
  std::vector<std::byte> got(bytes);
  PSGD_CUDA(cudaMemcpy(got.data(), d_enc.data(), bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(got.data(), want.data(), bytes), 0) << CodecName(options.kind);
  EXPECT_EQ(gpu_stats.saturated, cpu_stats.saturated);

  // Decode and DecodeAdd of the CPU's bytes.
  std::vector<float> cpu_dec(n), cpu_add = src;
  cpu->Decode(want, cpu_dec);
  cpu->DecodeAdd(want, cpu_add);
  PSGD_CUDA(cudaMemcpy(d_enc.data(), want.data(), bytes, cudaMemcpyHostToDevice));
  PSGD_CUDA(cudaDeviceSynchronize());
  gpu.Decode(d_enc.data(), d_out.data(), n);
  ctx.Synchronize("test");
  std::vector<float> gpu_dec(n);
  PSGD_CUDA(cudaMemcpy(gpu_dec.data(), d_out.data(), n * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(gpu_dec.data(), cpu_dec.data(), n * sizeof(float)), 0);
  PSGD_CUDA(cudaMemcpy(d_out.data(), src.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  PSGD_CUDA(cudaDeviceSynchronize());
  gpu.DecodeAdd(d_enc.data(), d_out.data(), n);
  ctx.Synchronize("test");
  std::vector<float> gpu_add(n);
  PSGD_CUDA(cudaMemcpy(gpu_add.data(), d_out.data(), n * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(gpu_add.data(), cpu_add.data(), n * sizeof(float)), 0);
}

TEST(CudaCodec, Trunc16BitwiseAsCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  CodecOptions options;
  options.kind = CodecKind::kTrunc16;
  CheckCodec(options, Values(100003, 1, 1.0f));
  options.round_to_nearest_even = true;
  CheckCodec(options, Values(100003, 2, 1.0f));
}

TEST(CudaCodec, Fp16BitwiseAsCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  CodecOptions options;
  options.kind = CodecKind::kFp16;
  CheckCodec(options, Values(100003, 3, 1.0f));
}

TEST(CudaCodec, Q8BitwiseAsCpu) {
  PSGD_REQUIRE_CUDA_DEVICE();
  CodecOptions options;
  options.kind = CodecKind::kQ8;
  std::vector<float> gradient_like(65536);
  pipesgd::Rng rng(9);
  for (float& x : gradient_like) x = rng.Uniform(-0.01f, 0.02f);
  CheckCodec(options, gradient_like);
  CheckCodec(options, std::vector<float>(1000, 0.25f));           // constant chunk: scale 0
  CheckCodec(options, {0x1p-140f, 0x1p-135f, 3e-41f, 0x1p-130f});  // double path (tiny scale)
  CheckCodec(options, {-3e38f, 3e38f, 1.0f});                       // double path (huge range)
  options.stochastic_rounding = true;
  options.seed = 77;
  CheckCodec(options, gradient_like);
  CheckCodec(options, {0x1p-140f, 0x1p-135f, 3e-41f, 0x1p-130f});
}

TEST(CudaCodec, NonFiniteNamesTheElement) {
  PSGD_REQUIRE_CUDA_DEVICE();
  Context ctx(0);
  const int device = ctx.device();
  for (CodecKind kind : {CodecKind::kTrunc16, CodecKind::kFp16, CodecKind::kQ8}) {
    CodecOptions options;
    options.kind = kind;
    cuda::CudaCodec gpu(ctx, options);
    std::vector<float> src(1000, 1.0f);
    src[617] = std::numeric_limits<float>::infinity();
    src[900] = std::numeric_limits<float>::quiet_NaN();
    DeviceBuffer<float> d_src(src.size(), device);
    DeviceBuffer<std::byte> d_enc(gpu.EncodedBytes(src.size()), device);
    PSGD_CUDA(cudaMemcpy(d_src.data(), src.data(), src.size() * sizeof(float),
                         cudaMemcpyHostToDevice));
    PSGD_CUDA(cudaDeviceSynchronize());
    try {
      gpu.Encode(d_src.data(), src.size(), d_enc.data());
      FAIL() << CodecName(kind) << " encoded an infinity";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNumerical);
      EXPECT_NE(std::string(e.what()).find("element 617 of a chunk of 1000 is inf"),
                std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace pipesgd
