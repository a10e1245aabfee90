// The gradient compression codecs of core/collective/codec.h on the GPU: the same wire format and,
// for finite input, bitwise the same encodings as the CPU codecs (trunc16, fp16, q8 with round to
// nearest even or stochastic rounding), so a chunk encoded on a GPU can be decoded by a CPU rank
// and vice versa. Exceptions: q8 of a chunk whose only values are +0.0 and -0.0 may pick the
// other zero as its min (codec.h says the CPU keeps "whichever zero the min search kept"); the
// decoded values then differ only in the sign of zero.
//
// All data pointers are device memory; work is queued on the context's stream. Encode waits for
// the stream (it must read back the non-finite check, the saturation count and, for q8, the
// chunk's range to compute the header exactly as the CPU does).
//
// tests/cuda_codec_test.cc compares with the CPU codecs where a GPU exists (bitwise equal on an
// H200; docs/gpu.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/collective/codec.h"
#include "core/base/cuda/device.h"

namespace pipesgd::cuda {

class CudaCodec {
 public:
  // Throws as MakeCodec for bad options.
  CudaCodec(DeviceContext& ctx, const CodecOptions& options);
  ~CudaCodec();

  CodecKind kind() const { return cpu_->kind(); }
  size_t EncodedBytes(size_t n) const { return cpu_->EncodedBytes(n); }
  // As Codec::Encode; src (n floats) and dst (EncodedBytes(n) bytes) on the device. Throws
  // Error(kNumerical) naming the first non-finite element and its value. REQUIRES n < 2^32.
  EncodeStats Encode(const float* src, size_t n, std::byte* dst, uint64_t stream = 0);
  void Decode(const std::byte* src, float* dst, size_t n);
  void DecodeAdd(const std::byte* src, float* dst, size_t n);
  // The CPU codec with the same options (EncodedBytes, ErrorBound).
  const Codec& cpu() const { return *cpu_; }

 private:
  void Run(const std::byte* src, float* dst, size_t n, bool add);

  DeviceContext& ctx_;
  std::unique_ptr<Codec> cpu_;
  DeviceBuffer<std::byte> flags_;  // codec_kernels::EncodeFlags
  PinnedBuffer<std::byte> host_flags_;
};

}  // namespace pipesgd::cuda
