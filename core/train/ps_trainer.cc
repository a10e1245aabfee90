#include "core/train/ps_trainer.h"

#include <chrono>
#include <cmath>
#include <limits>
#include <thread>

#include "core/base/check.h"
#include "core/base/log.h"

namespace pipesgd::train {
namespace {

const char* KindName(uint32_t kind) {
  switch (kind) {
    case PsHeader::kPush: return "push";
    case PsHeader::kWeights: return "weights";
    case PsHeader::kSum: return "sum";
    case PsHeader::kSumResult: return "sum result";
    case PsHeader::kBye: return "bye";
  }
  return "unknown";
}

}  // namespace

void CheckPsHeader(const PsHeader& got, uint32_t kind, int64_t step, uint64_t count, int rank,
                   int peer) {
  if (got.magic != PsHeader::kMagic) {
    Throw(ErrorCode::kDataLoss,
          "rank {}: parameter-server message from rank {} has magic {:#x}, expected {:#x} (not a "
          "pipesgd peer, or the stream is out of step)",
          rank, peer, got.magic, PsHeader::kMagic);
  }
  if (got.kind != kind || got.step != step || got.count != count) {
    Throw(ErrorCode::kDataLoss,
          "rank {}: rank {} sent a {} message for step {} with {} values; rank {} expected a {} "
          "message for step {} with {} values",
          rank, peer, KindName(got.kind), got.step, got.count, rank, KindName(kind), step, count);
  }
}

// ---------------------------------------------------------------------------------------------
// Server

PsServer::PsServer(transport::Transport& transport, std::vector<transport::Connection*> workers,
                   Optimizer& optimizer, std::span<float> params, const PsOptions& options)
    : transport_(transport),
      optimizer_(optimizer),
      params_(params),
      options_(options),
      num_params_(params.size()),
      peers_(workers.size()),
      accumulate_(params.size() + 1) {
  if (workers.empty()) {
    Throw(ErrorCode::kInvalidArgument,
          "parameter server: no workers (world size 1); PS_SYNC and PS_ASYNC need at least 2 "
          "ranks: rank 0 serves, the others train");
  }
  for (size_t i = 0; i < workers.size(); ++i) {
    peers_[i].conn = workers[i];
    peers_[i].rank = workers[i]->peer_rank();
    peers_[i].inbox.resize(num_params_ + 1);
    peers_[i].outbox.resize(num_params_ + 1);
  }
}

void PsServer::PostHeader(Peer& p) {
  p.reading_payload = false;
  p.message_ready = false;
  p.header_op.Set(&p.recv_header, sizeof(PsHeader));
  p.conn->PostRecv(p.header_op);
}

bool PsServer::Progress(Peer& p) {
  if (p.bye || p.message_ready) return false;
  if (!p.reading_payload) {
    if (!p.header_op.done) return false;
    if (p.header_op.error) std::rethrow_exception(p.header_op.error);
    const PsHeader& h = p.recv_header;
    if (h.magic != PsHeader::kMagic) {
      CheckPsHeader(h, PsHeader::kPush, 0, 0, 0, p.rank);  // throws, naming the magic
    }
    const uint64_t limit = h.kind == PsHeader::kPush ? num_params_ + 1
                           : h.kind == PsHeader::kSum ? num_params_ + 1
                                                      : 0;
    if ((h.kind != PsHeader::kPush && h.kind != PsHeader::kSum && h.kind != PsHeader::kBye) ||
        (h.kind == PsHeader::kPush && h.count != num_params_ + 1) || h.count > limit) {
      Throw(ErrorCode::kDataLoss,
            "rank 0 (parameter server): rank {} sent a {} message (kind {}) with {} values; "
            "expected push ({} values), sum (at most {}) or bye (0)",
            p.rank, KindName(h.kind), h.kind, h.count, num_params_ + 1, num_params_ + 1, 0);
    }
    if (h.count == 0) {
      p.message_ready = true;
      return true;
    }
    p.payload_op.Set(p.inbox.data(), h.count * sizeof(float));
    p.conn->PostRecv(p.payload_op);
    p.reading_payload = true;
  }
  if (!p.payload_op.done) return false;
  if (p.payload_op.error) std::rethrow_exception(p.payload_op.error);
  p.message_ready = true;
  return true;
}

void PsServer::FlushSends(Peer& p) {
  if (!p.send_posted) return;
  transport_.Wait(p.send_op, Deadline::After(options_.timeout_s), "a reply to a worker");
  p.send_posted = false;
}

void PsServer::Send(Peer& p, uint32_t kind, int64_t step, std::span<const float> values) {
  FlushSends(p);  // the previous reply is delivered (the worker answered it), so outbox is free
  std::copy(values.begin(), values.end(), p.outbox.begin());
  p.send_header = PsHeader{};
  p.send_header.kind = kind;
  p.send_header.step = step;
  p.send_header.count = values.size();
  p.send_header.sender_rank = 0;
  p.send_op.Set(&p.send_header, sizeof(PsHeader), p.outbox.data(), values.size() * sizeof(float));
  p.conn->PostSend(p.send_op);
  p.send_posted = true;
}

void PsServer::SyncStepIfReady() {
  for (const Peer& p : peers_) {
    if (!p.message_ready || p.recv_header.kind != PsHeader::kPush) return;
  }
  const size_t w = peers_.size();
  if (timeline_) timeline_->SetStep(timeline::kCompute, sync_step_);
  timeline::Span reduce(timeline_, timeline::kCompute, "reduce");
  // Worker order 1..W, in float32 as the ring sums: the same values, reassociated.
  std::copy(peers_[0].inbox.begin(), peers_[0].inbox.end(), accumulate_.begin());
  for (size_t i = 1; i < w; ++i) {
    const float* g = peers_[i].inbox.data();
    for (size_t j = 0; j <= num_params_; ++j) accumulate_[j] += g[j];
  }
  const float divisor = static_cast<float>(w);
  for (float& v : accumulate_) v /= divisor;
  if (!std::isfinite(accumulate_[num_params_])) {
    Throw(ErrorCode::kNumerical,
          "rank 0 (parameter server): step {}: the loss averaged over workers is {}: training "
          "diverged (try a lower learning rate or momentum)",
          sync_step_, accumulate_[num_params_]);
  }
  reduce.End();
  {
    timeline::Span update(timeline_, timeline::kCompute, "update");
    optimizer_.Apply(params_, std::span<const float>(accumulate_.data(), num_params_));
  }
  ++updates_;
  std::copy(params_.begin(), params_.end(), accumulate_.begin());  // loss stays at the end
  for (Peer& p : peers_) {
    Send(p, PsHeader::kWeights, sync_step_, accumulate_);
    PostHeader(p);
  }
  ++sync_step_;
}

void PsServer::SumIfReady() {
  const uint64_t count = peers_[0].recv_header.count;
  for (const Peer& p : peers_) {
    if (!p.message_ready || p.recv_header.kind != PsHeader::kSum) return;
    if (p.recv_header.count != count || p.recv_header.step != sum_calls_) {
      Throw(ErrorCode::kDataLoss,
            "rank 0 (parameter server): sum #{}: rank {} sent {} values for sum #{}, rank {} "
            "sent {}",
            sum_calls_, p.rank, p.recv_header.count, p.recv_header.step, peers_[0].rank, count);
    }
  }
  std::vector<float> sum(peers_[0].inbox.begin(), peers_[0].inbox.begin() + count);
  for (size_t i = 1; i < peers_.size(); ++i) {
    for (uint64_t j = 0; j < count; ++j) sum[j] += peers_[i].inbox[j];
  }
  for (Peer& p : peers_) {
    Send(p, PsHeader::kSumResult, sum_calls_, sum);
    PostHeader(p);
  }
  ++sum_calls_;
}

void PsServer::Handle(Peer& p) {
  const PsHeader& h = p.recv_header;
  switch (h.kind) {
    case PsHeader::kBye:
      p.bye = true;
      return;
    case PsHeader::kSum:
      SumIfReady();  // replies (and re-posts) once every worker's vector is in
      return;
    case PsHeader::kPush:
      break;
  }
  if (options_.mode == PsMode::kSync) {
    if (h.step != sync_step_) {
      CheckPsHeader(h, PsHeader::kPush, sync_step_, num_params_ + 1, 0, p.rank);
    }
    SyncStepIfReady();
    return;
  }
  // Asynchronous: apply this worker's gradient alone, scaled by 1/W, and answer it.
  const float loss = p.inbox[num_params_];
  if (!std::isfinite(loss)) {
    Throw(ErrorCode::kNumerical,
          "rank 0 (parameter server): rank {} step {}: its loss is {}: training diverged (try a "
          "lower learning rate or momentum)",
          p.rank, h.step, loss);
  }
  max_staleness_ = std::max(max_staleness_, updates_ - p.pulled_at);
  if (timeline_) timeline_->SetStep(timeline::kCompute, h.step);
  timeline::Span update(timeline_, timeline::kCompute, "update");
  const float scale = 1.0f / static_cast<float>(peers_.size());
  for (size_t j = 0; j < num_params_; ++j) accumulate_[j] = p.inbox[j] * scale;
  optimizer_.Apply(params_, std::span<const float>(accumulate_.data(), num_params_));
  update.End();
  ++updates_;
  std::copy(params_.begin(), params_.end(), accumulate_.begin());
  accumulate_[num_params_] = loss;
  Send(p, PsHeader::kWeights, h.step, accumulate_);
  p.pulled_at = updates_;
  PostHeader(p);
}

void PsServer::Run() {
  try {
    Serve();
  } catch (...) {
    // Its receives are posted into peers_, which die with this server while the connections
    // live on: fail them now (a connection that closes later wrote into freed ops).
    transport_.Close();
    throw;
  }
}

void PsServer::Serve() {
  for (Peer& p : peers_) PostHeader(p);
  auto last_message = Deadline::Clock::now();
  const auto timeout = std::chrono::duration_cast<Deadline::Clock::duration>(
      std::chrono::duration<double>(options_.timeout_s));
  size_t start = 0;  // rotates, so no worker is always served first
  int idle = 0;
  auto done = [&] {
    for (const Peer& p : peers_) {
      if (!p.bye) return false;
    }
    return true;
  };
  while (!done()) {
    bool progressed = false;
    for (size_t i = 0; i < peers_.size(); ++i) {
      Peer& p = peers_[(start + i) % peers_.size()];
      if (Progress(p)) {
        Handle(p);
        progressed = true;
      }
    }
    start = (start + 1) % peers_.size();
    if (progressed) {
      last_message = Deadline::Clock::now();
      idle = 0;
      continue;
    }
    transport_.Poll();
    // Nothing to do: spin briefly (a message is often microseconds away), then nap, so an
    // idle server does not take a core from the workers that share its machine.
    if (++idle > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (Deadline::Clock::now() - last_message > timeout) {
      std::string waiting;
      for (const Peer& p : peers_) {
        if (!p.bye && !p.message_ready) waiting += fmt::format(" {}", p.rank);
      }
      Throw(ErrorCode::kDeadlineExceeded,
            "rank 0 (parameter server): no message for {:.0f} s; waiting for rank(s){}",
            options_.timeout_s, waiting);
    }
  }
  for (Peer& p : peers_) FlushSends(p);
}

// ---------------------------------------------------------------------------------------------
// Worker

PsWorker::PsWorker(transport::Transport& transport, transport::Connection& server,
                   Objective& objective, std::span<float> params, int rank,
                   const PsOptions& options)
    : transport_(transport),
      server_(server),
      objective_(objective),
      params_(params),
      rank_(rank),
      options_(options),
      buffer_(2 * (params.size() + 1)) {
  if (params.size() != objective.num_params()) {
    Throw(ErrorCode::kInvalidArgument, "PS worker got {} parameters, the objective has {}",
          params.size(), objective.num_params());
  }
}

void PsWorker::Exchange(uint32_t kind, int64_t step, std::span<const float> out,
                        uint32_t reply_kind, std::span<float> in) {
  PsHeader send_header;
  send_header.kind = kind;
  send_header.step = step;
  send_header.count = out.size();
  send_header.sender_rank = static_cast<uint32_t>(rank_);
  PsHeader recv_header;
  transport::Op send, recv_header_op, recv_payload;
  // Receives first, so the reply lands as soon as it comes.
  recv_header_op.Set(&recv_header, sizeof(PsHeader));
  server_.PostRecv(recv_header_op);
  if (!in.empty()) {
    recv_payload.Set(in.data(), in.size() * sizeof(float));
    server_.PostRecv(recv_payload);
  }
  send.Set(&send_header, sizeof(PsHeader), out.data(), out.size() * sizeof(float));
  const auto deadline = Deadline::After(options_.timeout_s);
  try {
    {
      timeline::Span span(timeline_, timeline::kCompute, "push");
      server_.PostSend(send);
      transport_.Wait(send, deadline, "a message to the parameter server (rank 0)");
    }
    if (kind == PsHeader::kPush) push_bytes_ += sizeof(PsHeader) + out.size() * sizeof(float);
    timeline::Span span(timeline_, timeline::kCompute, "pull");
    transport_.Wait(recv_header_op, deadline, "the parameter server's reply (rank 0)");
    CheckPsHeader(recv_header, reply_kind, step, in.size(), rank_, 0);
    if (!in.empty()) {
      transport_.Wait(recv_payload, deadline, "the parameter server's reply (rank 0)");
    }
  } catch (...) {
    // The ops are this frame's: fail them before they go (as PsServer::Run).
    transport_.Close();
    throw;
  }
}

void PsWorker::Step() {
  const int64_t t = steps_;
  const size_t n = params_.size();
  if (timeline_) timeline_->SetStep(timeline::kCompute, t);
  std::span<float> out(buffer_.data(), n + 1);
  std::span<float> in(buffer_.data() + n + 1, n + 1);
  const float loss = objective_.ComputeGradient(t, params_, out.first(n));
  out[n] = loss;
  if (!std::isfinite(loss)) {
    Throw(ErrorCode::kNumerical,
          "rank {}: step {}: the loss is {}: training diverged (try a lower learning rate or "
          "momentum)",
          rank_, t, loss);
  }
  Exchange(PsHeader::kPush, t, out, PsHeader::kWeights, in);
  {
    timeline::Span span(timeline_, timeline::kCompute, "update");
    std::copy(in.begin(), in.begin() + n, params_.begin());
  }
  losses_.push_back(in[n]);
  steps_ = t + 1;
}

float PsWorker::StepLoss(int64_t step) const {
  if (step < 0 || step >= static_cast<int64_t>(losses_.size())) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  return losses_[step];
}

void PsWorker::SumOverWorkers(std::span<float> data) {
  if (data.size() > params_.size() + 1) {
    Throw(ErrorCode::kInvalidArgument, "PS sum of {} values: at most {} (the model's size + 1)",
          data.size(), params_.size() + 1);
  }
  std::vector<float> out(data.begin(), data.end());
  Exchange(PsHeader::kSum, sums_, out, PsHeader::kSumResult, data);
  ++sums_;
}

void PsWorker::Bye() {
  PsHeader header;
  header.kind = PsHeader::kBye;
  header.sender_rank = static_cast<uint32_t>(rank_);
  transport::Op send;
  send.Set(&header, sizeof(PsHeader));
  server_.PostSend(send);
  try {
    transport_.Wait(send, Deadline::After(options_.timeout_s), "bye to the parameter server");
  } catch (...) {
    transport_.Close();  // as in Exchange: `send` is this frame's
    throw;
  }
}

}  // namespace pipesgd::train
