// A seeded random source whose streams are identical on every platform and standard library
// (std::uniform_real_distribution is implementation-defined, which would break "same seed, same
// model" across ranks built differently).
#pragma once

#include <cstdint>

namespace pipesgd::layers {

// SplitMix64 (Steele, Lea, Flood 2014): tiny, full-period over 2^64, good enough for init and
// shuffles, and trivially reproducible.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t NextU64() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 24 random bits (exactly representable as float).
  float NextUnitFloat() { return static_cast<float>(NextU64() >> 40) * (1.0f / 16777216.0f); }
  // Uniform in [lo, hi).
  float Uniform(float lo, float hi) { return lo + (hi - lo) * NextUnitFloat(); }
  // Uniform integer in [0, n), n >= 1 (Lemire's multiply-shift; bias < n/2^64, negligible).
  uint64_t Below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(NextU64()) * n) >> 64);
  }

 private:
  uint64_t state_;
};

}  // namespace pipesgd::layers
