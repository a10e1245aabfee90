#include "core/base/timeline.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::timeline {
namespace {

constexpr const char* kHead = "{\"traceEvents\":[";
constexpr const char* kTail = "],\"displayTimeUnit\":\"ms\"}";

int64_t Nanos(Recorder::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace

Recorder::Recorder(int rank, int64_t first_step, int64_t num_steps, size_t capacity)
    : rank_(rank), first_step_(first_step), num_steps_(num_steps), events_(capacity) {
  PSGD_CHECK_GE(num_steps, 1);
  PSGD_CHECK_GE(capacity, 1u);
}

void Recorder::Add(Thread thread, const char* name, Clock::time_point begin, Clock::time_point end,
                   int64_t chunk) {
  const size_t i = next_.fetch_add(1, std::memory_order_relaxed);
  if (i >= events_.size()) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  events_[i] = {name, static_cast<int>(thread), step(thread), chunk, Nanos(begin), Nanos(end)};
}

size_t Recorder::size() const {
  return std::min(next_.load(std::memory_order_relaxed), events_.size());
}

std::string Recorder::ToJson() const {
  std::string out = kHead;
  out += "\n";
  out += fmt::format(
      "{{\"ph\":\"M\",\"pid\":{0},\"tid\":0,\"name\":\"process_name\",\"args\":{{\"name\":\"rank "
      "{0}\"}}}},\n"
      "{{\"ph\":\"M\",\"pid\":{0},\"tid\":0,\"name\":\"thread_name\",\"args\":{{\"name\":"
      "\"compute\"}}}},\n"
      "{{\"ph\":\"M\",\"pid\":{0},\"tid\":1,\"name\":\"thread_name\",\"args\":{{\"name\":"
      "\"communication\"}}}}",
      rank_);
  const size_t n = size();
  for (size_t i = 0; i < n; ++i) {
    const Event& e = events_[i];
    // Microseconds with three decimals: the nanoseconds survive the round trip.
    out += fmt::format(
        ",\n{{\"ph\":\"X\",\"pid\":{},\"tid\":{},\"name\":\"{}\",\"cat\":\"{}\",\"ts\":{}.{:03d},"
        "\"dur\":{}.{:03d},\"args\":{{\"step\":{},\"chunk\":{}}}}}",
        rank_, e.tid, e.name, e.tid == kCompute ? "compute" : "comm", e.begin_ns / 1000,
        static_cast<int>(e.begin_ns % 1000), (e.end_ns - e.begin_ns) / 1000,
        static_cast<int>((e.end_ns - e.begin_ns) % 1000), e.step, e.chunk);
  }
  out += "\n";
  out += kTail;
  out += "\n";
  return out;
}

void Recorder::WriteFile(const std::string& path) const {
  const std::string text = ToJson();
  std::FILE* f = std::fopen(path.c_str(), "w");
  bool ok = f && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int err = errno;
  if (f && std::fclose(f) != 0) ok = false;
  if (!ok) Throw(ErrorCode::kIo, "--timeline {}: cannot write: {}", path, std::strerror(err));
}

std::string RankFile(const std::string& path, int rank, int world_size) {
  if (world_size == 1) return path;
  const size_t slash = path.find_last_of('/');
  const size_t dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) {
    return fmt::format("{}.rank{}", path, rank);
  }
  return fmt::format("{}.rank{}{}", path.substr(0, dot), rank, path.substr(dot));
}

void MergeRankFiles(const std::string& path, int world_size) {
  std::string merged = kHead;
  merged += "\n";
  bool first = true;
  for (int r = 0; r < world_size; ++r) {
    const std::string file = RankFile(path, r, world_size);
    std::ifstream in(file);
    if (!in) Throw(ErrorCode::kIo, "--timeline: cannot read {}: {}", file, std::strerror(errno));
    std::string line;
    std::getline(in, line);
    if (line != kHead) {
      Throw(ErrorCode::kDataLoss, "--timeline: {} does not start like a pipesgd timeline", file);
    }
    while (std::getline(in, line)) {
      if (line == kTail) break;
      if (!line.empty() && line.back() == ',') line.pop_back();
      merged += first ? "" : ",\n";
      merged += line;
      first = false;
    }
  }
  merged += "\n";
  merged += kTail;
  merged += "\n";
  std::FILE* f = std::fopen(path.c_str(), "w");
  bool ok = f && std::fwrite(merged.data(), 1, merged.size(), f) == merged.size();
  const int err = errno;
  if (f && std::fclose(f) != 0) ok = false;
  if (!ok) Throw(ErrorCode::kIo, "--timeline {}: cannot write: {}", path, std::strerror(err));
}

}  // namespace pipesgd::timeline
