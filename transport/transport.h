// The transport interface the ring AllReduce is written against, in the spirit of gloo's
// transport (device, pair, buffer) and NCCL's net plugin (isend/irecv/test):
//
//   Transport   one per process: owns the local endpoint and drives progress (gloo Device).
//   Connection  a full-duplex, ordered byte stream to one peer rank (gloo Pair).
//   Op          one posted send or receive of a scatter/gather list of caller-owned bytes.
//
// Ops are non-blocking to post and complete in posting order per connection and direction.
// Progress is driven by the thread that waits (Transport::Wait), as in UCX's
// request_wait/ucp_worker_progress: no hidden I/O thread, no cross-thread hand-off per chunk.
// A Transport and its Connections are therefore thread-compatible, not thread-safe: one thread
// (the trainer's communication thread) posts and waits.
//
// The transport knows ranks only as labels for error messages and for the connection hello; it
// knows nothing of collectives or training. Addresses are opaque bytes that the rendezvous
// exchanges (transport/rendezvous.h).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "core/base/deadline.h"

namespace pipesgd::transport {

// One posted send or receive. The caller owns it and the memory its parts point to, and must keep
// both alive and untouched until the op completes (Wait returned or done() is true). An Op can be
// reposted after it completes; reposting needs no allocation.
struct Op {
  static constexpr int kMaxParts = 2;  // header + payload is all the ring needs

  // Bytes to send from, or receive into, in order. For a send the pointers are read-only.
  struct Part {
    void* data = nullptr;
    size_t bytes = 0;
  };
  std::array<Part, kMaxParts> parts{};
  int num_parts = 0;

  // Set by the transport. Read them only after completion.
  bool done = false;
  size_t bytes_done = 0;
  std::exception_ptr error;  // the pipesgd::Error that failed this op, if any

  // Transport-private: intrusive FIFO link, so queueing needs no allocation.
  Op* next_ = nullptr;

  void Set(const void* data, size_t bytes) {
    parts[0] = {const_cast<void*>(data), bytes};
    num_parts = 1;
  }
  void Set(const void* header, size_t header_bytes, const void* data, size_t bytes) {
    parts[0] = {const_cast<void*>(header), header_bytes};
    parts[1] = {const_cast<void*>(data), bytes};
    num_parts = 2;
  }
  size_t total_bytes() const {
    size_t n = 0;
    for (int i = 0; i < num_parts; ++i) n += parts[i].bytes;
    return n;
  }
};

class Connection {
 public:
  virtual ~Connection() = default;

  // The peer's rank (for messages).
  virtual int peer_rank() const = 0;

  // Queues `op` to be sent (after every send posted before it). Non-blocking. If the connection
  // has already failed, the op completes at once with that error.
  virtual void PostSend(Op& op) = 0;
  // Queues `op` to be filled with exactly op.total_bytes() bytes (after every receive posted
  // before it). Non-blocking. A peer that closes before all bytes arrive fails the op with
  // Error(kUnavailable) naming the peer and the bytes received.
  virtual void PostRecv(Op& op) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string name() const = 0;  // "tcp"
  virtual int rank() const = 0;

  // Opaque bytes that identify this process's endpoint; the peers pass them to Connect.
  virtual std::string LocalAddress() const = 0;

  // Establishes `streams` parallel connections to each of `peers` (rank -> the address that
  // rank published), all concurrently so no order of calls across ranks can deadlock. Both sides
  // of a pair must call it with each other and the same `streams`. Blocks until every
  // connection is up. Returns them peer by peer in the order of `peers`, streams 0..streams-1
  // within a peer. Throws Error kDeadlineExceeded naming the ranks still missing, kDataLoss for
  // a bad address, kUnavailable if a peer refuses past the deadline.
  virtual std::vector<std::unique_ptr<Connection>> Connect(
      const std::vector<std::pair<int, std::string>>& peers, Deadline deadline,
      int streams = 1) = 0;

  // Drives progress until `op` completes. Rethrows the op's error (a pipesgd::Error naming the
  // peer and bytes). Throws Error kDeadlineExceeded ("<what>: no progress ...") when the
  // deadline passes, and kAborted if *abort becomes true (checked at least every 50 ms). Logs a
  // warning naming `what` (and so the peer) once when a wait runs past 10 s, or past a quarter
  // of the time it was given if that is shorter. After any error the caller may still post a
  // last message on the connections that work (the ring tells its neighbour why it stops) and
  // must then Close() the transport.
  virtual void Wait(Op& op, Deadline deadline, const char* what,
                    const std::atomic<bool>* abort = nullptr) = 0;

  // Runs handlers that are ready without blocking (lets sends progress while the caller
  // computes). Never throws; errors surface through the ops.
  virtual void Poll() = 0;

  // Closes every connection; pending ops fail with kAborted. Idempotent.
  virtual void Close() = 0;
};

}  // namespace pipesgd::transport
