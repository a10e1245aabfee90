#include "core/base/error.h"

namespace pipesgd {

std::string_view ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kNotFound: return "not found";
    case ErrorCode::kDataLoss: return "data loss";
    case ErrorCode::kUnavailable: return "unavailable";
    case ErrorCode::kDeadlineExceeded: return "deadline exceeded";
    case ErrorCode::kAborted: return "aborted";
    case ErrorCode::kNumerical: return "numerical";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(message), code_(code) {}

Error Error::Wrap(std::string_view context) const {
  Error wrapped(code_, fmt::format("{}: {}", context, what()));
  wrapped.culprit_ = culprit_;
  return wrapped;
}

}  // namespace pipesgd
