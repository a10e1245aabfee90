// A seeded random source whose streams are identical on every platform and standard library
// (std::uniform_real_distribution is implementation-defined, which would break "same seed, same
// model" across ranks built differently), and a counter-based form of the same generator for
// per-element randomness that a GPU thread can compute on its own.
#pragma once

#include <cstdint>

// Callable from CUDA device code too, so a CUDA layer draws bitwise the numbers a CPU layer does.
#if defined(__CUDACC__)
#define PSGD_HOST_DEVICE __host__ __device__
#else
#define PSGD_HOST_DEVICE
#endif

namespace pipesgd {

inline constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ULL;

// SplitMix64's output function (Steele, Lea, Flood 2014): a bijection on 64 bits with good
// avalanche.
PSGD_HOST_DEVICE inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Draw number `counter` (0-based) of Rng(key), without the draws before it: the same value as
// calling Rng(key).NextU64() counter + 1 times.
PSGD_HOST_DEVICE inline uint64_t Hash(uint64_t key, uint64_t counter) {
  return Mix64(key + (counter + 1) * kGoldenGamma);
}

// Uniform in [0, 1) from the top 24 bits (exactly representable as float).
PSGD_HOST_DEVICE inline float UnitFloat(uint64_t bits) {
  return static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
}

// The random key of layer `layer` at global step `step` of a run seeded with `seed`:
//   RandomKey = Mix64(Mix64(Mix64(seed ^ kDropoutSalt) + step) + layer)
// Distinct (step, layer) pairs give unrelated keys; the salt keeps these keys apart from the
// init stream Rng(seed) and the shuffle keys (core/data/dataset.h).
inline constexpr uint64_t kDropoutSalt = 0x64726f706f757421ULL;  // "dropout!"
PSGD_HOST_DEVICE inline uint64_t RandomKey(uint64_t seed, uint64_t step, uint64_t layer) {
  return Mix64(Mix64(Mix64(seed ^ kDropoutSalt) + step) + layer);
}

// SplitMix64: tiny, full-period over 2^64, good enough for init and shuffles, and trivially
// reproducible.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t NextU64() { return Mix64(state_ += kGoldenGamma); }
  // Uniform in [0, 1) with 24 random bits (exactly representable as float).
  float NextUnitFloat() { return UnitFloat(NextU64()); }
  // Uniform in [lo, hi).
  float Uniform(float lo, float hi) { return lo + (hi - lo) * NextUnitFloat(); }
  // Uniform integer in [0, n), n >= 1 (Lemire's multiply-shift; bias < n/2^64, negligible).
  uint64_t Below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(NextU64()) * n) >> 64);
  }

 private:
  uint64_t state_;
};

}  // namespace pipesgd
