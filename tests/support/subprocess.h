// Runs a command (fork + exec) with extra environment variables and a timeout, capturing stdout
// and stderr; for end-to-end tests of the `pipesgd` binary.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace pipesgd::testing {

struct CommandResult {
  int exit_code = -1;  // exit status, or 128+signal when killed (timeouts kill with SIGKILL)
  bool timed_out = false;
  std::string out;
  std::string err;
};

CommandResult RunCommand(const std::vector<std::string>& argv,
                         const std::map<std::string, std::string>& env = {},
                         double timeout_s = 120);

}  // namespace pipesgd::testing
