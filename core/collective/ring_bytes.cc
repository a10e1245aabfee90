// The ring's byte collectives, Broadcast and AllGather (ring_allreduce.h): bytes that are only
// moved, never added, so any element type arrives bitwise (a float32 sum with a -0.0 fill, the
// trick an AllReduce-only ring would use, quiets signalling NaNs and is no way to move an int64).
// They share the AllReduce's frame: chunk headers checked before a payload is touched, abort
// notices relayed around the ring, one sequence number per collective.
#include <algorithm>
#include <cstring>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/collective/ring_allreduce.h"

namespace pipesgd::collective {

namespace {
constexpr uint64_t kAutoByteChunk = 1 << 20;

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
}  // namespace

uint64_t Communicator::ByteChunk() const {
  return options_.chunk_bytes != CommunicatorOptions::kAutoChunkBytes ? options_.chunk_bytes
                                                                      : kAutoByteChunk;
}

void Communicator::PostHeaderReceive(uint64_t index) {
  transport::Op& op = recv_header_ops_[index % 2];
  op.Set(&recv_headers_[index % 2], sizeof(ChunkHeader));
  left_[index % left_.size()]->PostRecv(op);
}

void Communicator::ReceiveBytes(uint64_t seq, ByteCollective kind, uint64_t count,
                                uint64_t index, std::span<std::byte> target, uint32_t root,
                                bool more, Deadline deadline, const std::atomic<bool>* abort) {
  const ChunkHeader& header = recv_headers_[index % 2];
  WaitFor(recv_header_ops_[index % 2], WaitOn::kHeader, deadline, abort);
  ThrowIfAbortNotice(header, index % left_.size(), seq);
  CheckHeader(header, seq, static_cast<ReduceOp>(kind), count, index, CodecKind::kNone,
              target.size(), DataType::kBytes, root);
  // Per stream the order is header, payload, next header, as the sender wrote them; an empty
  // payload was not sent at all (message transports skip empty parts), so nothing is received.
  if (!target.empty()) {
    recv_payload_op_.Set(target.data(), target.size());
    left_[index % left_.size()]->PostRecv(recv_payload_op_);
  }
  if (more) PostHeaderReceive(index + 1);
  if (!target.empty()) WaitFor(recv_payload_op_, WaitOn::kPayload, deadline, abort);
}

void Communicator::Broadcast(std::span<std::byte> data, int root, Deadline deadline,
                             const std::atomic<bool>* abort) {
  if (root < 0 || root >= world_size_) {
    Throw(ErrorCode::kInvalidArgument, "rank {}: broadcast root {}: expected 0 <= root < {}",
          rank_, root, world_size_);
  }
  const uint64_t seq = seq_++;
  stats_ = WireStats{};
  if (world_size_ == 1) return;
  Guarded(seq, deadline, [&] {
    const int n = world_size_;
    const uint64_t chunk = ByteChunk();
    // An empty broadcast still sends one header down the chain, so a rank that disagrees on
    // the size or the root fails by name instead of by timeout.
    const uint64_t chunks = data.empty() ? 1 : CeilDiv(data.size(), chunk);
    const bool is_root = ring_pos_ == root;
    const bool forwards = (ring_pos_ + 1) % n != root;  // the chain's last rank sends nothing
    const auto kind = static_cast<ReduceOp>(ByteCollective::kBroadcast);
    const auto root32 = static_cast<uint32_t>(root);
    auto piece = [&](uint64_t c) {
      const uint64_t begin = std::min<uint64_t>(c * chunk, data.size());
      return data.subspan(begin, std::min<uint64_t>(chunk, data.size() - begin));
    };
    if (send_slots_.size() < chunks) send_slots_.resize(chunks);
    if (!is_root) PostHeaderReceive(0);
    for (uint64_t c = 0; c < chunks; ++c) {
      const std::span<std::byte> bytes = piece(c);
      if (!is_root) {
        ReceiveBytes(seq, ByteCollective::kBroadcast, data.size(), c, bytes, root32,
                     c + 1 < chunks, deadline, abort);
      }
      if (is_root || forwards) {
        stats_.raw_payload_bytes += bytes.size();
        PostChunk(send_slots_[c], seq, kind, data.size(), c, CodecKind::kNone, bytes.data(),
                  bytes.size(), DataType::kBytes, root32);
      }
    }
    if (is_root || forwards) {
      for (uint64_t c = 0; c < chunks; ++c) {
        WaitFor(send_slots_[c].op, WaitOn::kSend, deadline, abort);
      }
    }
  });
}

void Communicator::AllGather(std::span<const std::byte> mine, std::span<std::byte> all,
                             Deadline deadline, const std::atomic<bool>* abort) {
  const uint64_t block = mine.size();
  const auto n = static_cast<uint64_t>(world_size_);
  if (all.size() != n * block) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: all-gather of {} bytes per rank into {} bytes: expected world size {} x {} "
          "= {}",
          rank_, block, all.size(), n, block, n * block);
  }
  const uint64_t seq = seq_++;
  stats_ = WireStats{};
  const auto pos = static_cast<uint64_t>(ring_pos_);
  if (!mine.empty()) std::memmove(all.data() + pos * block, mine.data(), block);
  if (world_size_ == 1) return;
  Guarded(seq, deadline, [&] {
    const uint64_t chunk = ByteChunk();
    // Empty blocks still send one header per step (see Broadcast).
    const uint64_t per_block = block == 0 ? 1 : CeilDiv(block, chunk);
    const uint64_t steps = n - 1;
    const uint64_t total = steps * per_block;
    const auto kind = static_cast<ReduceOp>(ByteCollective::kAllGather);
    // Chunk c of block b.
    auto piece = [&](uint64_t b, uint64_t c) {
      const uint64_t begin = std::min<uint64_t>(c * chunk, block);
      return all.subspan(b * block + begin, std::min<uint64_t>(chunk, block - begin));
    };
    auto send = [&](uint64_t index, std::span<std::byte> bytes) {
      stats_.raw_payload_bytes += bytes.size();
      PostChunk(send_slots_[index], seq, kind, block, index, CodecKind::kNone, bytes.data(),
                bytes.size(), DataType::kBytes);
    };
    if (send_slots_.size() < total) send_slots_.resize(total);
    // Step s sends block pos - s and receives block pos - 1 - s; step 0's block is this rank's
    // own, whole, right away; every later step forwards what the step before received.
    for (uint64_t c = 0; c < per_block; ++c) send(c, piece(pos, c));
    PostHeaderReceive(0);
    for (uint64_t s = 0; s < steps; ++s) {
      const uint64_t b = (pos + n - 1 - s) % n;
      for (uint64_t c = 0; c < per_block; ++c) {
        const uint64_t index = s * per_block + c;
        ReceiveBytes(seq, ByteCollective::kAllGather, block, index, piece(b, c), 0,
                     index + 1 < total, deadline, abort);
        if (s + 1 < steps) send((s + 1) * per_block + c, piece(b, c));
      }
    }
    for (uint64_t i = 0; i < total; ++i) {
      WaitFor(send_slots_[i].op, WaitOn::kSend, deadline, abort);
    }
  });
}

}  // namespace pipesgd::collective
