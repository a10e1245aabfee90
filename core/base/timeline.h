// A timeline of one rank's compute and communication, written as Chrome trace-event JSON
// (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU; Perfetto
// and chrome://tracing open it), so the overlap of pipelined SGD (width 2: the AllReduce of
// step t while step t+1 is computed) can be seen rather than inferred.
//
// One Recorder per rank, shared by its compute thread (tid 0: forward, backward, update) and its
// communication thread (tid 1: the AllReduce of a step and, per chunk, encode, send, wait,
// reduce, decode). Each thread says which step it works on (SetStep); spans are kept only while
// that step lies in the window [first_step, first_step + num_steps), so a long run records a
// few steps, not all of them.
//
// Cost: the event array is allocated once, at construction; recording a span is two clock reads
// and one atomic increment, no allocation and no lock. Code that has no Recorder (the timeline
// is off) pays one null-pointer test per span (tests/ring_alloc_test.cc keeps the ring at zero
// allocations per call either way). Events beyond the capacity are counted and dropped.
//
// Each span is one complete event ("ph": "X": begin `ts` and duration `dur`, microseconds since
// the Unix epoch, so files of ranks on one machine or on NTP-synchronised hosts line up) with
// pid = rank, tid = thread and args {step, chunk}.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace pipesgd::timeline {

enum Thread : int { kCompute = 0, kComm = 1 };

class Recorder {
 public:
  using Clock = std::chrono::system_clock;

  // REQUIRES: num_steps >= 1, capacity >= 1 (events).
  Recorder(int rank, int64_t first_step, int64_t num_steps, size_t capacity = 1 << 18);

  // The step `thread` is working on now (spans of other steps are not kept).
  void SetStep(Thread thread, int64_t step) {
    step_[thread].store(step, std::memory_order_relaxed);
  }
  int64_t step(Thread thread) const { return step_[thread].load(std::memory_order_relaxed); }
  bool Active(Thread thread) const {
    const int64_t s = step(thread);
    return s >= first_step_ && s < first_step_ + num_steps_;
  }

  // Records a span of `thread` at its current step. `name` must be a string literal (it is kept
  // by pointer). chunk: the chunk index within the collective, or -1.
  void Add(Thread thread, const char* name, Clock::time_point begin, Clock::time_point end,
           int64_t chunk = -1);

  size_t size() const;  // events kept
  size_t dropped() const { return dropped_.load(std::memory_order_relaxed); }

  // {"traceEvents": [...], "displayTimeUnit": "ms"}, one event per line, with metadata events
  // naming the process ("rank R") and the two threads. Call after the threads stopped recording.
  std::string ToJson() const;
  // Writes ToJson() to `path`. Throws Error(kIo) naming the path.
  void WriteFile(const std::string& path) const;

 private:
  struct Event {
    const char* name;
    int tid;
    int64_t step;
    int64_t chunk;
    int64_t begin_ns;
    int64_t end_ns;
  };
  int rank_;
  int64_t first_step_;
  int64_t num_steps_;
  std::vector<Event> events_;
  std::atomic<size_t> next_{0};
  std::atomic<size_t> dropped_{0};
  std::atomic<int64_t> step_[2] = {-1, -1};
};

// Records [construction, destruction) on `recorder` if it is non-null and active for `thread`.
class Span {
 public:
  Span(Recorder* recorder, Thread thread, const char* name, int64_t chunk = -1)
      : recorder_(recorder != nullptr && recorder->Active(thread) ? recorder : nullptr),
        thread_(thread),
        name_(name),
        chunk_(chunk) {
    if (recorder_) begin_ = Recorder::Clock::now();
  }
  ~Span() { End(); }
  // Ends the span now (the destructor then records nothing).
  void End() {
    if (recorder_) recorder_->Add(thread_, name_, begin_, Recorder::Clock::now(), chunk_);
    recorder_ = nullptr;
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  Recorder* recorder_;
  Thread thread_;
  const char* name_;
  int64_t chunk_;
  Recorder::Clock::time_point begin_{};
};

// The file rank `rank` of `world_size` writes for `--timeline path`: path itself for one rank,
// else path with ".rank<R>" before its extension (tl.json -> tl.rank2.json).
std::string RankFile(const std::string& path, int rank, int world_size);

// Merges the rank files of `world_size` ranks (RankFile) into one trace at `path`. Throws
// Error(kIo) naming a missing or unreadable file, kDataLoss for a file not written by Recorder.
void MergeRankFiles(const std::string& path, int world_size);

}  // namespace pipesgd::timeline
