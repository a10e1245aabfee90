// libFuzzer target: job config text (and one --set override after a 0 byte) must parse or be
// rejected with pipesgd::Error; never crash, hang or throw anything else.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/base/error.h"
#include "core/job/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> overrides;
  if (const size_t zero = input.find('\0'); zero != std::string::npos) {
    overrides.push_back(input.substr(zero + 1));
    input.resize(zero);
  }
  try {
    pipesgd::job::ParseJobConfig(input, "fuzz.pbtxt", overrides);
  } catch (const pipesgd::Error&) {
  }
  return 0;
}
