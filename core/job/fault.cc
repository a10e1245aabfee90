#include "core/job/fault.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "core/base/error.h"

namespace pipesgd::job {

void MaybeInjectFault(int rank, std::string_view phase, int64_t step) {
  const char* spec = std::getenv("PIPESGD_FAULT");
  if (!spec || !*spec) return;
  const std::string text = spec;
  const size_t a = text.find(':');
  const size_t b = text.rfind(':');
  const auto bad = [&] {
    Throw(ErrorCode::kInvalidArgument,
          "PIPESGD_FAULT = '{}': expected RANK:PHASE:ACTION with PHASE rendezvous, ring_setup, "
          "first_allreduce or step:N and ACTION kill, exit, stop or hang",
          text);
  };
  if (a == std::string::npos || b == a) bad();
  const std::string who = text.substr(0, a), where = text.substr(a + 1, b - a - 1),
                    action = text.substr(b + 1);
  char* end = nullptr;
  const long victim = std::strtol(who.c_str(), &end, 10);
  if (who.empty() || *end != '\0' ||
      (action != "kill" && action != "exit" && action != "stop" && action != "hang")) {
    bad();
  }
  int64_t at_step = 0;
  if (where.rfind("step:", 0) == 0) {
    at_step = std::strtoll(where.c_str() + 5, &end, 10);
    if (*end != '\0' || at_step < 1) bad();
  } else if (where != "rendezvous" && where != "ring_setup" && where != "first_allreduce") {
    bad();
  }
  if (victim != rank) return;
  const bool here = at_step > 0 ? phase == "step" && step == at_step
                                : (where == phase || (where == "first_allreduce" &&
                                                      phase == "step" && step == 1));
  if (!here) return;
  if (action == "kill") {
    kill(getpid(), SIGKILL);
    pause();
  }
  if (action == "stop") kill(getpid(), SIGSTOP);  // the whole process, until SIGCONT or SIGKILL
  if (action == "hang") {
    while (true) pause();  // this thread only: the others (communication, relay) run on
  }
  Throw(ErrorCode::kInternal, "rank {}: injected failure at {} (PIPESGD_FAULT = '{}')", rank,
        where, text);
}

}  // namespace pipesgd::job
