// What every timing loop needs: seconds since a steady-clock point, and the median of samples.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace pipesgd {

inline double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The upper median (the middle element of the sorted samples); 0 for none.
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace pipesgd
