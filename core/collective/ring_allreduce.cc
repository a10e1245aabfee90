#include "core/collective/ring_allreduce.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/log.h"

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

// ---------------------------------------------------------------------------------------------
// Communicator

std::unique_ptr<Communicator> Communicator::Create(
    std::unique_ptr<transport::Transport> transport, int world_size,
    const std::vector<std::string>& addresses, const CommunicatorOptions& options,
    Deadline deadline) {
  PSGD_CHECK_EQ(static_cast<int>(addresses.size()), world_size);
  if (options.chunk_bytes % sizeof(float) != 0) {
    Throw(ErrorCode::kInvalidArgument,
          "chunk_bytes = {}: expected a positive multiple of 4, or 0 (auto)", options.chunk_bytes);
  }
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
  if (options.chunk_bytes % sizeof(float) != 0) {
    Throw(ErrorCode::kInvalidArgument,
          "chunk_bytes = {}: expected a positive multiple of 4, or 0 (auto)", options.chunk_bytes);
  }
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
  if (chunk_bytes % sizeof(float) != 0) {
    Throw(ErrorCode::kInvalidArgument,
          "chunk_bytes = {}: expected a positive multiple of 4, or 0 (auto)", chunk_bytes);
  }
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

void Communicator::WaitFor(transport::Op& o, int peer, Deadline deadline, const char* what,
                           const std::atomic<bool>* abort) {
  waiting_on_ = peer;
  transport_->Wait(o, deadline, what, abort);
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

void Communicator::Run(std::span<float> data, ReduceOp op, Deadline deadline,
                       const std::atomic<bool>* abort, const AllReduceOptions& call,
                       uint64_t seq) {
  const int n = world_size_;
  if (data.empty()) {
    // Nothing to reduce, but neighbours must still agree: one header each way, so a rank that
    // calls with 0 elements while its neighbour has N fails by name instead of by timeout.
    if (send_slots_.empty()) send_slots_.resize(1);
    SendSlot& slot = send_slots_[0];
    PostChunk(slot, seq, op, 0, 0, CodecKind::kNone, nullptr, 0);
    ChunkHeader& header = recv_headers_[0];
    transport::Op& recv = recv_header_ops_[0];
    recv.Set(&header, sizeof(ChunkHeader));
    left_[0]->PostRecv(recv);
    WaitFor(recv, left_[0]->peer_rank(), deadline, wait_header_.c_str(), abort);
    ThrowIfAbortNotice(header, 0, seq);
    CheckHeader(header, seq, op, 0, 0, CodecKind::kNone, 0);
    WaitFor(slot.op, right_[0]->peer_rank(), deadline, wait_send_.c_str(), abort);
    return;
  }

  const int r = ring_pos_;
  const uint64_t chunk_bytes = options_.chunk_bytes != CommunicatorOptions::kAutoChunkBytes
                                   ? options_.chunk_bytes
                                   : AutoChunkBytes(data.size(), n);
  // Elements [0, head) travel encoded when this call compresses; the rest as float32.
  const uint64_t head = data.size() - call.exact_tail;
  const bool compress = codec_ != nullptr && call.compress && head > 0 &&
                        head * sizeof(float) >= options_.compression_min_bytes;
  const RingPlan plan(data.size(), n, chunk_bytes / sizeof(float),
                      compress ? head : data.size());
  const CodecKind kind = compress ? codec_->kind() : CodecKind::kNone;
  stats_.compressed = compress;
  auto coded = [&](const Range& range) { return compress && range.offset < head; };
  auto wire_bytes = [&](const Range& range) -> uint64_t {
    return coded(range) ? codec_->EncodedBytes(range.count) : range.count * sizeof(float);
  };
  auto mod = [n](int x) { return ((x % n) + n) % n; };
  // The stream to the right is 2(N-1) ring steps; step k < N-1 is reduce-scatter step k,
  // step k >= N-1 all-gather step k-(N-1). Which block each step carries, as sent by this rank
  // and as received from the left neighbour (rank r-1):
  const int steps = 2 * (n - 1);
  auto send_block = [&](int k) { return k < n - 1 ? mod(r - k) : mod(r + 1 - (k - (n - 1))); };
  auto recv_block = [&](int k) { return k < n - 1 ? mod(r - 1 - k) : mod(r - (k - (n - 1))); };
  // Index of a step's first chunk within each stream.
  std::array<uint64_t, 64> send_base_small{}, recv_base_small{};
  std::vector<uint64_t> send_base_big, recv_base_big;
  uint64_t* send_base = send_base_small.data();
  uint64_t* recv_base = recv_base_small.data();
  if (steps + 1 > 64) {
    send_base_big.resize(steps + 1);
    recv_base_big.resize(steps + 1);
    send_base = send_base_big.data();
    recv_base = recv_base_big.data();
  }
  send_base[0] = recv_base[0] = 0;
  // Encoded bytes: the chunks this rank encodes (reduce-scatter sends and the owned block's
  // all-gather send; all-gather forwards resend received bytes) and the chunks it receives.
  uint64_t send_arena_bytes = 0, recv_arena_bytes = 0;
  for (int k = 0; k < steps; ++k) {
    send_base[k + 1] = send_base[k] + plan.ChunksInBlock(send_block(k));
    recv_base[k + 1] = recv_base[k] + plan.ChunksInBlock(recv_block(k));
    if (!compress) continue;
    for (uint64_t c = 0; c < plan.ChunksInBlock(recv_block(k)); ++c) {
      const Range range = plan.Chunk(recv_block(k), c);
      if (coded(range)) recv_arena_bytes += wire_bytes(range);
    }
    if (k > n - 1) continue;
    for (uint64_t c = 0; c < plan.ChunksInBlock(send_block(k)); ++c) {
      const Range range = plan.Chunk(send_block(k), c);
      if (coded(range)) send_arena_bytes += wire_bytes(range);
    }
  }
  const uint64_t total_sends = send_base[steps];
  const uint64_t total_recvs = recv_base[steps];

  // Grow the reusable buffers (only when a call is larger than any before).
  if (send_slots_.size() < total_sends) send_slots_.resize(total_sends);
  const uint64_t max_chunk = std::min<uint64_t>(chunk_bytes / sizeof(float), plan.Block(0).count);
  Reserve(scratch_, max_chunk, scratch_region_);
  const bool feedback = compress && options_.error_feedback;
  if (compress) {
    Reserve(send_arena_, send_arena_bytes, send_arena_region_);
    Reserve(recv_arena_, recv_arena_bytes, recv_arena_region_);
    if (feedback) PrepareErrorFeedback(head);
  }

  uint64_t send_arena_used = 0, recv_arena_used = 0;
  // Sends chunk `index`, data[range], as float32 or encoded into its own send-arena region.
  // `owner_average`: the owner's encode of an averaged block, whose residual is kept in summed
  // units like every other (see AllReduce): e / N goes in, N (x - decoded) comes out.
  auto post_send = [&](uint64_t index, const Range& range, bool owner_average = false) {
    const float* values = data.data() + range.offset;
    stats_.raw_payload_bytes += range.count * sizeof(float);
    if (!coded(range)) {
      timeline::Span span(timeline_, timeline::kComm, "send", static_cast<int64_t>(index));
      PostChunk(send_slots_[index], seq, op, data.size(), index, CodecKind::kNone, values,
                range.count * sizeof(float));
      return std::span<const std::byte>();
    }
    std::span<std::byte> bytes(send_arena_.data() + send_arena_used, wire_bytes(range));
    send_arena_used += bytes.size();
    // Error feedback at every encode (see AllReduce): this rank's residual of these elements
    // goes into the value it encodes, and what the encode loses becomes the new residual.
    const std::span<float> x(data.data() + range.offset, range.count);
    const std::span<float> e =
        feedback ? std::span<float>(residual_.data() + range.offset, range.count)
                 : std::span<float>();
    const float divisor = owner_average ? static_cast<float>(n) : 1.0f;
    for (uint64_t i = 0; i < e.size(); ++i) x[i] += e[i] / divisor;
    try {
      timeline::Span span(timeline_, timeline::kComm, "encode", static_cast<int64_t>(index));
      // Distinct noise per (collective, rank, chunk) for stochastic rounding.
      const uint64_t stream = (seq * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(r) << 48) ^ index;
      stats_.saturated += codec_->Encode(x, bytes, stream).saturated;
    } catch (const Error& error) {
      throw error.Wrap(fmt::format("rank {}: compressing elements [{}, {}) of collective #{}", r,
                                   range.offset, range.offset + range.count, seq));
    }
    {
      timeline::Span span(timeline_, timeline::kComm, "send", static_cast<int64_t>(index));
      PostChunk(send_slots_[index], seq, op, data.size(), index, kind, bytes.data(), bytes.size());
    }
    if (feedback) {
      // After the send is posted, off the ring's critical path. x ends as the decoded value:
      // the block owner keeps exactly that, and every other block is overwritten by the
      // all-gather.
      timeline::Span span(timeline_, timeline::kComm, "feedback", static_cast<int64_t>(index));
      std::copy(x.begin(), x.end(), e.begin());
      codec_->Decode(bytes, x);
      for (uint64_t i = 0; i < e.size(); ++i) e[i] = (e[i] - x[i]) * divisor;
    }
    return std::span<const std::byte>(bytes);
  };
  const int left_rank = left_[0]->peer_rank();
  const int right_rank = right_[0]->peer_rank();
  auto wait = [&](transport::Op& o, const char* what) {
    WaitFor(o, what == wait_send_.c_str() ? right_rank : left_rank, deadline, what, abort);
  };

  // Reduce-scatter step 0: this rank's own block goes out whole, right away.
  {
    const int b = send_block(0);
    for (uint64_t c = 0; c < plan.ChunksInBlock(b); ++c) post_send(c, plan.Chunk(b, c));
  }

  // Headers are received one chunk ahead of payloads, into two alternating buffers, so the
  // next header is already queued while a payload arrives.
  // Members, not locals: after an error the ops are still queued on their connections until
  // NotifyAndClose closes them, which happens after this frame unwinds.
  ChunkHeader* headers = recv_headers_;
  transport::Op* header_ops = recv_header_ops_;
  transport::Op& payload_op = recv_payload_op_;
  if (total_recvs > 0) {
    header_ops[0].Set(&headers[0], sizeof(ChunkHeader));
    left_[0]->PostRecv(header_ops[0]);
  }
  for (int k = 0; k < steps; ++k) {
    const int b = recv_block(k);
    const bool reduce_scatter = k < n - 1;
    for (uint64_t c = 0; c < plan.ChunksInBlock(b); ++c) {
      const uint64_t index = recv_base[k] + c;
      const Range range = plan.Chunk(b, c);
      const bool encoded = coded(range);
      const uint64_t bytes = wire_bytes(range);
      timeline::Span wait_span(timeline_, timeline::kComm, "wait", static_cast<int64_t>(index));
      wait(header_ops[index % 2], wait_header_.c_str());
      ThrowIfAbortNotice(headers[index % 2], index % left_.size(), seq);
      CheckHeader(headers[index % 2], seq, op, data.size(), index,
                  encoded ? kind : CodecKind::kNone, bytes);

      float* values = data.data() + range.offset;
      void* target = scratch_.data();
      if (encoded) {
        target = recv_arena_.data() + recv_arena_used;
        recv_arena_used += bytes;
      } else if (!reduce_scatter) {
        // All-gather writes the final values in place; the reduce-scatter send that last read
        // this chunk (step k-(N-1)) must be off our hands first. By causality it already is.
        target = values;
        wait(send_slots_[send_base[k - (n - 1)] + c].op, wait_send_.c_str());
      }
      // Chunk i travels on stream i mod k; per stream the order is header, payload, next
      // header, as the sender wrote them.
      const size_t streams = left_.size();
      payload_op.Set(target, bytes);
      left_[index % streams]->PostRecv(payload_op);
      if (index + 1 < total_recvs) {
        header_ops[(index + 1) % 2].Set(&headers[(index + 1) % 2], sizeof(ChunkHeader));
        left_[(index + 1) % streams]->PostRecv(header_ops[(index + 1) % 2]);
      }
      wait(payload_op, wait_payload_.c_str());
      wait_span.End();
      const std::span<const std::byte> received(static_cast<const std::byte*>(target), bytes);

      if (reduce_scatter) {
        {
          timeline::Span span(timeline_, timeline::kComm, "reduce", static_cast<int64_t>(index));
          if (encoded) {
            codec_->DecodeAdd(received, {values, range.count});
          } else {
            const float* src = scratch_.data();
            for (uint64_t i = 0; i < range.count; ++i) values[i] += src[i];
          }
          if (k == n - 2 && op == ReduceOp::kAverage) {
            const float divisor = static_cast<float>(n);
            for (uint64_t i = 0; i < range.count; ++i) values[i] /= divisor;
          }
        }
        if (k + 1 < steps) {
          std::span<const std::byte> sent =
              post_send(send_base[k + 1] + c, range, k == n - 2 && op == ReduceOp::kAverage);
          // The owner keeps what everyone else will decode, so every replica is the same
          // (error feedback has already decoded it in place).
          if (k == n - 2 && encoded && !feedback) codec_->Decode(sent, {values, range.count});
        }
      } else {
        if (k + 1 < steps) {
          const uint64_t next = send_base[k + 1] + c;
          if (encoded) {
            // Forward the owner's bytes as they are: no re-encoding, no drift; and before this
            // rank decodes them, which only reads them too, so that the next hop's wait does not
            // hold a decode per hop (a whole block's at one chunk per block).
            stats_.raw_payload_bytes += range.count * sizeof(float);
            timeline::Span span(timeline_, timeline::kComm, "send", static_cast<int64_t>(next));
            PostChunk(send_slots_[next], seq, op, data.size(), next, kind, received.data(),
                      received.size());
          } else {
            post_send(next, range);
          }
        }
        if (encoded) {
          timeline::Span span(timeline_, timeline::kComm, "decode", static_cast<int64_t>(index));
          codec_->Decode(received, {values, range.count});
        }
      }
    }
  }
  timeline::Span span(timeline_, timeline::kComm, "wait_sends");
  for (uint64_t i = 0; i < total_sends; ++i) {
    wait(send_slots_[i].op, wait_send_.c_str());
  }
}

}  // namespace pipesgd::collective
