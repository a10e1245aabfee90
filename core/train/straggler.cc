#include "core/train/straggler.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace pipesgd::train {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

bool StragglerSleeps(const StragglerOptions& options, int rank, int64_t step) {
  if (options.sleep_s <= 0 || options.probability <= 0) return false;
  if (std::find(options.ranks.begin(), options.ranks.end(), rank) == options.ranks.end()) {
    return false;
  }
  const uint64_t h = SplitMix64(SplitMix64(options.seed ^ (static_cast<uint64_t>(rank) << 40)) ^
                                static_cast<uint64_t>(step));
  const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // uniform in [0, 1)
  return u < options.probability;
}

StragglerObjective::StragglerObjective(Objective& inner, const StragglerOptions& options, int rank)
    : inner_(inner), options_(options), rank_(rank) {
  active_ = std::find(options.ranks.begin(), options.ranks.end(), rank) != options.ranks.end();
}

void StragglerObjective::MaybeSleep(int64_t step) {
  if (active_ && StragglerSleeps(options_, rank_, step)) {
    ++sleeps_;
    std::this_thread::sleep_for(std::chrono::duration<double>(options_.sleep_s));
  }
}

float StragglerObjective::ComputeGradient(int64_t step, std::span<const float> params,
                                          std::span<float> grads) {
  MaybeSleep(step);
  return inner_.ComputeGradient(step, params, grads);
}

float StragglerObjective::ComputeGradientOnDevice(int64_t step, std::span<const float> params,
                                                  float* device_grads) {
  MaybeSleep(step);
  return inner_.ComputeGradientOnDevice(step, params, device_grads);
}

}  // namespace pipesgd::train
