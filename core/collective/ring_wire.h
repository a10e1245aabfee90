// How one chunk of an AllReduce travels: the ring's schedule (Communicator::Run) decides which
// chunk goes where and when; a ChunkWire decides what its bytes are. Two strategies:
// - RawWire: float32 as it is, zero-copy: a reduce-scatter chunk lands in scratch and is added,
//   an all-gather chunk lands in place;
// - CodedWire: the codec's bytes, in arena regions of their own; error feedback at every
//   encode; DecodeAdd on the reduce-scatter; the owner's bytes forwarded unchanged on the
//   all-gather, so every rank decodes the same bytes and ends with the same bits.
// Internal to core/collective (ring_allreduce.cc and ring_wire.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/collective/ring_allreduce.h"

namespace pipesgd::collective {

// One AllReduce call, as every wire of it sees it.
struct RingCall {
  std::span<float> data;
  uint64_t seq = 0;
  ReduceOp op = ReduceOp::kSum;
  int ring_pos = 0;
  int world_size = 1;
};

class Communicator::ChunkWire {
 public:
  virtual ~ChunkWire() = default;
  virtual CodecKind kind() const = 0;
  // Payload bytes of a chunk of `count` elements.
  virtual uint64_t WireBytes(uint64_t count) const = 0;
  // Where the payload of chunk `range` is received; null: in place, in data[range], once the
  // send that last read those values is done (the schedule waits for it).
  virtual void* Landing(const Range& range, bool reduce_scatter) = 0;
  // Sends data[range] as chunk `index`. `owner_average`: the owner's averaged block.
  virtual void Send(uint64_t index, const Range& range, bool owner_average) = 0;
  // Reduce-scatter: adds the received partial sum to `values`.
  virtual void Reduce(std::span<const std::byte> received, std::span<float> values) = 0;
  // After the owner sent its reduced block: leaves in `values` what every other rank will hold.
  virtual void KeepOwned(std::span<float> values) = 0;
  // All-gather: passes chunk `range` on to the right as chunk `index`.
  virtual void Forward(uint64_t index, const Range& range,
                       std::span<const std::byte> received) = 0;
  // All-gather: leaves chunk `index`'s final values in `values`.
  virtual void Settle(uint64_t index, std::span<const std::byte> received,
                      std::span<float> values) = 0;
};

class Communicator::RawWire final : public Communicator::ChunkWire {
 public:
  RawWire(Communicator& comm, const RingCall& call) : comm_(comm), call_(call) {}
  CodecKind kind() const override { return CodecKind::kNone; }
  uint64_t WireBytes(uint64_t count) const override { return count * sizeof(float); }
  void* Landing(const Range& range, bool reduce_scatter) override;
  void Send(uint64_t index, const Range& range, bool owner_average) override;
  void Reduce(std::span<const std::byte> received, std::span<float> values) override;
  void KeepOwned(std::span<float>) override {}
  void Forward(uint64_t index, const Range& range, std::span<const std::byte>) override {
    Send(index, range, false);
  }
  void Settle(uint64_t, std::span<const std::byte>, std::span<float>) override {}

 private:
  Communicator& comm_;
  const RingCall& call_;
};

class Communicator::CodedWire final : public Communicator::ChunkWire {
 public:
  CodedWire(Communicator& comm, const RingCall& call, bool feedback)
      : comm_(comm), call_(call), feedback_(feedback) {}
  CodecKind kind() const override;
  uint64_t WireBytes(uint64_t count) const override;
  void* Landing(const Range& range, bool reduce_scatter) override;
  void Send(uint64_t index, const Range& range, bool owner_average) override;
  void Reduce(std::span<const std::byte> received, std::span<float> values) override;
  void KeepOwned(std::span<float> values) override;
  void Forward(uint64_t index, const Range& range, std::span<const std::byte> received) override;
  void Settle(uint64_t index, std::span<const std::byte> received,
              std::span<float> values) override;

 private:
  Communicator& comm_;
  const RingCall& call_;
  const bool feedback_;
  uint64_t send_used_ = 0;  // arena bytes taken so far in this call
  uint64_t recv_used_ = 0;
  std::span<const std::byte> last_sent_;  // the bytes of the last Send
};

}  // namespace pipesgd::collective
