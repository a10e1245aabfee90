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

#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace pipesgd {

// Kinds of recoverable failure, named after the canonical status codes (abseil/gRPC) so that
// callers can branch on them (e.g. a launcher retries kUnavailable at start-up, never kDataLoss).
enum class ErrorCode {
  kInvalidArgument,    // bad config value, bad command line, bad API argument
  kNotFound,           // missing file or key
  kDataLoss,           // malformed or mismatched input: corrupt file, bad frame, protocol mismatch
  kUnavailable,        // peer or link gone (connection refused/reset, EOF)
  kDeadlineExceeded,   // a blocking wait ran past its deadline
  kAborted,            // stopped on purpose (shutdown, a peer's failure propagated)
  kNumerical,          // non-finite loss or gradient
  kIo,                 // local I/O failure (disk, socket set-up)
  kInternal,           // a library we call failed in a way we did not expect
};

std::string_view ErrorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);

  ErrorCode code() const { return code_; }

  // The rank this failure is blamed on, when the thrower knows (a peer that closed, stalled or
  // sent an abort notice naming the root cause); -1: unknown, or this rank itself. The job's
  // failure relay (transport/failure_relay.h) uses it so every rank names the same rank.
  int culprit() const { return culprit_; }
  Error& set_culprit(int rank) {
    culprit_ = rank;
    return *this;
  }

  // Returns a copy whose message is "<context>: <original message>", same code and culprit.
  Error Wrap(std::string_view context) const;

 private:
  ErrorCode code_;
  int culprit_ = -1;
};

// Throws Error(code, fmt::format(format, args...)).
template <typename... Args>
[[noreturn]] void Throw(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace pipesgd
