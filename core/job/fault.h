// Fault injection for the failure tests (tests/startup_failure_test.cc): PIPESGD_FAULT =
// "RANK:PHASE:ACTION" makes rank RANK, on reaching PHASE, die at once (ACTION kill: SIGKILL,
// as a crash or the OOM killer would), fail with an error (exit), stop its whole process (stop:
// SIGSTOP, as a debugger or a swapping host would) or hang its main thread (hang). PHASE is
// `rendezvous` (before meeting the other ranks), `ring_setup` (after the rendezvous, before the
// ring connects), `first_allreduce` (before step 1, whose gradients are the first collective),
// or `step:N` (before step N). Unset (always, outside tests): nothing happens. A malformed value
// is an error naming it, so a typo cannot make a test pass by not injecting anything.
#pragma once

#include <cstdint>
#include <string_view>

namespace pipesgd::job {

// Injects the fault PIPESGD_FAULT describes if it is for `rank` at `phase` (for phase "step",
// at `step`).
void MaybeInjectFault(int rank, std::string_view phase, int64_t step = 0);

}  // namespace pipesgd::job
