// The transport interface the ring AllReduce is written against, in the spirit of gloo's
// transport (device, pair, buffer) and NCCL's net plugin (isend/irecv/test):
//
//   Transport   one per process: owns the local endpoint and drives progress (gloo Device).
//   Connection  a full-duplex, ordered stream to one peer rank (gloo Pair): bytes on TCP,
//               messages on UCX and ibverbs (see Framing).
//   Op          one posted send or receive of a scatter/gather list of caller-owned bytes.
//
// Ops are non-blocking to post and complete in posting order per connection and direction.
// Progress is driven by the thread that waits (Transport::Wait), as in UCX's
// request_wait/ucp_worker_progress: no hidden I/O thread, no cross-thread hand-off per chunk.
// The waiting (deadline, abort, stall warning) lives once, in Transport::Wait; a transport
// supplies only its progress step and how it idles (as an NCCL net plugin supplies test()).
// A Transport and its Connections are therefore thread-compatible, not thread-safe: one thread
// (the trainer's communication thread) posts and waits.
//
// The transport knows ranks only as labels for error messages and for the connection hello; it
// knows nothing of collectives or training. Addresses are opaque bytes that the rendezvous
// exchanges (transport/rendezvous.h).
//
// Framing. TCP is a byte stream: a receive may take any number of bytes of what was sent. The
// message transports (UCX tag messages, ibverbs RDMA writes) deliver each non-empty part of a
// send as one message, so there a receive's parts must mirror the sender's, part for part and
// byte for byte (empty parts are skipped on both sides); a mismatch fails the op with
// Error(kDataLoss) naming both sizes (UCX: the receive; ibverbs: the send) and closes the
// connection. Portable callers, like the ring (a 48-byte header receive, then a payload
// receive, for each header + payload send), post receives that way.
//
// Memory. Any host memory can be sent from and received into. RegisterMemory registers a
// long-lived buffer once (pinning it for RDMA, ucp_mem_map for UCX); ops whose parts lie inside
// a live region then use it with no per-op registration. CUDA device memory must be registered
// before use, and only transports with GPU support accept it (capabilities()).
// Implementations are in transport/tcp, transport/ucx and transport/ibverbs; transport/factory.h
// creates one by name. docs/transports.md compares them.
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
// both alive and untouched until the op completes (Wait returned, or `done` is true); a Wait that
// threw (deadline, abort) leaves the op posted until the transport's Close() fails it. An Op can
// be reposted after it completes; reposting needs no allocation.
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

  // Transport-private: intrusive FIFO link, so queueing needs no allocation, and per-part
  // handles (UCX requests, ibverbs sequence numbers) for the transports that need them.
  Op* next_ = nullptr;
  std::array<void*, kMaxParts> handles_{};
  uint64_t seq_ = 0;

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

// Where a buffer lives.
enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };
const char* MemoryKindName(MemoryKind kind);  // "host", "cuda"

// A registered buffer (RAII over ucp_mem_h / ibv_mr; nothing for TCP). Move-only through its
// unique_ptr; deregisters when destroyed. The memory must outlive the region, and the region
// must outlive every op that uses it. Regions must be destroyed before their transport.
class MemoryRegion {
 public:
  MemoryRegion(void* data, size_t bytes, MemoryKind kind) : data_(data), bytes_(bytes), kind_(kind) {}
  virtual ~MemoryRegion() = default;
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemoryKind kind() const { return kind_; }
  // True if [p, p + n) lies inside this region.
  bool Contains(const void* p, size_t n) const {
    auto b = reinterpret_cast<uintptr_t>(data_), q = reinterpret_cast<uintptr_t>(p);
    return q >= b && n <= bytes_ && q - b <= bytes_ - n;
  }

 private:
  void* data_;
  size_t bytes_;
  MemoryKind kind_;
};

// What a transport can do, for `pipesgd info`, the auto choice and callers that adapt.
struct Capabilities {
  bool byte_stream = true;   // false: receives must mirror sends part for part (see Framing)
  bool cuda_memory = false;  // RegisterMemory accepts MemoryKind::kCuda (GPUDirect RDMA, cuda_ipc)
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

  // Starts the connection's congestion control afresh, as on a new connection, while no op is
  // in flight; returns the algorithm restarted, or "" where there is none or it was left alone.
  // TCP: tcp/congestion.h (why: a tuning's traffic leaves each connection in a phase of its
  // own). Others: nothing.
  virtual std::string RestartCongestionControl() { return {}; }
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string name() const = 0;  // "tcp", "ucx", "ibverbs"
  virtual int rank() const = 0;
  virtual Capabilities capabilities() const { return {}; }
  // What this transport runs over, for logs: "tcp 10.0.0.1:4242", "ucx (tcp/eth0 ...)".
  virtual std::string Describe() const { return name(); }

  // Registers [data, data + bytes) of `kind` memory once, for every later op on any connection
  // of this transport (slow: do it per long-lived buffer, never per step). Overlapping regions
  // are allowed; the newest live region containing a part is used. The default (TCP) accepts
  // host memory and does nothing. Throws Error kInvalidArgument if this transport cannot use
  // `kind` memory (naming the transport and the kind), kIo if registration fails (the
  // ibverbs transport names RLIMIT_MEMLOCK and its value when that is the cause).
  virtual std::unique_ptr<MemoryRegion> RegisterMemory(void* data, size_t bytes, MemoryKind kind);

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
  // Does not Close() on a deadline or an abort: the caller may still tell a neighbour why it
  // stops, then closes.
  void Wait(Op& op, Deadline deadline, const char* what, const std::atomic<bool>* abort = nullptr);

  // Runs handlers that are ready without blocking (lets sends progress while the caller
  // computes). Never throws; errors surface through the ops.
  virtual void Poll() = 0;

  // Closes every connection; pending ops fail with kAborted. Idempotent. TCP: every pending op
  // has failed when it returns and none is referenced after (a caller may free them next);
  // UCX and ibverbs fail them here or at the next progress (not checked for ops freed at once).
  virtual void Close() = 0;

 protected:
  // Wait's progress step: completes what it can without blocking; true if anything happened
  // (Wait then polls again at once). Errors surface through the ops.
  virtual bool ProgressOnce() = 0;
  // After SpinsBeforeIdle() steps in a row with nothing done: blocks until something may have
  // happened (an event fd, one asio handler) or `until`, which is at most 50 ms away.
  virtual void Idle(Deadline::Clock::time_point until) = 0;
  // Spinning costs a core but answers in microseconds; 0 idles at once.
  virtual int SpinsBeforeIdle() const { return 0; }
};

}  // namespace pipesgd::transport
