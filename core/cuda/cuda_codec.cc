// Host side of the CUDA codecs; see cuda_codec.h and codec_kernels.cu.
#include "core/cuda/cuda_codec.h"

#include <cstring>
#include <limits>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/cuda/codec_kernels.h"

namespace pipesgd::cuda {

using codec_kernels::EncodeFlags;

CudaCodec::CudaCodec(DeviceContext& ctx, const CodecOptions& options)
    : ctx_(ctx),
      cpu_(MakeCodec(options)),
      flags_(sizeof(EncodeFlags), ctx.device()),
      host_flags_(sizeof(EncodeFlags), ctx.device()) {
  if (options.kind == CodecKind::kQ4 || options.kind == CodecKind::kSign1) {
    Throw(ErrorCode::kInvalidArgument,
          "codec {} has no GPU kernels: expected none, trunc16, fp16 or q8 on GPU {}",
          CodecName(options.kind), ctx.device());
  }
}

CudaCodec::~CudaCodec() = default;

EncodeStats CudaCodec::Encode(const float* src, size_t n, std::byte* dst, uint64_t stream) {
  PSGD_CHECK_LT(n, size_t{1} << 32);
  const int device = ctx_.device();
  auto* flags = reinterpret_cast<EncodeFlags*>(flags_.data());
  auto* host = reinterpret_cast<EncodeFlags*>(host_flags_.data());
  const CodecOptions& options = cpu_->options();
  PSGD_CUDA(codec_kernels::ResetFlags(flags, ctx_.stream()));
  auto read_flags = [&] {
    PSGD_CUDA(cudaMemcpyAsync(host, flags, sizeof(EncodeFlags), cudaMemcpyDeviceToHost,
                              ctx_.stream()));
    ctx_.Synchronize("a GPU encode");
  };
  auto throw_if_bad = [&] {
    if (host->first_bad == std::numeric_limits<unsigned long long>::max()) return;
    float value = 0.0f;
    PSGD_CUDA(cudaMemcpy(&value, src + host->first_bad, sizeof(float), cudaMemcpyDeviceToHost));
    Throw(ErrorCode::kNumerical,
          "{} codec: element {} of a chunk of {} is {}; only finite values can be encoded "
          "(on GPU {})",
          CodecName(kind()), host->first_bad, n, value, device);
  };
  switch (kind()) {
    case CodecKind::kQ4:
    case CodecKind::kSign1:
      break;  // refused by the constructor
    case CodecKind::kNone:
      // Non-finite check through the 16-bit kernel's flags would cost a pass; do the copy and
      // scan with MinMax, which flags non-finite values.
      if (n > 0) PSGD_CUDA(codec_kernels::MinMax(src, n, flags, ctx_.stream()));
      PSGD_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice,
                                ctx_.stream()));
      read_flags();
      throw_if_bad();
      return {};
    case CodecKind::kTrunc16:
    case CodecKind::kFp16:
      if (kind() == CodecKind::kTrunc16) {
        PSGD_CUDA(codec_kernels::EncodeTrunc16(src, reinterpret_cast<uint16_t*>(dst), n,
                                               options.round_to_nearest_even, flags,
                                               ctx_.stream()));
      } else {
        PSGD_CUDA(codec_kernels::EncodeFp16(src, reinterpret_cast<uint16_t*>(dst), n, flags,
                                            ctx_.stream()));
      }
      read_flags();
      throw_if_bad();
      return {host->saturated};
    case CodecKind::kQ8: {
      float mn = 0.0f, mx = 0.0f;
      if (n > 0) {
        PSGD_CUDA(codec_kernels::MinMax(src, n, flags, ctx_.stream()));
        read_flags();
        throw_if_bad();
        mn = host->min;
        mx = host->max;
      }
      const float scale = codec_internal::Q8Scale(mn, mx);
      const bool fast = scale != 0.0f && codec_internal::Q8FastPath(mn, scale);
      const float inv = fast ? 1.0f / scale : 0.0f;
      const codec_internal::NoiseKey key =
          codec_internal::MakeNoiseKey(options.seed, stream, 0);
      PSGD_CUDA(codec_kernels::EncodeQ8(src, reinterpret_cast<unsigned char*>(dst), n, mn, scale,
                                        inv, fast, options.stochastic_rounding, key.lo, key.hi,
                                        ctx_.stream()));
      return {};
    }
  }
  PSGD_CHECK(false && "unreachable");
  return {};
}

void CudaCodec::Run(const std::byte* src, float* dst, size_t n, bool add) {
  const int device = ctx_.device();
  switch (kind()) {
    case CodecKind::kQ4:
    case CodecKind::kSign1:
      break;  // refused by the constructor
    case CodecKind::kNone:
      if (!add) {
        PSGD_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice,
                                  ctx_.stream()));
      } else {
        PSGD_CUDA(codec_kernels::AddInto(dst, reinterpret_cast<const float*>(src), n, ctx_.stream()));
      }
      return;
    case CodecKind::kTrunc16:
    case CodecKind::kFp16:
      PSGD_CUDA(codec_kernels::Decode16(reinterpret_cast<const uint16_t*>(src), dst, n,
                                        kind() == CodecKind::kFp16, add, ctx_.stream()));
      return;
    case CodecKind::kQ8:
      PSGD_CUDA(codec_kernels::DecodeQ8(reinterpret_cast<const unsigned char*>(src), dst, n, add,
                                        ctx_.stream()));
      return;
  }
}

void CudaCodec::Decode(const std::byte* src, float* dst, size_t n) { Run(src, dst, n, false); }
void CudaCodec::DecodeAdd(const std::byte* src, float* dst, size_t n) { Run(src, dst, n, true); }

}  // namespace pipesgd::cuda
