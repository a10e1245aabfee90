// libFuzzer target: checkpoint file bytes. Must load or be rejected with pipesgd::Error naming
// what is wrong; never crash or read out of bounds.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/base/error.h"
#include "core/train/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    pipesgd::train::ParseCheckpoint(std::string(reinterpret_cast<const char*>(data), size),
                                    "fuzz");
  } catch (const pipesgd::Error&) {
  }
  return 0;
}
