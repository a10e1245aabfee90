// Invariant checks. A failed check is a bug in pipesgd, never bad input: it prints the condition,
// file:line and the compared values to stderr and aborts. Recoverable errors use
// pipesgd::Error (core/base/error.h) instead.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

namespace pipesgd::internal {

[[noreturn]] inline void CheckFailed(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "pipesgd: invariant violated at %s:%d: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace pipesgd::internal

#define PSGD_CHECK(cond)                                                     \
  do {                                                                       \
    if (!(cond)) ::pipesgd::internal::CheckFailed(__FILE__, __LINE__, #cond); \
  } while (0)

#define PSGD_CHECK_OP_(a, b, op)                                                            \
  do {                                                                                      \
    const auto& psgd_a_ = (a);                                                              \
    const auto& psgd_b_ = (b);                                                              \
    if (!(psgd_a_ op psgd_b_))                                                              \
      ::pipesgd::internal::CheckFailed(                                                     \
          __FILE__, __LINE__,                                                               \
          fmt::format("{} {} {} ({} vs {})", #a, #op, #b, psgd_a_, psgd_b_));               \
  } while (0)

#define PSGD_CHECK_EQ(a, b) PSGD_CHECK_OP_(a, b, ==)
#define PSGD_CHECK_NE(a, b) PSGD_CHECK_OP_(a, b, !=)
#define PSGD_CHECK_LT(a, b) PSGD_CHECK_OP_(a, b, <)
#define PSGD_CHECK_LE(a, b) PSGD_CHECK_OP_(a, b, <=)
#define PSGD_CHECK_GT(a, b) PSGD_CHECK_OP_(a, b, >)
#define PSGD_CHECK_GE(a, b) PSGD_CHECK_OP_(a, b, >=)
