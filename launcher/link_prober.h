// The probe's link measurements (`pipesgd probe`, launcher/timing.cc): ping-pong latency, one
// link's bandwidth alone, the per-message cost of a stream, and every link busy at once.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/base/deadline.h"
#include "core/base/measure.h"
#include "transport/transport.h"

namespace pipesgd::launcher {

constexpr size_t kBigBytes = 8u << 20;
constexpr size_t kStreamBytes = 16u << 10;
constexpr int kStreamMessages = 256;
constexpr int kBigReps = 3;

struct LinkNumbers {
  double latency_s = 0, bandwidth_Bps = 0, overhead_s = 0;
};

class Prober {
 public:
  Prober(transport::Transport& t, double timeout_s) : t_(t), timeout_s_(timeout_s) {}

  void Send(transport::Connection& c, const void* data, size_t bytes) {
    transport::Op op;
    op.Set(data, bytes);
    c.PostSend(op);
    t_.Wait(op, Deadline::After(timeout_s_), "a probe message");
  }
  void Recv(transport::Connection& c, void* data, size_t bytes) {
    transport::Op op;
    op.Set(data, bytes);
    c.PostRecv(op);
    t_.Wait(op, Deadline::After(timeout_s_), "a probe message");
  }

  LinkNumbers Ping(transport::Connection& c, int pings) {
    LinkNumbers out;
    uint64_t word = 0;
    std::vector<double> rtts;
    for (int i = 0; i < 20 + pings; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      Send(c, &word, sizeof(word));
      Recv(c, &word, sizeof(word));
      if (i >= 20) rtts.push_back(SecondsSince(t0));
    }
    const double rtt = Median(rtts);
    out.latency_s = rtt / 2;
    big_.resize(kBigBytes);
    std::vector<double> times;
    for (int i = 0; i < 1 + kBigReps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      Send(c, big_.data(), big_.size());
      Recv(c, &word, sizeof(word));
      if (i >= 1) times.push_back(SecondsSince(t0));
    }
    out.bandwidth_Bps = kBigBytes / std::max(1e-9, Median(times) - rtt);
    std::vector<transport::Op> ops(kStreamMessages);
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& op : ops) {
      op.Set(big_.data(), kStreamBytes);
      c.PostSend(op);
    }
    for (auto& op : ops) t_.Wait(op, Deadline::After(timeout_s_), "a probe message");
    Recv(c, &word, sizeof(word));
    const double t = SecondsSince(t0) - rtt;
    out.overhead_s = std::max(0.0, t / kStreamMessages - kStreamBytes / out.bandwidth_Bps);
    return out;
  }

  // Every rank at once sends `bytes` to its right and receives as many from its left, as in a
  // ring AllReduce step: what a link gives when every link and both directions of every rank
  // are busy (the CPU that sends also receives). Bytes per second per direction, the median of
  // `reps` after one untimed, and the process's CPU per byte sent (and one received).
  struct Exchange {
    double bandwidth_Bps = 0;
    double cpu_s_per_byte = 0;
  };
  Exchange RingExchange(transport::Connection& right, transport::Connection& left, size_t bytes,
                        int reps) {
    big_.resize(bytes);
    in_.resize(bytes);
    std::vector<double> times;
    double cpu0 = 0;
    for (int i = 0; i < 1 + reps; ++i) {
      transport::Op send, recv;
      recv.Set(in_.data(), in_.size());
      left.PostRecv(recv);
      if (i == 1) cpu0 = ProcessCpuSeconds();
      const auto t0 = std::chrono::steady_clock::now();
      send.Set(big_.data(), big_.size());
      right.PostSend(send);
      t_.Wait(send, Deadline::After(timeout_s_), "a ring probe message to the right");
      t_.Wait(recv, Deadline::After(timeout_s_), "a ring probe message from the left");
      if (i >= 1) times.push_back(SecondsSince(t0));
    }
    return {static_cast<double>(bytes) / std::max(1e-9, Median(times)),
            (ProcessCpuSeconds() - cpu0) / (static_cast<double>(bytes) * reps)};
  }

  void Pong(transport::Connection& c, int pings) {
    uint64_t word = 0;
    for (int i = 0; i < 20 + pings; ++i) {
      Recv(c, &word, sizeof(word));
      Send(c, &word, sizeof(word));
    }
    big_.resize(kBigBytes);
    for (int i = 0; i < 1 + kBigReps; ++i) {
      Recv(c, big_.data(), big_.size());
      Send(c, &word, sizeof(word));
    }
    std::vector<transport::Op> ops(kStreamMessages);
    for (auto& op : ops) {
      op.Set(big_.data(), kStreamBytes);
      c.PostRecv(op);
    }
    for (auto& op : ops) t_.Wait(op, Deadline::After(timeout_s_), "a probe message");
    Send(c, &word, sizeof(word));
  }

 private:
  transport::Transport& t_;
  double timeout_s_;
  std::vector<char> big_;
  std::vector<char> in_;
};

}  // namespace pipesgd::launcher
