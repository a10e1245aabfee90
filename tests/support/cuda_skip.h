// GPU tier: skips a test with a message when this machine has no CUDA device.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/base/cuda/device.h"

// In a TEST body: GTEST_SKIP()s unless a CUDA device is usable. Initialises the CUDA runtime in
// this process (tests that fork ranks check in a child instead: see cuda_staging_test.cc).
#define PSGD_REQUIRE_CUDA_DEVICE()                                                             \
  do {                                                                                       \
    std::string why_none;                                                                    \
    if (::pipesgd::cuda::CudaDeviceCount(&why_none) == 0) {                                  \
      GTEST_SKIP() << "no CUDA device on this machine (" << why_none                         \
                   << "); the GPU path was compiled but is not run here";                    \
    }                                                                                        \
  } while (0)
