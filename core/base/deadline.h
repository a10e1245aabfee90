// Deadline: an absolute point on the steady clock by which a blocking wait must return.
// Every blocking call in pipesgd takes one; running past it throws
// Error(kDeadlineExceeded) naming what was being waited for.
#pragma once

#include <chrono>

namespace pipesgd {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  // A deadline `seconds` from now. seconds <= 0 means already expired.
  static Deadline After(double seconds) {
    return Deadline(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(seconds)));
  }
  // A deadline that never passes; only for tests of code that must not wait at all.
  static Deadline Infinite() { return Deadline(Clock::time_point::max()); }

  bool expired() const { return Clock::now() >= when_; }
  Clock::time_point when() const { return when_; }
  // Seconds left (never negative).
  double remaining_s() const {
    auto left = when_ - Clock::now();
    return left.count() <= 0 ? 0.0 : std::chrono::duration<double>(left).count();
  }
  // The earlier of this deadline and `seconds` from now.
  Deadline Min(double seconds) const {
    Deadline other = After(seconds);
    return other.when_ < when_ ? other : *this;
  }

 private:
  explicit Deadline(Clock::time_point when) : when_(when) {}
  Clock::time_point when_;
};

}  // namespace pipesgd
