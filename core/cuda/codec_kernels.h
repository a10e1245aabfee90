// Launchers of the codec kernels (codec_kernels.cu); see cuda_codec.h. Device pointers; async
// on `stream`; return cudaGetLastError().
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace pipesgd::cuda::codec_kernels {

// Per-encode results the host reads back: the lowest non-finite index (UINT64_MAX: none), the
// saturated count, and the chunk's min and max (q8).
struct EncodeFlags {
  unsigned long long first_bad;
  unsigned long long saturated;
  float min, max;
};

// Sets flags->first_bad = UINT64_MAX, saturated = 0.
cudaError_t ResetFlags(EncodeFlags* flags, cudaStream_t stream);
// dst[i] += src[i], rounded as the CPU's reduction (no FMA): the float32 wire's decode-add.
cudaError_t AddInto(float* dst, const float* src, size_t n, cudaStream_t stream);
// trunc16 (rne: round to nearest even with saturation) of n floats into n uint16.
cudaError_t EncodeTrunc16(const float* src, uint16_t* dst, size_t n, bool rne,
                          EncodeFlags* flags, cudaStream_t stream);
cudaError_t EncodeFp16(const float* src, uint16_t* dst, size_t n, EncodeFlags* flags,
                       cudaStream_t stream);
// dst[i] (+)= FromHalf(src[i]); fp16 selects binary16, else bfloat16 (trunc16).
cudaError_t Decode16(const uint16_t* src, float* dst, size_t n, bool fp16, bool add,
                     cudaStream_t stream);
// flags->min / max / first_bad of src (n >= 1), in one block.
cudaError_t MinMax(const float* src, size_t n, EncodeFlags* flags, cudaStream_t stream);
// q8 codes (after the 8-byte header, which this writes too): see codec.cc for the arithmetic.
// key_lo/key_hi: the noise key of segment 0 (n < 2^32).
cudaError_t EncodeQ8(const float* src, unsigned char* dst, size_t n, float mn, float scale,
                     float inv, bool fast, bool stochastic, uint32_t key_lo, uint32_t key_hi,
                     cudaStream_t stream);
cudaError_t DecodeQ8(const unsigned char* src, float* dst, size_t n, bool add,
                     cudaStream_t stream);

}  // namespace pipesgd::cuda::codec_kernels
