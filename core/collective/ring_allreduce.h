// Ring AllReduce (reduce-scatter, then all-gather) over any pipesgd transport, with chunk
// pipelining: a chunk is forwarded as soon as it is reduced, so while chunk k of a ring step is
// being reduced, chunk k+1 is already arriving and chunk k-1 is already on its way to the right.
//
// The ring (Patarasuk & Yuan 2009; as in gloo's allreduce_ring_chunked and NCCL's runRing):
// the N ranks form a ring r -> r+1 (mod N); the buffer of `count` elements is cut into N blocks.
//   reduce-scatter, steps s = 0..N-2: rank r sends block (r-s) to the right and adds the block
//     (r-1-s) it receives from the left into its own copy. After N-1 steps rank r holds the
//     complete reduction of block (r+1).
//   all-gather, steps s = 0..N-2: rank r sends block (r+1-s) and stores the block (r-s) it
//     receives, so every rank ends with every reduced block.
// Each rank moves 2(N-1)/N of the buffer in each direction: the bandwidth-optimal schedule.
// For kAverage the owner of a block divides it by N before the all-gather, so every rank ends
// with bitwise the same values (the all-gather copies bytes; nothing is recomputed).
//
// Every chunk on the wire carries a ChunkHeader that the receiver checks before it touches the
// payload: ranks that disagree on the collective (count, op, sequence) fail with an Error naming
// both ranks and both values instead of hanging or writing past a buffer.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pipesgd/types.h"

#include "core/base/deadline.h"
#include "core/base/error.h"
#include "core/base/timeline.h"
#include "core/collective/codec.h"
#include "transport/transport.h"

namespace pipesgd::collective {

using ReduceOp = ::pipesgd::ReduceOp;  // pipesgd/types.h (public)
// What a chunk's payload holds: float32 elements (the AllReduce) or bytes that are only moved
// (Broadcast, AllGather: any element type, bitwise).
enum class DataType : uint8_t { kFloat32 = 1, kBytes = 2 };
// The header's op byte for the byte collectives (dtype kBytes), beside ReduceOp's values.
enum class ByteCollective : uint8_t { kBroadcast = 16, kAllGather = 17 };

// Elements [offset, offset + count).
struct Range {
  uint64_t offset = 0;
  uint64_t count = 0;
};

// The pure arithmetic of the ring, 64-bit throughout: how `count` elements split into N blocks
// (sizes differ by at most one: the first count % N blocks get the extra element) and how a
// block splits into chunks of at most chunk_elems elements. Blocks may be empty; chunks never
// are. A `split` inside a block also cuts its chunks there (each side chunked from its own
// start), so no chunk straddles it: elements [0, split) are compressed, [split, count) are not.
class RingPlan {
 public:
  // REQUIRES: world_size >= 1, chunk_elems >= 1, split <= count (default: no split).
  RingPlan(uint64_t count, int world_size, uint64_t chunk_elems,
           uint64_t split = UINT64_MAX);

  uint64_t count() const { return count_; }
  int world_size() const { return world_size_; }
  Range Block(int block) const;
  uint64_t ChunksInBlock(int block) const;
  // Chunk `chunk` (< ChunksInBlock(block)) of `block`.
  Range Chunk(int block, uint64_t chunk) const;

 private:
  // Elements of `block` before the split.
  uint64_t HeadOf(const Range& block) const;

  uint64_t count_;
  int world_size_;
  uint64_t chunk_elems_;
  uint64_t split_;
};

// Precedes every chunk on the wire (and travels alone, once per neighbour, for a collective of
// zero elements). 48 bytes in host byte order (little-endian on every
// supported platform; docs/wire_protocol.md). chunk_index counts the chunks one rank sends to
// its right neighbour within one collective, so a lost, duplicated or reordered chunk is caught.
struct ChunkHeader {
  static constexpr uint32_t kMagic = 0x43475350;  // "PSGC"
  // An abort notice instead of a chunk: the sender stops; `count` is the rank that failed or is
  // gone (the root cause, relayed unchanged around the ring) and the payload (at most
  // kMaxAbortBytes) is the first report of it, as text.
  static constexpr uint32_t kAbortMagic = 0x41475350;  // "PSGA"
  static constexpr uint64_t kMaxAbortBytes = 4096;
  static constexpr uint8_t kVersion = 1;

  uint32_t magic = kMagic;
  uint8_t version = kVersion;
  uint8_t op = 0;     // ReduceOp
  uint8_t dtype = 0;  // DataType
  uint8_t codec = 0;  // CodecKind of the payload (kNone: raw float32)
  uint64_t seq = 0;            // collective sequence number on this communicator (0, 1, ...)
  uint64_t count = 0;          // total elements of the collective
  uint64_t chunk_index = 0;    // position in the sender's stream for this collective
  uint64_t payload_bytes = 0;  // bytes that follow this header
  uint32_t sender_rank = 0;
  uint32_t root = 0;  // a Broadcast's root (ring position); 0 for the other collectives
};
static_assert(sizeof(ChunkHeader) == 48);

// Chunk size in bytes that `chunk_bytes = kAutoChunkBytes` picks for a collective of `count`
// fp32 elements over `world_size` ranks: about 16 chunks per ring block (so a chunk's
// reduction and forwarding hide behind the next chunk's transfer), rounded down to a power of
// two and clamped to [256 KiB, 4 MiB]. Below 256 KiB the per-chunk wake-up costs more than the
// overlap gains; above 4 MiB the pipeline fill (one chunk per ring) grows with nothing gained.
// Measured on the emulated 1gbit lab: docs/results/allreduce_lab_1gbit.md.
uint64_t AutoChunkBytes(uint64_t count, int world_size);

// Checks a received chunk header against the one `rank` expects from its left neighbour
// `left` (magic, version, sequence, op, dtype, count, chunk index, codec, payload bytes, root;
// the sender rank is not checked). Throws Error(kDataLoss) naming both ranks and both values.
void CheckChunkHeader(const ChunkHeader& got, const ChunkHeader& want, int rank, int left);

struct CommunicatorOptions {
  static constexpr uint64_t kAutoChunkBytes = 0;
  // Bytes per chunk: a multiple of 4 (whole floats), at least 4; or kAutoChunkBytes, which
  // sizes the chunks of each collective by AutoChunkBytes.
  uint64_t chunk_bytes = 1 << 20;
  // Parallel connections to each neighbour; chunk i of a stream travels on connection
  // i mod streams. One TCP flow often falls short of line rate on fast links; several share it.
  int streams = 1;  // >= 1
  // Lossy compression of the chunks on the wire (kind kNone: off). See AllReduce.
  CodecOptions codec;
  // A collective whose compressible part is smaller than this many bytes goes uncompressed:
  // for small messages latency, not bandwidth, dominates and the codec only adds error.
  uint64_t compression_min_bytes = 0;
  // Error feedback (Seide et al. 2014; Karimireddy et al. 2019) at every encode: this rank keeps,
  // per element, what its encode of that element lost and adds it to the value it encodes in
  // the next compressed call (see AllReduce).
  bool error_feedback = false;
};

// Throws Error(kInvalidArgument) unless chunk_bytes is a multiple of 4 (0: auto).
void CheckChunkBytes(uint64_t chunk_bytes);

// Per-call choices of AllReduce.
struct AllReduceOptions {
  // false: this call goes uncompressed whatever the communicator's codec (warm-up steps).
  bool compress = true;
  // The last `exact_tail` elements are never compressed nor error-fed (a trainer's loss value
  // rides there). REQUIRES: exact_tail <= data.size().
  uint64_t exact_tail = 0;
};

// What the last AllReduce put on the wire, as seen by this rank.
struct WireStats {
  uint64_t chunks_sent = 0;
  uint64_t bytes_sent = 0;        // headers and payloads
  uint64_t payload_bytes = 0;     // payloads only
  uint64_t raw_payload_bytes = 0; // what the same payloads would have been as float32
  uint64_t saturated = 0;         // elements the codec clamped (EncodeStats::saturated)
  bool compressed = false;        // the codec was used for (part of) this call
  // raw_payload_bytes / payload_bytes (1 when nothing was sent).
  double compression_ratio() const {
    return payload_bytes == 0 ? 1.0 : static_cast<double>(raw_payload_bytes) / payload_bytes;
  }
};

// Reduces a trainer's gradient slot over the ranks in place: the ring itself (Communicator), or
// PowerSGD (core/collective/powersgd.h) on top of it. The trainer's communication thread sees
// only this.
class GradientReducer {
 public:
  virtual ~GradientReducer() = default;
  // As Communicator::AllReduce (same arguments, same errors): every rank ends with bitwise the
  // same values.
  virtual void AllReduce(std::span<float> data, ReduceOp op, Deadline deadline,
                         const std::atomic<bool>* abort, const AllReduceOptions& call) = 0;
  // What the last AllReduce sent, over all the collectives it took.
  virtual const WireStats& last_wire_stats() const = 0;
  // False where the reducer keeps state across calls that no checkpoint holds (PowerSGD's
  // residual and warm-start factors); the ring's error-feedback residuals are checkpointed.
  virtual bool checkpointable() const { return true; }
};

struct RingCall;  // one AllReduce call (ring_wire.h)

// A ring of ranks over one transport. Thread-compatible: one thread (the trainer's
// communication thread) calls AllReduce at a time.
class Communicator final : public GradientReducer {
 public:
  // Connects `transport` to this rank's ring neighbours, whose addresses come from the
  // rendezvous (`addresses[r]` = rank r's Transport::LocalAddress()). Throws what
  // Transport::Connect throws.
  static std::unique_ptr<Communicator> Create(std::unique_ptr<transport::Transport> transport,
                                              int world_size,
                                              const std::vector<std::string>& addresses,
                                              const CommunicatorOptions& options,
                                              Deadline deadline);
  // A ring over a subset of the job's ranks (SDPipe's group-wise averaging, core/collective/
  // group_allreduce.h) on connections that already exist and that the caller keeps alive for
  // the communicator's lifetime: `left`/`right` (one per stream) lead to this rank's neighbours
  // in the group's ring, `ring_pos` is this rank's position in it (0 .. ring_size-1). The
  // transport is shared with the caller (and with other group rings). Error messages name
  // global ranks (the transport's rank and the connections' peers). REQUIRES: ring_size >= 1,
  // left.size() == right.size() >= 1 when ring_size > 1.
  static std::unique_ptr<Communicator> CreateOnConnections(
      std::shared_ptr<transport::Transport> transport, int ring_pos, int ring_size,
      std::vector<transport::Connection*> left, std::vector<transport::Connection*> right,
      const CommunicatorOptions& options);
  ~Communicator() override;

  // The ranks Create connects to, in the order it connects: the left neighbour, then the right
  // one if different (none for a single rank). A transport that needs its peers up front (ibverbs)
  // is created for these.
  static std::vector<int> RingPeers(int rank, int world_size);

  // Registers a long-lived buffer that will be passed to AllReduce (e.g. a trainer's gradient
  // slots) with the transport once, so RDMA transports send and receive it without per-call
  // registration. Returns null for an empty span or a single rank. The region must be destroyed
  // before this communicator. Throws what Transport::RegisterMemory throws.
  std::unique_ptr<transport::MemoryRegion> RegisterMemory(
      std::span<float> data, transport::MemoryKind kind = transport::MemoryKind::kHost);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const CommunicatorOptions& options() const { return options_; }
  transport::Transport& transport() { return *transport_; }
  // What CreateOnConnections needs to build another ring on this one's connections (another
  // chunk size, fewer streams: the start-up tuning of core/train/autotune.h). One connection
  // per stream in use; empty for a single rank.
  std::shared_ptr<transport::Transport> shared_transport() const { return transport_; }
  const std::vector<transport::Connection*>& left_connections() const { return left_; }
  const std::vector<transport::Connection*>& right_connections() const { return right_; }
  // From the next collective on: chunks of `chunk_bytes` (or kAutoChunkBytes) on the first
  // `streams` connections of each neighbour; the others stay open and idle. Every rank must make
  // the same call between the same two collectives. REQUIRES: 1 <= streams <= the streams in use
  // (1 for a single rank). Throws Error(kInvalidArgument) for a chunk size not a multiple of 4.
  void Retune(uint64_t chunk_bytes, int streams);

  // Reduces `data` in place across all ranks (sum, or sum / world_size). Every rank must call
  // AllReduce in the same order with the same element count, op and options. Uncompressed,
  // integer-valued inputs whose sums stay below 2^24 give exact results.
  //
  // With a codec (options().codec, call.compress, and at least compression_min_bytes of
  // compressible data), chunks travel encoded: each reduce-scatter hop decodes the received
  // chunk, adds its own float32 values (partial sums stay float32) and encodes the sum for the
  // next hop; the owner of a reduced chunk encodes it once, replaces its own copy with the
  // decoded value, and the all-gather forwards those same bytes, so every rank ends with
  // bitwise the same result. The error against the exact sum is at most the codec's
  // ErrorBound per encode times N encodes (N-1 hops and the all-gather).
  //
  // With error_feedback: each rank encodes every block exactly once per call (N-1 reduce-
  // scatter sends, then its own block for the all-gather), so one residual per element, e, is
  // the whole story. Before an encode of x (this rank's partial sum, or for its own block the
  // reduced value), x += e; after it, e = x - Decode(Encode(x)). The losses of every hop are
  // given back, not only those of the first, so over T calls the results add up to the exact
  // sums less the current residuals: with op kSum, sum_t result_t + sum_ranks e = sum_t
  // exact_t, up to float rounding. Residuals are kept in summed units whatever the rank's role
  // (the owner of an averaged block adds e / N and keeps N times what it lost), so with kAverage
  // sum_t result_t + (sum_ranks e) / N = sum_t exact_t, and a residual may move to another ring
  // (SDPipe's groups). What one encode can lose is bounded by the codec (ErrorBound); the
  // residual carries it to the next call. The residual covers data[0, count - exact_tail) and
  // restarts from zero, with a warning, when that size changes. docs/compression.md has the
  // derivation.
  //
  // Throws Error: kDataLoss (a neighbour disagrees: message names both ranks and both values),
  // kUnavailable (a neighbour is gone), kDeadlineExceeded, kAborted (*abort became true),
  // kNumerical (a non-finite value in data that was to be compressed: names the element).
  // After any error the communicator is unusable: it first tells its right neighbour why it
  // stops (an abort notice naming the rank that failed or is gone, relayed around the ring, so
  // every rank's error names the root cause, not just its neighbour), then closes.
  void AllReduce(std::span<float> data, ReduceOp op, Deadline deadline,
                 const std::atomic<bool>* abort = nullptr,
                 const AllReduceOptions& call = {}) override;

  // Root's `data` on every rank, bitwise, whatever the bytes hold: a chain from the root around
  // the ring (root, root+1, ...), cut into chunks of options().chunk_bytes (1 MiB when auto) so
  // each rank forwards chunk k while chunk k+1 arrives; each link carries the buffer once.
  // `root` is a ring position (the rank, for a job ring). Every rank passes the same size and
  // root (a disagreement fails with kDataLoss naming both ranks and both values). Errors,
  // failure notices and sequence numbers as AllReduce.
  void Broadcast(std::span<std::byte> data, int root, Deadline deadline,
                 const std::atomic<bool>* abort = nullptr);
  // Every rank's `mine` (the same size on every rank) side by side in `all`, ring position p's
  // at [p * mine.size(), (p + 1) * mine.size()), bitwise: N-1 ring steps, each forwarding the
  // block received in the step before (the all-gather half of AllReduce, without arithmetic).
  // REQUIRES all.size() == world_size * mine.size() (else Error kInvalidArgument, before
  // anything is sent). Errors as AllReduce.
  void AllGather(std::span<const std::byte> mine, std::span<std::byte> all, Deadline deadline,
                 const std::atomic<bool>* abort = nullptr);

  // Collectives completed or attempted so far (the next one's sequence number).
  uint64_t sequence() const { return seq_; }
  // What the last AllReduce sent.
  const WireStats& last_wire_stats() const override { return stats_; }
  // The error-feedback residual (empty until the first compressed call with error feedback).
  std::span<const float> residual() const { return residual_; }
  // Checkpoint restore: the residual, and the sequence number of the next collective (every
  // rank must restore the same one).
  void RestoreResidual(std::span<const float> residual) {
    residual_.assign(residual.begin(), residual.end());
  }
  void RestoreSequence(uint64_t seq) { seq_ = seq; }
  // Records per-chunk spans (encode, send, wait, reduce, decode) on the communication thread's
  // track while `recorder` says its step is in the window; null (the default): none, and no
  // cost beyond a pointer test. The recorder must outlive the calls.
  void set_timeline(timeline::Recorder* recorder) { timeline_ = recorder; }

 private:
  Communicator() = default;

  struct SendSlot {
    ChunkHeader header;
    transport::Op op;
  };

  // Fills slot's header for chunk `index` of collective `seq` (count elements in all) and
  // posts header + `bytes` of `payload` (encoded by `codec`) to the right neighbour. The byte
  // collectives pass their ByteCollective as `op`, DataType::kBytes and a Broadcast's root.
  void PostChunk(SendSlot& slot, uint64_t seq, ReduceOp op, uint64_t count, uint64_t index,
                 CodecKind codec, const void* payload, uint64_t bytes,
                 DataType dtype = DataType::kFloat32, uint32_t root = 0);
  void CheckHeader(const ChunkHeader& got, uint64_t seq, ReduceOp op, uint64_t count,
                   uint64_t chunk_index, CodecKind codec, uint64_t payload_bytes,
                   DataType dtype = DataType::kFloat32, uint32_t root = 0) const;
  // The common frame of every collective: a communicator that failed earlier refuses by naming
  // the first failure, and an error in `body` sends the abort notice, closes, and is rethrown
  // with the rank the ring blames. A template, not a std::function: a capture of several
  // references would be a heap allocation per collective (ring_alloc_test).
  template <typename Body>
  void Guarded(uint64_t seq, Deadline deadline, Body&& body) {
    ThrowIfFailedEarlier(seq);
    next_send_index_ = 0;
    try {
      body();
    } catch (const Error& error) {
      throw Blamed(error, seq, deadline);
    }
  }
  void ThrowIfFailedEarlier(uint64_t seq) const;
  // NotifyAndClose, then `error` with the rank the ring blames, for the job's failure relay.
  Error Blamed(const Error& error, uint64_t seq, Deadline deadline);
  // The byte collectives' chunk size: options().chunk_bytes, or 1 MiB when auto.
  uint64_t ByteChunk() const;
  // Receives the header of chunk `index` of a byte collective (posted earlier into
  // recv_headers_[index % 2]), checks it, posts the receive of its payload into `target` and
  // the receive of the next header (when `more`), and waits for the payload.
  void ReceiveBytes(uint64_t seq, ByteCollective kind, uint64_t count, uint64_t index,
                    std::span<std::byte> target, uint32_t root, bool more, Deadline deadline,
                    const std::atomic<bool>* abort);
  void PostHeaderReceive(uint64_t index);
  // The AllReduce: the ring's schedule over RingPlan (ring_allreduce.cc), each chunk on the
  // wire that fits it, raw or coded (ring_wire.h).
  class ChunkWire;
  class RawWire;
  class CodedWire;
  void Run(std::span<float> data, ReduceOp op, Deadline deadline,
           const std::atomic<bool>* abort, const AllReduceOptions& options, uint64_t seq);
  // An AllReduce of zero elements: one header each way, checked.
  void AgreeOnNothing(ReduceOp op, Deadline deadline, const std::atomic<bool>* abort,
                      uint64_t seq);
  // Waits for chunk `index`'s header (posted earlier), checks it, receives its payload where
  // `wire` lands it (in place after `reader`'s send) and posts the next header's receive.
  std::span<const std::byte> ReceiveChunk(const RingCall& call, ChunkWire& wire,
                                          uint64_t index, uint64_t total, const Range& range,
                                          bool reduce_scatter, SendSlot* reader,
                                          Deadline deadline, const std::atomic<bool>* abort);
  // What a wait is for: a header or a payload from the left neighbour, a send to the right.
  enum class WaitOn { kHeader, kPayload, kSend };
  // Waits for `o`, remembering which neighbour it depends on (for the abort notice).
  void WaitFor(transport::Op& o, WaitOn what, Deadline deadline, const std::atomic<bool>* abort);
  // If `header` is an abort notice: reads its text (from `stream` of the left neighbour) and
  // throws kUnavailable naming the rank that failed. Otherwise returns.
  void ThrowIfAbortNotice(const ChunkHeader& header, size_t stream, uint64_t seq);
  // Best effort, bounded: tells the right neighbour why this rank stops, then closes. The notice
  // may queue behind the rest of a chunk already on the wire, so it gets what is left of the
  // collective's `deadline`, at least 1 s and at most 5 s.
  void NotifyAndClose(const Error& error, uint64_t seq, Deadline deadline);

  // Sizes the error-feedback residual for data[0, head) (zero when the size changed).
  void PrepareErrorFeedback(uint64_t head);
  // Grows `buffer` to at least `size` elements, keeping it registered with the transport.
  template <typename T>
  void Reserve(std::vector<T>& buffer, size_t size, std::unique_ptr<transport::MemoryRegion>& region);

  // Shared only by group rings (CreateOnConnections); a job ring owns it alone.
  std::shared_ptr<transport::Transport> transport_;
  std::vector<std::unique_ptr<transport::Connection>> connections_;  // empty for group rings
  std::vector<transport::Connection*> left_;   // receives from rank - 1, one per stream
  std::vector<transport::Connection*> right_;  // sends to rank + 1, one per stream
  int rank_ = 0;       // the transport's (global) rank, for messages
  int ring_pos_ = 0;   // position in this ring: rank_ for a job ring
  int world_size_ = 1; // ranks in this ring
  CommunicatorOptions options_;
  uint64_t seq_ = 0;
  // What each wait is for, naming the neighbour, for timeout messages.
  std::string wait_header_;
  std::string wait_payload_;
  std::string wait_send_;
  // Reused across calls so that steady-state AllReduces do not allocate.
  std::vector<SendSlot> send_slots_;
  std::vector<float> scratch_;
  std::unique_ptr<Codec> codec_;  // null: no compression
  std::vector<std::byte> send_arena_;  // encoded chunks this rank sends, one region each
  std::vector<std::byte> recv_arena_;  // encoded chunks received, one region each
  std::vector<float> residual_;        // error feedback
  // Registrations of scratch_, send_arena_ and recv_arena_ (null until first used).
  std::unique_ptr<transport::MemoryRegion> scratch_region_, send_arena_region_, recv_arena_region_;
  WireStats stats_;
  // Failure handling: the neighbour the current wait depends on, the next chunk index this rank
  // would send (the receiver looks for the abort notice where that chunk's header would be),
  // and the root cause once known.
  ChunkHeader recv_headers_[2];
  transport::Op recv_header_ops_[2];
  transport::Op recv_payload_op_;
  SendSlot abort_notice_;
  std::string abort_text_;
  transport::Op abort_text_op_;
  int waiting_on_ = -1;
  uint64_t next_send_index_ = 0;
  int failure_origin_ = -1;
  std::string failure_report_;
  bool failed_ = false;
  timeline::Recorder* timeline_ = nullptr;
};

}  // namespace pipesgd::collective
