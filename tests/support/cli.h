// What the end-to-end tests of the `pipesgd` binary share (cli_test.cc, probe_model_cli_test.cc):
// the binary, the main config, a run of one short worker, and the check of a clear error.
// Needs PIPESGD_BINARY and PIPESGD_SOURCE_DIR (tests/CMakeLists.txt defines them).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace pipesgd::testing {

inline const std::string kBinary = PIPESGD_BINARY;
inline const std::string kConfig =
    std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_mlp.pbtxt";

// Each test's own directory.
struct CliTempDir : TempDir {
  CliTempDir() : TempDir("pipesgd_cli") {}
};

// Runs a short single-process worker with some --set overrides; returns its result.
inline CommandResult Worker(const std::vector<std::string>& sets,
                            const std::string& config = kConfig) {
  std::vector<std::string> argv = {kBinary, "worker", config, "--set", "train.max_steps=5"};
  for (const auto& s : sets) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  return RunCommand(argv, {}, 120);
}

// A usage or input error: exit 1, no timeout, every needle in stderr.
inline void ExpectError(const CommandResult& r, const std::vector<std::string>& needles) {
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 1) << "stdout:\n" << r.out << "\nstderr:\n" << r.err;
  for (const auto& n : needles) {
    EXPECT_NE(r.err.find(n), std::string::npos) << "stderr lacks '" << n << "':\n" << r.err;
  }
}

}  // namespace pipesgd::testing
