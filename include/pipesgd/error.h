// pipesgd::Error, the one exception type pipesgd throws for anything the environment or the
// caller can cause (I/O failures, peer loss, deadlines, bad input). Public: the embedding API
// (pipesgd/pipesgd.h) throws it, and the library uses this same definition inside.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

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
  // failure relay uses it so every rank names the same rank.
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

}  // namespace pipesgd
