// The ring's two chunk wires (ring_wire.h): raw float32 and coded.
#include "core/collective/ring_wire.h"

#include <algorithm>

#include "core/base/error.h"
#include "core/base/timeline.h"

namespace pipesgd::collective {

// ---------------------------------------------------------------------------------------------
// RawWire

void* Communicator::RawWire::Landing(const Range& range, bool reduce_scatter) {
  // The reduce-scatter adds to this rank's own values, so its chunk lands beside them; the
  // all-gather's final values land where they belong.
  (void)range;
  return reduce_scatter ? static_cast<void*>(comm_.scratch_.data()) : nullptr;
}

void Communicator::RawWire::Send(uint64_t index, const Range& range, bool /*owner_average*/) {
  comm_.stats_.raw_payload_bytes += range.count * sizeof(float);
  timeline::Span span(comm_.timeline_, timeline::kComm, "send", static_cast<int64_t>(index));
  comm_.PostChunk(comm_.send_slots_[index], call_.seq, call_.op, call_.data.size(), index,
                  CodecKind::kNone, call_.data.data() + range.offset,
                  range.count * sizeof(float));
}

void Communicator::RawWire::Reduce(std::span<const std::byte> received, std::span<float> values) {
  const auto* src = reinterpret_cast<const float*>(received.data());
  for (size_t i = 0; i < values.size(); ++i) values[i] += src[i];
}

// ---------------------------------------------------------------------------------------------
// CodedWire

CodecKind Communicator::CodedWire::kind() const { return comm_.codec_->kind(); }

uint64_t Communicator::CodedWire::WireBytes(uint64_t count) const {
  return comm_.codec_->EncodedBytes(count);
}

void* Communicator::CodedWire::Landing(const Range& range, bool /*reduce_scatter*/) {
  std::byte* target = comm_.recv_arena_.data() + recv_used_;
  recv_used_ += WireBytes(range.count);
  return target;
}

void Communicator::CodedWire::Send(uint64_t index, const Range& range, bool owner_average) {
  comm_.stats_.raw_payload_bytes += range.count * sizeof(float);
  std::span<std::byte> bytes(comm_.send_arena_.data() + send_used_, WireBytes(range.count));
  send_used_ += bytes.size();
  // Error feedback at every encode (see AllReduce): this rank's residual of these elements goes
  // into the value it encodes, and what the encode loses becomes the new residual. The owner of
  // an averaged block keeps its residual in summed units like every other: e / N goes in,
  // N (x - decoded) comes out.
  const std::span<float> x = call_.data.subspan(range.offset, range.count);
  const std::span<float> e =
      feedback_ ? std::span<float>(comm_.residual_).subspan(range.offset, range.count)
                : std::span<float>();
  const float divisor = owner_average ? static_cast<float>(call_.world_size) : 1.0f;
  for (size_t i = 0; i < e.size(); ++i) x[i] += e[i] / divisor;
  try {
    timeline::Span span(comm_.timeline_, timeline::kComm, "encode", static_cast<int64_t>(index));
    // Distinct noise per (collective, rank, chunk) for stochastic rounding.
    const uint64_t stream = (call_.seq * 0x9E3779B97F4A7C15ull) ^
                            (static_cast<uint64_t>(call_.ring_pos) << 48) ^ index;
    comm_.stats_.saturated += comm_.codec_->Encode(x, bytes, stream).saturated;
  } catch (const Error& error) {
    throw error.Wrap(fmt::format("rank {}: compressing elements [{}, {}) of collective #{}",
                                 call_.ring_pos, range.offset, range.offset + range.count,
                                 call_.seq));
  }
  {
    timeline::Span span(comm_.timeline_, timeline::kComm, "send", static_cast<int64_t>(index));
    comm_.PostChunk(comm_.send_slots_[index], call_.seq, call_.op, call_.data.size(), index,
                    kind(), bytes.data(), bytes.size());
  }
  last_sent_ = bytes;
  if (feedback_) {
    // After the send is posted, off the ring's critical path. x ends as the decoded value: the
    // block owner keeps exactly that, and every other block is overwritten by the all-gather.
    timeline::Span span(comm_.timeline_, timeline::kComm, "feedback", static_cast<int64_t>(index));
    std::copy(x.begin(), x.end(), e.begin());
    comm_.codec_->Decode(bytes, x);
    for (size_t i = 0; i < e.size(); ++i) e[i] = (e[i] - x[i]) * divisor;
  }
}

void Communicator::CodedWire::Reduce(std::span<const std::byte> received,
                                     std::span<float> values) {
  comm_.codec_->DecodeAdd(received, values);
}

void Communicator::CodedWire::KeepOwned(std::span<float> values) {
  // With error feedback, Send has already decoded its bytes into the values.
  if (!feedback_) comm_.codec_->Decode(last_sent_, values);
}

void Communicator::CodedWire::Forward(uint64_t index, const Range& range,
                                      std::span<const std::byte> received) {
  // The owner's bytes as they are: no re-encoding, no drift; and before this rank decodes them
  // (which only reads them too), so the next hop's wait does not hold a decode per hop.
  comm_.stats_.raw_payload_bytes += range.count * sizeof(float);
  timeline::Span span(comm_.timeline_, timeline::kComm, "send", static_cast<int64_t>(index));
  comm_.PostChunk(comm_.send_slots_[index], call_.seq, call_.op, call_.data.size(), index, kind(),
                  received.data(), received.size());
}

void Communicator::CodedWire::Settle(uint64_t index, std::span<const std::byte> received,
                                     std::span<float> values) {
  timeline::Span span(comm_.timeline_, timeline::kComm, "decode", static_cast<int64_t>(index));
  comm_.codec_->Decode(received, values);
}

}  // namespace pipesgd::collective
