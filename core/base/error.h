// Recoverable errors: the one mechanism pipesgd uses for I/O failures, peer loss, deadlines and
// bad input (config, data files, wire messages).
//
// Policy (docs/errors.md):
//  - Anything the environment or the user can cause throws pipesgd::Error with a code and a
//    message that carries its context: rank, peer, bytes, file:line of a config, the value seen
//    and the value expected.
//  - Callers that know more add it with Error::Wrap ("while connecting to rank 2: ...") and
//    rethrow; they never swallow.
//  - Background threads catch, store the std::exception_ptr, and the next wait on the owning
//    thread rethrows it (gloo's ex_). No exception crosses a thread boundary otherwise.
//  - Programming errors (broken invariants) are not Errors: they abort via PSGD_CHECK
//    (core/base/check.h) with the values involved.
#pragma once

#include <string>
#include <utility>

#include <fmt/format.h>

// ErrorCode and Error: public, shared with the embedding API.
#include "pipesgd/error.h"

namespace pipesgd {

// Throws Error(code, fmt::format(format, args...)).
template <typename... Args>
[[noreturn]] void Throw(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace pipesgd
