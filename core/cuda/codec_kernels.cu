// CUDA versions of core/collective/codec.cc's element loops, operation for operation: every
// float/double operation uses an explicit round-to-nearest intrinsic (no FMA), integer bit
// manipulation is identical, so the encodings are bitwise those of the CPU codecs.
#include "core/cuda/codec_kernels.h"

#include <cstdint>
#include <cstring>

namespace pipesgd::cuda::codec_kernels {
namespace {

constexpr int kThreads = 256;

unsigned Blocks(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < 65535 * 16 ? blocks : 65535 * 16));
}

#define GRID_LOOP(i, n)                                                      \
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < (n); \
       i += size_t{gridDim.x} * blockDim.x)

__device__ inline uint32_t Bits(float f) { return __float_as_uint(f); }
__device__ inline float FromBits(uint32_t b) { return __uint_as_float(b); }
__device__ inline bool NonFinite(uint32_t b) { return (b & 0x7f800000u) == 0x7f800000u; }

__device__ inline void Flag(EncodeFlags* flags, size_t i, uint32_t bits, uint32_t saturated) {
  if (NonFinite(bits)) atomicMin(&flags->first_bad, static_cast<unsigned long long>(i));
  if (saturated) atomicAdd(&flags->saturated, 1ull);
}

__global__ void ResetFlagsKernel(EncodeFlags* flags) {
  flags->first_bad = ~0ull;
  flags->saturated = 0;
  flags->min = 0.0f;
  flags->max = 0.0f;
}

__global__ void EncodeTrunc16Kernel(const float* src, uint16_t* dst, size_t n, bool rne,
                                    EncodeFlags* flags) {
  GRID_LOOP(i, n) {
    const uint32_t x = Bits(src[i]);
    uint32_t overflow = 0;
    uint32_t h;
    if (!rne) {
      h = x >> 16;
    } else {
      h = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
      overflow = (h & 0x7f80u) == 0x7f80u ? 1u : 0u;
      h -= overflow;
    }
    dst[i] = static_cast<uint16_t>(h);
    Flag(flags, i, x, overflow && !NonFinite(x));
  }
}

__global__ void EncodeFp16Kernel(const float* src, uint16_t* dst, size_t n, EncodeFlags* flags) {
  GRID_LOOP(i, n) {
    const uint32_t x = Bits(src[i]);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t a = x & 0x7fffffffu;
    const uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    const uint32_t subnormal = Bits(__fadd_rn(FromBits(a), 0.5f)) - 0x3f000000u;
    const uint32_t is_sub = 0u - (a < 0x38800000u ? 1u : 0u);
    const uint32_t clamp = 0u - (a >= 0x477ff000u ? 1u : 0u);
    const uint32_t rounded = (subnormal & is_sub) | (normal & ~is_sub);
    const uint32_t h = (rounded & ~clamp) | (0x7bffu & clamp);
    dst[i] = static_cast<uint16_t>(h | sign);
    // The CPU counts clamped elements of the whole chunk (non-finite ones included, but then
    // Encode throws and the count is never seen).
    Flag(flags, i, x, clamp != 0);
  }
}

__device__ inline float FromHalf16(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t em = static_cast<uint32_t>(h) & 0x7fffu;
  const uint32_t inf_nan = 0u - (em >= 0x7c00u ? 1u : 0u);
  const uint32_t normal = (em << 13) + 0x38000000u + (0x38000000u & inf_nan);
  const uint32_t subnormal = Bits(__fsub_rn(FromBits(0x3f000000u + em), 0.5f));
  const uint32_t is_sub = 0u - (em < 0x0400u ? 1u : 0u);
  return FromBits((subnormal & is_sub) | (normal & ~is_sub) | sign);
}

// The float32 wire's decode-add: a received raw chunk added into the slot.
__global__ void AddIntoKernel(float* dst, const float* src, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    dst[i] = __fadd_rn(dst[i], src[i]);
  }
}

__global__ void Decode16Kernel(const uint16_t* src, float* dst, size_t n, bool fp16, bool add) {
  GRID_LOOP(i, n) {
    const float v = fp16 ? FromHalf16(src[i]) : FromBits(static_cast<uint32_t>(src[i]) << 16);
    dst[i] = add ? __fadd_rn(dst[i], v) : v;
  }
}

// One block: per-thread min/max over a strided slice, then a shared-memory tree. Min and max are
// exact whatever the order (up to which of +0/-0 wins a tie, as noted in codec.h).
__global__ void MinMaxKernel(const float* src, size_t n, EncodeFlags* flags) {
  __shared__ float lo[1024], hi[1024];
  const float first = src[0];
  float mn = first, mx = first;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float x = src[i];
    if (NonFinite(Bits(x))) atomicMin(&flags->first_bad, static_cast<unsigned long long>(i));
    mn = x < mn ? x : mn;
    mx = mx < x ? x : mx;
  }
  lo[threadIdx.x] = mn;
  hi[threadIdx.x] = mx;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      lo[threadIdx.x] = lo[threadIdx.x + s] < lo[threadIdx.x] ? lo[threadIdx.x + s] : lo[threadIdx.x];
      hi[threadIdx.x] = hi[threadIdx.x] < hi[threadIdx.x + s] ? hi[threadIdx.x + s] : hi[threadIdx.x];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    flags->min = lo[0];
    flags->max = hi[0];
  }
}

__device__ inline float Noise(uint32_t index, uint32_t key_lo, uint32_t key_hi) {
  uint32_t x = (index ^ key_hi) * 0x9e3779b9u + key_lo;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return __fmul_rn(static_cast<float>(x >> 8), 0x1p-24f);
}

__global__ void EncodeQ8Kernel(const float* src, unsigned char* dst, size_t n, float mn,
                               float scale, float inv, bool fast, bool stochastic,
                               uint32_t key_lo, uint32_t key_hi) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    memcpy(dst, &mn, sizeof(float));
    memcpy(dst + sizeof(float), &scale, sizeof(float));
  }
  unsigned char* codes = dst + 2 * sizeof(float);
  GRID_LOOP(i, n) {
    uint32_t c;
    if (scale == 0.0f) {
      c = 0;
    } else if (fast) {
      const float t = __fmul_rn(__fsub_rn(src[i], mn), inv);
      if (!stochastic) {
        c = Bits(__fadd_rn(t, 0x1p23f)) - 0x4b000000u;
      } else {
        const int32_t fl = static_cast<int32_t>(t);
        const float frac = __fsub_rn(t, static_cast<float>(fl));
        const uint32_t up = Noise(static_cast<uint32_t>(i), key_lo, key_hi) < frac ? 1u : 0u;
        c = static_cast<uint32_t>(fl) + up;
      }
      c = c < 255u ? c : 255u;
    } else {
      const double t = __ddiv_rn(__dsub_rn(static_cast<double>(src[i]), static_cast<double>(mn)),
                                 static_cast<double>(scale));
      double d;
      if (!stochastic) {
        d = __dsub_rn(__dadd_rn(t, 0x1p52), 0x1p52);
      } else {
        const double fl = floor(t);
        d = __dadd_rn(fl, static_cast<double>(Noise(static_cast<uint32_t>(i), key_lo, key_hi)) <
                                  __dsub_rn(t, fl)
                              ? 1.0
                              : 0.0);
      }
      d = d < 0.0 ? 0.0 : (d > 255.0 ? 255.0 : d);
      c = static_cast<uint32_t>(d);
    }
    codes[i] = static_cast<unsigned char>(c);
  }
}

__global__ void DecodeQ8Kernel(const unsigned char* src, float* dst, size_t n, bool add) {
  float mn, scale;
  memcpy(&mn, src, sizeof(float));
  memcpy(&scale, src + sizeof(float), sizeof(float));
  const unsigned char* codes = src + 2 * sizeof(float);
  const float a = fabsf(mn);
  const bool fast = scale >= 0x1p-126f && scale <= 0x1p118f && a <= 0x1p126f;
  GRID_LOOP(i, n) {
    float v;
    if (scale == 0.0f) {
      v = mn;
    } else if (fast) {
      v = __fadd_rn(mn, __fmul_rn(static_cast<float>(codes[i]), scale));
    } else {
      constexpr double kMax = 3.4028234663852886e38;
      double y = __dadd_rn(static_cast<double>(mn),
                           __dmul_rn(static_cast<double>(codes[i]), static_cast<double>(scale)));
      y = y < -kMax ? -kMax : (y > kMax ? kMax : y);
      v = __double2float_rn(y);
    }
    dst[i] = add ? __fadd_rn(dst[i], v) : v;
  }
}

}  // namespace

cudaError_t ResetFlags(EncodeFlags* flags, cudaStream_t stream) {
  ResetFlagsKernel<<<1, 1, 0, stream>>>(flags);
  return cudaGetLastError();
}
cudaError_t EncodeTrunc16(const float* src, uint16_t* dst, size_t n, bool rne,
                          EncodeFlags* flags, cudaStream_t stream) {
  EncodeTrunc16Kernel<<<Blocks(n), kThreads, 0, stream>>>(src, dst, n, rne, flags);
  return cudaGetLastError();
}
cudaError_t EncodeFp16(const float* src, uint16_t* dst, size_t n, EncodeFlags* flags,
                       cudaStream_t stream) {
  EncodeFp16Kernel<<<Blocks(n), kThreads, 0, stream>>>(src, dst, n, flags);
  return cudaGetLastError();
}
cudaError_t AddInto(float* dst, const float* src, size_t n, cudaStream_t stream) {
  AddIntoKernel<<<Blocks(n), kThreads, 0, stream>>>(dst, src, n);
  return cudaGetLastError();
}
cudaError_t Decode16(const uint16_t* src, float* dst, size_t n, bool fp16, bool add,
                     cudaStream_t stream) {
  Decode16Kernel<<<Blocks(n), kThreads, 0, stream>>>(src, dst, n, fp16, add);
  return cudaGetLastError();
}
cudaError_t MinMax(const float* src, size_t n, EncodeFlags* flags, cudaStream_t stream) {
  MinMaxKernel<<<1, 1024, 0, stream>>>(src, n, flags);
  return cudaGetLastError();
}
cudaError_t EncodeQ8(const float* src, unsigned char* dst, size_t n, float mn, float scale,
                     float inv, bool fast, bool stochastic, uint32_t key_lo, uint32_t key_hi,
                     cudaStream_t stream) {
  EncodeQ8Kernel<<<Blocks(n), kThreads, 0, stream>>>(src, dst, n, mn, scale, inv, fast,
                                                      stochastic, key_lo, key_hi);
  return cudaGetLastError();
}
cudaError_t DecodeQ8(const unsigned char* src, float* dst, size_t n, bool add,
                     cudaStream_t stream) {
  DecodeQ8Kernel<<<Blocks(n), kThreads, 0, stream>>>(src, dst, n, add);
  return cudaGetLastError();
}

}  // namespace pipesgd::cuda::codec_kernels
