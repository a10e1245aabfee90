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

#include "core/base/deadline.h"
#include "transport/transport.h"

namespace pipesgd::collective {

enum class ReduceOp : uint8_t { kSum = 1, kAverage = 2 };
enum class DataType : uint8_t { kFloat32 = 1 };

// Elements [offset, offset + count).
struct Range {
  uint64_t offset = 0;
  uint64_t count = 0;
};

// The pure arithmetic of the ring, 64-bit throughout: how `count` elements split into N blocks
// (sizes differ by at most one: the first count % N blocks get the extra element) and how a
// block splits into chunks of at most chunk_elems elements. Blocks and chunks may be empty.
class RingPlan {
 public:
  // REQUIRES: world_size >= 1, chunk_elems >= 1.
  RingPlan(uint64_t count, int world_size, uint64_t chunk_elems);

  uint64_t count() const { return count_; }
  int world_size() const { return world_size_; }
  Range Block(int block) const;
  uint64_t ChunksInBlock(int block) const;
  // Chunk `chunk` (< ChunksInBlock(block)) of `block`.
  Range Chunk(int block, uint64_t chunk) const;

 private:
  uint64_t count_;
  int world_size_;
  uint64_t chunk_elems_;
};

// Precedes every chunk on the wire (and travels alone, once per neighbour, for a collective of
// zero elements). 48 bytes in host byte order (little-endian on every
// supported platform; docs/wire_protocol.md). chunk_index counts the chunks one rank sends to
// its right neighbour within one collective, so a lost, duplicated or reordered chunk is caught.
struct ChunkHeader {
  static constexpr uint32_t kMagic = 0x43475350;  // "PSGC"
  static constexpr uint8_t kVersion = 1;

  uint32_t magic = kMagic;
  uint8_t version = kVersion;
  uint8_t op = 0;     // ReduceOp
  uint8_t dtype = 0;  // DataType
  uint8_t reserved0 = 0;
  uint64_t seq = 0;            // collective sequence number on this communicator (0, 1, ...)
  uint64_t count = 0;          // total elements of the collective
  uint64_t chunk_index = 0;    // position in the sender's stream for this collective
  uint64_t payload_bytes = 0;  // bytes that follow this header
  uint32_t sender_rank = 0;
  uint32_t reserved1 = 0;
};
static_assert(sizeof(ChunkHeader) == 48);

// Chunk size in bytes that `chunk_bytes = kAutoChunkBytes` picks for a collective of `count`
// fp32 elements over `world_size` ranks: about 16 chunks per ring block (so a chunk's
// reduction and forwarding hide behind the next chunk's transfer), rounded down to a power of
// two and clamped to [256 KiB, 4 MiB]. Below 256 KiB the per-chunk wake-up costs more than the
// overlap gains; above 4 MiB the pipeline fill (one chunk per ring) grows with nothing gained.
// Measured on the emulated 1gbit lab: docs/results/allreduce_lab_1gbit.md.
uint64_t AutoChunkBytes(uint64_t count, int world_size);

struct CommunicatorOptions {
  static constexpr uint64_t kAutoChunkBytes = 0;
  // Bytes per chunk: a multiple of 4 (whole floats), at least 4; or kAutoChunkBytes, which
  // sizes the chunks of each collective by AutoChunkBytes.
  uint64_t chunk_bytes = 1 << 20;
  // Parallel connections to each neighbour; chunk i of a stream travels on connection
  // i mod streams. One TCP flow often falls short of line rate on fast links; several share it.
  int streams = 1;  // >= 1
};

// A ring of ranks over one transport. Thread-compatible: one thread (the trainer's
// communication thread) calls AllReduce at a time.
class Communicator {
 public:
  // Connects `transport` to this rank's ring neighbours, whose addresses come from the
  // rendezvous (`addresses[r]` = rank r's Transport::LocalAddress()). Throws what
  // Transport::Connect throws.
  static std::unique_ptr<Communicator> Create(std::unique_ptr<transport::Transport> transport,
                                              int world_size,
                                              const std::vector<std::string>& addresses,
                                              const CommunicatorOptions& options,
                                              Deadline deadline);
  ~Communicator();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const CommunicatorOptions& options() const { return options_; }
  transport::Transport& transport() { return *transport_; }

  // Reduces `data` in place across all ranks (sum, or sum / world_size). Every rank must call
  // AllReduce in the same order with the same element count and op. Integer-valued inputs
  // whose sums stay below 2^24 give exact results.
  // Throws Error: kDataLoss (a neighbour disagrees: message names both ranks and both values),
  // kUnavailable (a neighbour is gone), kDeadlineExceeded, kAborted (*abort became true).
  // After any error the communicator is unusable.
  void AllReduce(std::span<float> data, ReduceOp op, Deadline deadline,
                 const std::atomic<bool>* abort = nullptr);

  // Collectives completed or attempted so far (the next one's sequence number).
  uint64_t sequence() const { return seq_; }

 private:
  Communicator() = default;

  struct SendSlot {
    ChunkHeader header;
    transport::Op op;
  };

  // Fills slot's header for chunk `index` of collective `seq` (count elements in all) and
  // posts header + `elems` floats of `payload` to the right neighbour.
  void PostChunk(SendSlot& slot, uint64_t seq, ReduceOp op, uint64_t count, uint64_t index,
                 const float* payload, uint64_t elems);
  void CheckHeader(const ChunkHeader& got, uint64_t seq, ReduceOp op, uint64_t count,
                   uint64_t chunk_index, uint64_t payload_bytes) const;

  std::unique_ptr<transport::Transport> transport_;
  std::vector<std::unique_ptr<transport::Connection>> connections_;
  std::vector<transport::Connection*> left_;   // receives from rank - 1, one per stream
  std::vector<transport::Connection*> right_;  // sends to rank + 1, one per stream
  int rank_ = 0;
  int world_size_ = 1;
  CommunicatorOptions options_;
  uint64_t seq_ = 0;
  // What each wait is for, naming the neighbour, for timeout messages.
  std::string wait_header_;
  std::string wait_payload_;
  std::string wait_send_;
  // Reused across calls so that steady-state AllReduces do not allocate.
  std::vector<SendSlot> send_slots_;
  std::vector<float> scratch_;
};

}  // namespace pipesgd::collective
