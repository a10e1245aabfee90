// What every timing loop needs: seconds since a steady-clock point, the median of samples, and
// the CPU time the process has used.
#pragma once

#include <algorithm>
#include <chrono>
#include <ctime>
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

// CPU seconds of every thread of this process, user and kernel (CLOCK_PROCESS_CPUTIME_ID).
inline double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// CPU seconds of the calling thread, user and kernel (CLOCK_THREAD_CPUTIME_ID).
inline double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace pipesgd
