#include "core/collective/ring_allreduce.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "core/collective/ring_wire.h"

namespace pipesgd::collective {

// ---------------------------------------------------------------------------------------------
// RingPlan

RingPlan::RingPlan(uint64_t count, int world_size, uint64_t chunk_elems, uint64_t split)
    : count_(count),
      world_size_(world_size),
      chunk_elems_(chunk_elems),
      split_(split == UINT64_MAX ? count : split) {
  PSGD_CHECK_GE(world_size, 1);
  PSGD_CHECK_GE(chunk_elems, 1u);
  PSGD_CHECK_LE(split_, count);
}

Range RingPlan::Block(int block) const {
  PSGD_CHECK(block >= 0 && block < world_size_);
  const uint64_t n = static_cast<uint64_t>(world_size_);
  const uint64_t b = static_cast<uint64_t>(block);
  const uint64_t base = count_ / n;
  const uint64_t extra = count_ % n;  // the first `extra` blocks hold one more element
  return {b * base + std::min(b, extra), base + (b < extra ? 1 : 0)};
}

uint64_t RingPlan::HeadOf(const Range& block) const {
  if (split_ <= block.offset) return 0;
  return std::min(block.count, split_ - block.offset);
}

uint64_t RingPlan::ChunksInBlock(int block) const {
  const Range b = Block(block);
  const uint64_t head = HeadOf(b);
  auto chunks = [&](uint64_t elems) { return (elems + chunk_elems_ - 1) / chunk_elems_; };
  return chunks(head) + chunks(b.count - head);
}

Range RingPlan::Chunk(int block, uint64_t chunk) const {
  const Range b = Block(block);
  PSGD_CHECK_LT(chunk, ChunksInBlock(block));
  const uint64_t head = HeadOf(b);
  const uint64_t head_chunks = (head + chunk_elems_ - 1) / chunk_elems_;
  if (chunk < head_chunks) {
    const uint64_t offset = chunk * chunk_elems_;
    return {b.offset + offset, std::min(chunk_elems_, head - offset)};
  }
  const uint64_t offset = head + (chunk - head_chunks) * chunk_elems_;
  return {b.offset + offset, std::min(chunk_elems_, b.count - offset)};
}

uint64_t AutoChunkBytes(uint64_t count, int world_size) {
  PSGD_CHECK_GE(world_size, 1);
  constexpr uint64_t kMin = 256 << 10, kMax = 4 << 20;
  const uint64_t block_bytes = count / static_cast<uint64_t>(world_size) * sizeof(float);
  const uint64_t target = block_bytes / 16;
  if (target <= kMin) return kMin;
  if (target >= kMax) return kMax;
  return std::bit_floor(target);
}

void CheckChunkBytes(uint64_t chunk_bytes) {
  if (chunk_bytes % sizeof(float) != 0) {
    Throw(ErrorCode::kInvalidArgument,
          "chunk_bytes = {}: expected a positive multiple of 4, or 0 (auto)", chunk_bytes);
  }
}

// ---------------------------------------------------------------------------------------------
// Communicator

std::unique_ptr<Communicator> Communicator::Create(
    std::unique_ptr<transport::Transport> transport, int world_size,
    const std::vector<std::string>& addresses, const CommunicatorOptions& options,
    Deadline deadline) {
  PSGD_CHECK_EQ(static_cast<int>(addresses.size()), world_size);
  CheckChunkBytes(options.chunk_bytes);
  if (options.streams < 1 || options.streams > 64) {
    Throw(ErrorCode::kInvalidArgument, "streams = {}: expected an integer in [1, 64]",
          options.streams);
  }
  std::unique_ptr<Communicator> comm(new Communicator());
  if (options.codec.kind != CodecKind::kNone) comm->codec_ = MakeCodec(options.codec);
  comm->rank_ = transport->rank();
  comm->ring_pos_ = comm->rank_;
  comm->world_size_ = world_size;
  comm->options_ = options;
  comm->transport_ = std::move(transport);
  if (world_size == 1) return comm;

  const int left = (comm->rank_ + world_size - 1) % world_size;
  const int right = (comm->rank_ + 1) % world_size;
  std::vector<std::pair<int, std::string>> peers;
  for (int peer : RingPeers(comm->rank_, world_size)) peers.push_back({peer, addresses[peer]});
  const int k = options.streams;
  comm->connections_ = comm->transport_->Connect(peers, deadline, k);
  for (int s = 0; s < k; ++s) {
    comm->left_.push_back(comm->connections_[s].get());
    comm->right_.push_back(comm->connections_[right != left ? k + s : s].get());
  }
  comm->wait_header_ = fmt::format("a chunk header from rank {} (left neighbour)", left);
  comm->wait_payload_ = fmt::format("a chunk from rank {} (left neighbour)", left);
  comm->wait_send_ = fmt::format("a chunk send to rank {} (right neighbour)", right);
  return comm;
}

std::unique_ptr<Communicator> Communicator::CreateOnConnections(
    std::shared_ptr<transport::Transport> transport, int ring_pos, int ring_size,
    std::vector<transport::Connection*> left, std::vector<transport::Connection*> right,
    const CommunicatorOptions& options) {
  PSGD_CHECK(ring_size >= 1 && ring_pos >= 0 && ring_pos < ring_size);
  PSGD_CHECK_EQ(left.size(), right.size());
  PSGD_CHECK(ring_size == 1 || !left.empty());
  CheckChunkBytes(options.chunk_bytes);
  std::unique_ptr<Communicator> comm(new Communicator());
  if (options.codec.kind != CodecKind::kNone) comm->codec_ = MakeCodec(options.codec);
  comm->rank_ = transport->rank();
  comm->ring_pos_ = ring_pos;
  comm->world_size_ = ring_size;
  comm->options_ = options;
  comm->transport_ = std::move(transport);
  if (ring_size == 1) return comm;
  comm->left_ = std::move(left);
  comm->right_ = std::move(right);
  const int l = comm->left_[0]->peer_rank(), r = comm->right_[0]->peer_rank();
  comm->wait_header_ = fmt::format("a chunk header from rank {} (left neighbour in the group)", l);
  comm->wait_payload_ = fmt::format("a chunk from rank {} (left neighbour in the group)", l);
  comm->wait_send_ = fmt::format("a chunk send to rank {} (right neighbour in the group)", r);
  return comm;
}

void Communicator::Retune(uint64_t chunk_bytes, int streams) {
  CheckChunkBytes(chunk_bytes);
  const int in_use = left_.empty() ? 1 : static_cast<int>(left_.size());
  PSGD_CHECK_GE(streams, 1);
  PSGD_CHECK_LE(streams, in_use);
  options_.chunk_bytes = chunk_bytes;
  options_.streams = streams;
  if (!left_.empty()) {
    left_.resize(static_cast<size_t>(streams));
    right_.resize(static_cast<size_t>(streams));
  }
}

Communicator::~Communicator() {
  // Regions and connections reference the transport: drop them first.
  scratch_region_.reset();
  send_arena_region_.reset();
  recv_arena_region_.reset();
  connections_.clear();
}

std::vector<int> Communicator::RingPeers(int rank, int world_size) {
  PSGD_CHECK(world_size >= 1 && rank >= 0 && rank < world_size);
  if (world_size == 1) return {};
  const int left = (rank + world_size - 1) % world_size;
  const int right = (rank + 1) % world_size;
  if (left == right) return {left};
  return {left, right};
}

std::unique_ptr<transport::MemoryRegion> Communicator::RegisterMemory(std::span<float> data,
                                                                      transport::MemoryKind kind) {
  if (data.empty() || world_size_ == 1) return nullptr;
  return transport_->RegisterMemory(data.data(), data.size_bytes(), kind);
}

template <typename T>
void Communicator::Reserve(std::vector<T>& buffer, size_t size,
                           std::unique_ptr<transport::MemoryRegion>& region) {
  if (buffer.size() >= size) return;
  region.reset();
  buffer.resize(size);
  region = transport_->RegisterMemory(buffer.data(), buffer.size() * sizeof(T),
                                      transport::MemoryKind::kHost);
}

namespace {
// "all-reduce (sum)", "broadcast", ... for a header's op and dtype bytes.
std::string CollectiveName(uint8_t op, uint8_t dtype) {
  if (dtype == static_cast<uint8_t>(DataType::kFloat32)) {
    if (op == static_cast<uint8_t>(ReduceOp::kSum)) return "all-reduce (sum)";
    if (op == static_cast<uint8_t>(ReduceOp::kAverage)) return "all-reduce (average)";
  } else if (dtype == static_cast<uint8_t>(DataType::kBytes)) {
    if (op == static_cast<uint8_t>(ByteCollective::kBroadcast)) return "broadcast";
    if (op == static_cast<uint8_t>(ByteCollective::kAllGather)) return "all-gather";
  }
  return fmt::format("op {} dtype {}", op, dtype);
}
}  // namespace

void CheckChunkHeader(const ChunkHeader& got, const ChunkHeader& want, int rank, int left) {
  if (got.magic != ChunkHeader::kMagic || got.version != ChunkHeader::kVersion) {
    Throw(ErrorCode::kDataLoss,
          "rank {}: received a chunk header from rank {} with magic {:#010x} version {}, "
          "expected {:#010x} version {}: the stream is out of sync",
          rank, left, got.magic, got.version, ChunkHeader::kMagic, ChunkHeader::kVersion);
  }
  auto mismatch = [&](const char* what, auto theirs, auto ours) {
    Throw(ErrorCode::kDataLoss,
          "rank {}: collective #{} disagrees with rank {}: rank {} has {} = {}, rank {} has {} = "
          "{}",
          rank, want.seq, left, left, what, theirs, rank, what, ours);
  };
  if (got.seq != want.seq) mismatch("collective sequence number", got.seq, want.seq);
  if (got.op != want.op || got.dtype != want.dtype) {
    mismatch("collective", CollectiveName(got.op, got.dtype), CollectiveName(want.op, want.dtype));
  }
  if (got.root != want.root) mismatch("broadcast root", got.root, want.root);
  if (got.count != want.count) mismatch("count (elements)", got.count, want.count);
  if (got.chunk_index != want.chunk_index) {
    mismatch("chunk index", got.chunk_index, want.chunk_index);
  }
  if (got.codec != want.codec) {
    mismatch(fmt::format("compression of chunk {}", want.chunk_index).c_str(),
             CodecName(static_cast<CodecKind>(got.codec)),
             CodecName(static_cast<CodecKind>(want.codec)));
  }
  if (got.payload_bytes != want.payload_bytes) {
    mismatch("chunk bytes", got.payload_bytes, want.payload_bytes);
  }
}

void Communicator::CheckHeader(const ChunkHeader& got, uint64_t seq, ReduceOp op,
                               uint64_t count, uint64_t chunk_index, CodecKind codec,
                               uint64_t payload_bytes, DataType dtype, uint32_t root) const {
  ChunkHeader want;
  want.op = static_cast<uint8_t>(op);
  want.dtype = static_cast<uint8_t>(dtype);
  want.root = root;
  want.codec = static_cast<uint8_t>(codec);
  want.seq = seq;
  want.count = count;
  want.chunk_index = chunk_index;
  want.payload_bytes = payload_bytes;
  CheckChunkHeader(got, want, rank_, left_[0]->peer_rank());
}

void Communicator::PostChunk(SendSlot& slot, uint64_t seq, ReduceOp op, uint64_t count,
                             uint64_t index, CodecKind codec, const void* payload,
                             uint64_t bytes, DataType dtype, uint32_t root) {
  slot.header = ChunkHeader{};
  slot.header.op = static_cast<uint8_t>(op);
  slot.header.dtype = static_cast<uint8_t>(dtype);
  slot.header.root = root;
  slot.header.codec = static_cast<uint8_t>(codec);
  slot.header.seq = seq;
  slot.header.count = count;
  slot.header.chunk_index = index;
  slot.header.payload_bytes = bytes;
  slot.header.sender_rank = static_cast<uint32_t>(rank_);
  slot.op.Set(&slot.header, sizeof(ChunkHeader), payload, bytes);
  next_send_index_ = index + 1;
  stats_.chunks_sent += 1;
  stats_.bytes_sent += sizeof(ChunkHeader) + bytes;
  stats_.payload_bytes += bytes;
  // Chunk i travels on stream i mod k.
  right_[index % right_.size()]->PostSend(slot.op);
}

void Communicator::PrepareErrorFeedback(uint64_t head) {
  if (residual_.size() == head) return;
  if (!residual_.empty()) {
    PSGD_LOG_WARN("rank {}: error feedback: the compressed size changed from {} to {} elements; "
                  "the residual restarts from zero",
                  rank_, residual_.size(), head);
  }
  residual_.assign(head, 0.0f);
}

void Communicator::WaitFor(transport::Op& o, WaitOn what, Deadline deadline,
                           const std::atomic<bool>* abort) {
  const bool from_left = what != WaitOn::kSend;
  waiting_on_ = (from_left ? left_ : right_)[0]->peer_rank();
  const std::string& text = what == WaitOn::kHeader    ? wait_header_
                            : what == WaitOn::kPayload ? wait_payload_
                                                       : wait_send_;
  transport_->Wait(o, deadline, text.c_str(), abort);
  waiting_on_ = -1;
}

void Communicator::ThrowIfAbortNotice(const ChunkHeader& header, size_t stream, uint64_t seq) {
  if (header.magic != ChunkHeader::kAbortMagic) return;
  const int left = left_[0]->peer_rank();
  const int origin = static_cast<int>(header.count);
  std::string report = "(no report)";
  // The text follows as its own receive of exactly payload_bytes: on the message transports (UCX,
  // ibverbs) each non-empty part of the sender's one send is one message, so this receive mirrors
  // it; an empty text was not sent at all, so nothing is received for it.
  if (header.payload_bytes == 0) {
    report.clear();
  } else if (header.payload_bytes <= ChunkHeader::kMaxAbortBytes) {
    abort_text_.assign(header.payload_bytes, '\0');
    abort_text_op_.Set(abort_text_.data(), abort_text_.size());
    left_[stream]->PostRecv(abort_text_op_);
    try {
      transport_->Wait(abort_text_op_, Deadline::After(1), "an abort notice's text");
      report = abort_text_;
    } catch (const Error&) {
      // The notice itself names the rank; its text is a courtesy.
    }
  }
  failure_origin_ = origin;
  failure_report_ = report;
  Throw(ErrorCode::kUnavailable,
        "rank {}: collective #{} aborted: rank {} failed or is gone (relayed by rank {}; first "
        "report: {})",
        rank_, seq, origin, left, report);
}

namespace {
// Bounds of the wait for an abort notice to go out. The lower bound lets a notice out even when
// the error was this collective's own deadline; the upper bound keeps a rank whose right
// neighbour is stalled from reporting its own error late. A 1 s fixed wait was too short on a
// loaded machine: the notice queues behind the rest of a 1 MiB chunk, and a right neighbour
// descheduled for over a second then blamed this (healthy) rank for closing mid-chunk.
constexpr double kNoticeMinS = 1;
constexpr double kNoticeMaxS = 5;

Deadline NoticeDeadline(Deadline collective) {
  return Deadline::After(std::max(kNoticeMinS, collective.remaining_s())).Min(kNoticeMaxS);
}
}  // namespace

void Communicator::NotifyAndClose(const Error& error, uint64_t seq, Deadline deadline) {
  failed_ = true;
  if (failure_origin_ < 0) {
    // The root cause is here: a neighbour that broke or stalled under one of our waits, or this
    // rank itself (a disagreement it detected, a non-finite value, a local abort).
    const bool peer_fault =
        (error.code() == ErrorCode::kUnavailable || error.code() == ErrorCode::kDeadlineExceeded) &&
        waiting_on_ >= 0;
    failure_origin_ = peer_fault ? waiting_on_ : rank_;
    failure_report_ = error.what();
  }
  if (!right_.empty() && right_[0]->peer_rank() != failure_origin_) {
    SendSlot& notice = abort_notice_;
    notice.header = ChunkHeader{};
    notice.header.magic = ChunkHeader::kAbortMagic;
    notice.header.seq = seq;
    notice.header.count = static_cast<uint64_t>(failure_origin_);
    notice.header.chunk_index = next_send_index_;
    abort_text_ = failure_report_.substr(0, ChunkHeader::kMaxAbortBytes);
    notice.header.payload_bytes = abort_text_.size();
    notice.header.sender_rank = static_cast<uint32_t>(rank_);
    notice.op.Set(&notice.header, sizeof(ChunkHeader), abort_text_.data(), abort_text_.size());
    try {
      right_[next_send_index_ % right_.size()]->PostSend(notice.op);
      transport_->Wait(notice.op, NoticeDeadline(deadline), "an abort notice to the right neighbour");
    } catch (const Error&) {
      // Best effort: the neighbour may be the one that is gone, or stalled.
    }
  }
  transport_->Close();
}

void Communicator::AllReduce(std::span<float> data, ReduceOp op, Deadline deadline,
                             const std::atomic<bool>* abort, const AllReduceOptions& call) {
  const uint64_t seq = seq_++;
  stats_ = WireStats{};
  PSGD_CHECK_LE(call.exact_tail, data.size());
  if (world_size_ == 1) return;  // averaging over one rank is the identity
  Guarded(seq, deadline, [&] { Run(data, op, deadline, abort, call, seq); });
}

void Communicator::ThrowIfFailedEarlier(uint64_t seq) const {
  if (!failed_) return;
  Error error(ErrorCode::kAborted,
              fmt::format("rank {}: collective #{}: this communicator failed earlier (rank {} "
                          "failed or is gone: {}); restart the job",
                          rank_, seq, failure_origin_, failure_report_));
  throw error.set_culprit(failure_origin_ == rank_ ? -1 : failure_origin_);
}

Error Communicator::Blamed(const Error& error, uint64_t seq, Deadline deadline) {
  NotifyAndClose(error, seq, deadline);
  Error blamed = error;
  blamed.set_culprit(failure_origin_ == rank_ ? -1 : failure_origin_);
  return blamed;
}

namespace {
// The ring's schedule (Patarasuk and Yuan's bandwidth-optimal ring): 2(N-1) steps to the right,
// step k < N-1 reduce-scatter step k, step k >= N-1 all-gather step k-(N-1). Ring position r
// sends block r-k and receives block r-1-k in reduce-scatter step k, sends r+1-j and receives
// r-j in all-gather step j (mod N). Each step's chunks are numbered on from the step before's,
// per direction, as they go on the wire.
class RingSchedule {
 public:
  RingSchedule(const RingPlan& plan, int ring_pos)
      : n_(plan.world_size()), r_(ring_pos), steps_(2 * (plan.world_size() - 1)) {
    if (steps_ + 1 > static_cast<int>(send_small_.size())) {
      send_big_.resize(steps_ + 1);
      recv_big_.resize(steps_ + 1);
      send_base_ = send_big_.data();
      recv_base_ = recv_big_.data();
    }
    send_base_[0] = recv_base_[0] = 0;
    for (int k = 0; k < steps_; ++k) {
      send_base_[k + 1] = send_base_[k] + plan.ChunksInBlock(SendBlock(k));
      recv_base_[k + 1] = recv_base_[k] + plan.ChunksInBlock(RecvBlock(k));
    }
  }
  RingSchedule(const RingSchedule&) = delete;
  RingSchedule& operator=(const RingSchedule&) = delete;

  int steps() const { return steps_; }
  bool ReduceScatter(int k) const { return k < n_ - 1; }
  int SendBlock(int k) const { return ReduceScatter(k) ? Mod(r_ - k) : Mod(r_ + 1 - (k - (n_ - 1))); }
  int RecvBlock(int k) const { return ReduceScatter(k) ? Mod(r_ - 1 - k) : Mod(r_ - (k - (n_ - 1))); }
  uint64_t SendIndex(int k, uint64_t chunk) const { return send_base_[k] + chunk; }
  uint64_t RecvIndex(int k, uint64_t chunk) const { return recv_base_[k] + chunk; }
  uint64_t sends() const { return send_base_[steps_]; }
  uint64_t recvs() const { return recv_base_[steps_]; }

 private:
  int Mod(int x) const { return ((x % n_) + n_) % n_; }

  int n_, r_, steps_;
  // Up to 32 ranks without a heap allocation: steady-state AllReduces allocate nothing.
  std::array<uint64_t, 64> send_small_{}, recv_small_{};
  std::vector<uint64_t> send_big_, recv_big_;
  uint64_t* send_base_ = send_small_.data();
  uint64_t* recv_base_ = recv_small_.data();
};
}  // namespace

void Communicator::Run(std::span<float> data, ReduceOp op, Deadline deadline,
                       const std::atomic<bool>* abort, const AllReduceOptions& options,
                       uint64_t seq) {
  if (data.empty()) return AgreeOnNothing(op, deadline, abort, seq);
  const int n = world_size_;
  const uint64_t chunk_bytes = options_.chunk_bytes != CommunicatorOptions::kAutoChunkBytes
                                   ? options_.chunk_bytes
                                   : AutoChunkBytes(data.size(), n);
  // Elements [0, head) travel encoded when this call compresses; the rest as float32.
  const uint64_t head = data.size() - options.exact_tail;
  const bool compress = codec_ != nullptr && options.compress && head > 0 &&
                        head * sizeof(float) >= options_.compression_min_bytes;
  const RingPlan plan(data.size(), n, chunk_bytes / sizeof(float), compress ? head : data.size());
  const RingSchedule ring(plan, ring_pos_);
  const RingCall call{data, seq, op, ring_pos_, n};
  RawWire raw(*this, call);
  CodedWire coded(*this, call, compress && options_.error_feedback);
  auto wire_of = [&](const Range& range) -> ChunkWire& {
    if (compress && range.offset < head) return coded;
    return raw;
  };
  stats_.compressed = compress;

  // The reusable buffers grow only when a call is larger than any before.
  if (send_slots_.size() < ring.sends()) send_slots_.resize(ring.sends());
  Reserve(scratch_, std::min<uint64_t>(chunk_bytes / sizeof(float), plan.Block(0).count),
          scratch_region_);
  if (compress) {
    // Arena bytes: the chunks this rank encodes (its reduce-scatter sends and its own block's
    // all-gather send; the other all-gather sends forward received bytes) and those it receives.
    uint64_t send_bytes = 0, recv_bytes = 0;
    auto coded_bytes = [&](int block) {
      uint64_t bytes = 0;
      for (uint64_t c = 0; c < plan.ChunksInBlock(block); ++c) {
        const Range range = plan.Chunk(block, c);
        if (range.offset < head) bytes += coded.WireBytes(range.count);
      }
      return bytes;
    };
    for (int k = 0; k < ring.steps(); ++k) {
      recv_bytes += coded_bytes(ring.RecvBlock(k));
      if (k <= n - 1) send_bytes += coded_bytes(ring.SendBlock(k));
    }
    Reserve(send_arena_, send_bytes, send_arena_region_);
    Reserve(recv_arena_, recv_bytes, recv_arena_region_);
    if (options_.error_feedback) PrepareErrorFeedback(head);
  }

  // Reduce-scatter step 0: this rank's own block goes out whole, right away.
  const int own = ring.SendBlock(0);
  for (uint64_t c = 0; c < plan.ChunksInBlock(own); ++c) {
    const Range range = plan.Chunk(own, c);
    wire_of(range).Send(ring.SendIndex(0, c), range, false);
  }
  // Headers are received one chunk ahead of payloads (two alternating buffers), so the next
  // header is already queued while a payload arrives.
  if (ring.recvs() > 0) PostHeaderReceive(0);
  for (int k = 0; k < ring.steps(); ++k) {
    const int block = ring.RecvBlock(k);
    for (uint64_t c = 0; c < plan.ChunksInBlock(block); ++c) {
      const Range range = plan.Chunk(block, c);
      ChunkWire& wire = wire_of(range);
      const uint64_t index = ring.RecvIndex(k, c);
      const std::span<float> values = data.subspan(range.offset, range.count);
      if (ring.ReduceScatter(k)) {
        const auto received = ReceiveChunk(call, wire, index, ring.recvs(), range, true,
                                           nullptr, deadline, abort);
        const bool owner = k == n - 2;  // the block's sum is complete here
        const bool average = owner && op == ReduceOp::kAverage;
        {
          timeline::Span span(timeline_, timeline::kComm, "reduce", static_cast<int64_t>(index));
          wire.Reduce(received, values);
          if (average) {
            const float divisor = static_cast<float>(n);
            for (float& v : values) v /= divisor;
          }
        }
        wire.Send(ring.SendIndex(k + 1, c), range, average);
        if (owner) wire.KeepOwned(values);
      } else {
        // In place, the all-gather chunk waits for the reduce-scatter send that last read
        // these values (by causality it is already done).
        SendSlot& reader = send_slots_[ring.SendIndex(k - (n - 1), c)];
        const auto received = ReceiveChunk(call, wire, index, ring.recvs(), range, false,
                                           &reader, deadline, abort);
        if (k + 1 < ring.steps()) wire.Forward(ring.SendIndex(k + 1, c), range, received);
        wire.Settle(index, received, values);
      }
    }
  }
  timeline::Span span(timeline_, timeline::kComm, "wait_sends");
  for (uint64_t i = 0; i < ring.sends(); ++i) {
    WaitFor(send_slots_[i].op, WaitOn::kSend, deadline, abort);
  }
}

void Communicator::AgreeOnNothing(ReduceOp op, Deadline deadline, const std::atomic<bool>* abort,
                                  uint64_t seq) {
  // Nothing to reduce, but neighbours must still agree: one header each way, so a rank that
  // calls with 0 elements while its neighbour has N fails by name instead of by timeout.
  if (send_slots_.empty()) send_slots_.resize(1);
  SendSlot& slot = send_slots_[0];
  PostChunk(slot, seq, op, 0, 0, CodecKind::kNone, nullptr, 0);
  PostHeaderReceive(0);
  WaitFor(recv_header_ops_[0], WaitOn::kHeader, deadline, abort);
  ThrowIfAbortNotice(recv_headers_[0], 0, seq);
  CheckHeader(recv_headers_[0], seq, op, 0, 0, CodecKind::kNone, 0);
  WaitFor(slot.op, WaitOn::kSend, deadline, abort);
}

std::span<const std::byte> Communicator::ReceiveChunk(const RingCall& call, ChunkWire& wire,
                                                      uint64_t index, uint64_t total,
                                                      const Range& range, bool reduce_scatter,
                                                      SendSlot* reader, Deadline deadline,
                                                      const std::atomic<bool>* abort) {
  timeline::Span span(timeline_, timeline::kComm, "wait", static_cast<int64_t>(index));
  const uint64_t bytes = wire.WireBytes(range.count);
  WaitFor(recv_header_ops_[index % 2], WaitOn::kHeader, deadline, abort);
  ThrowIfAbortNotice(recv_headers_[index % 2], index % left_.size(), call.seq);
  CheckHeader(recv_headers_[index % 2], call.seq, call.op, call.data.size(), index, wire.kind(),
              bytes);
  void* target = wire.Landing(range, reduce_scatter);
  if (target == nullptr) {
    target = call.data.data() + range.offset;
    WaitFor(reader->op, WaitOn::kSend, deadline, abort);
  }
  // Chunk i travels on stream i mod streams; per stream the order is header, payload, next
  // header, as the sender wrote them.
  recv_payload_op_.Set(target, bytes);
  left_[index % left_.size()]->PostRecv(recv_payload_op_);
  if (index + 1 < total) PostHeaderReceive(index + 1);
  WaitFor(recv_payload_op_, WaitOn::kPayload, deadline, abort);
  return {static_cast<const std::byte*>(target), bytes};
}

}  // namespace pipesgd::collective
