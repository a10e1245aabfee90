// Helpers for layer tests: seeded random inputs and central finite differences in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/base/rng.h"

namespace pipesgd::testing {

inline std::vector<float> RandomVector(size_t n, uint64_t seed, float lo = -1.0f,
                                       float hi = 1.0f) {
  pipesgd::Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = rng.Uniform(lo, hi);
  return v;
}

// |a - b| relative to the larger magnitude; the floor keeps a gradient that is ~0 from failing on
// pure rounding noise (it then compares by absolute error, scaled by the floor).
inline double RelErr(double analytic, double numeric, double floor) {
  return std::abs(analytic - numeric) /
         std::max({std::abs(analytic), std::abs(numeric), floor});
}

// Central difference of f at v[j]; the step actually taken (after rounding to float) is used as
// the denominator, not the nominal eps.
template <typename F>
double CentralDifference(std::vector<float>& v, size_t j, float eps, F f) {
  const float saved = v[j];
  v[j] = saved + eps;
  const double up_at = v[j];
  const double up = f();
  v[j] = saved - eps;
  const double down_at = v[j];
  const double down = f();
  v[j] = saved;
  return (up - down) / (up_at - down_at);
}

// sum_i r_i * y_i in double: a scalar "loss" whose gradient with respect to y is exactly r.
inline double Dot(const std::vector<float>& r, const std::vector<float>& y) {
  double sum = 0.0;
  for (size_t i = 0; i < r.size(); i++) sum += static_cast<double>(r[i]) * y[i];
  return sum;
}

}  // namespace pipesgd::testing
