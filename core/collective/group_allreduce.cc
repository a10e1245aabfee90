#include "core/collective/group_allreduce.h"

#include <algorithm>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::collective {

GroupCommunicator::GroupCommunicator(std::unique_ptr<transport::Transport> transport,
                                     int world_size, std::vector<std::string> addresses,
                                     const CommunicatorOptions& options)
    : transport_(std::move(transport)),
      world_size_(world_size),
      addresses_(std::move(addresses)),
      options_(options) {
  PSGD_CHECK_EQ(static_cast<int>(addresses_.size()), world_size);
  rank_ = transport_->rank();
  CheckChunkBytes(options.chunk_bytes);
  if (options.streams < 1 || options.streams > 64) {
    Throw(ErrorCode::kInvalidArgument, "streams = {}: expected an integer in [1, 64]",
          options.streams);
  }
}

GroupCommunicator::~GroupCommunicator() {
  // Connections first: after a failed collective a ring's ops may still be queued on them, and
  // closing a connection completes (touches) its queued ops, which the rings own. The rings'
  // destructors touch neither the connections nor their ops.
  connections_.clear();
  rings_.clear();
}

std::vector<int> GroupCommunicator::connected_peers() const {
  std::vector<int> peers;
  for (const auto& [peer, conns] : connections_) peers.push_back(peer);
  return peers;
}

void GroupCommunicator::EnsureConnected(const std::vector<int>& peers, Deadline deadline) {
  std::vector<std::pair<int, std::string>> missing;
  for (int peer : peers) {
    if (!connections_.count(peer) &&
        std::none_of(missing.begin(), missing.end(), [&](const auto& m) { return m.first == peer; })) {
      missing.push_back({peer, addresses_[peer]});
    }
  }
  if (missing.empty()) return;
  auto conns = transport_->Connect(missing, deadline, options_.streams);
  PSGD_CHECK_EQ(conns.size(), missing.size() * options_.streams);
  size_t i = 0;
  for (const auto& [peer, address] : missing) {
    auto& slot = connections_[peer];
    for (int s = 0; s < options_.streams; ++s) slot.push_back(std::move(conns[i++]));
  }
}

void GroupCommunicator::ConnectPeers(const std::vector<int>& peers, Deadline deadline) {
  for (int peer : peers) {
    if (peer < 0 || peer >= world_size_ || peer == rank_) {
      Throw(ErrorCode::kInvalidArgument,
            "rank {}: cannot connect to rank {} (expected another rank in [0, {}))", rank_, peer,
            world_size_);
    }
  }
  EnsureConnected(peers, deadline);
}

transport::Connection& GroupCommunicator::connection(int peer) {
  auto it = connections_.find(peer);
  if (it == connections_.end() || it->second.empty()) {
    Throw(ErrorCode::kInvalidArgument, "rank {}: no connection to rank {}", rank_, peer);
  }
  return *it->second.front();
}

void GroupCommunicator::AllReduce(std::span<float> data, ReduceOp op,
                                  const std::vector<int>& group, Deadline deadline,
                                  const std::atomic<bool>* abort, const AllReduceOptions& call) {
  bool valid = !group.empty();
  bool self = false;
  for (size_t i = 0; i < group.size() && valid; ++i) {
    valid = group[i] >= 0 && group[i] < world_size_ && (i == 0 || group[i] > group[i - 1]);
    self = self || group[i] == rank_;
  }
  if (!valid || !self) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: group [{}]: expected sorted, distinct ranks in [0, {}) that include rank {}",
          rank_, fmt::join(group, ", "), world_size_, rank_);
  }
  stats_ = WireStats{};
  const int n = static_cast<int>(group.size());
  if (n == 1) return;  // alone: W is the identity for this rank
  const int pos = static_cast<int>(std::find(group.begin(), group.end(), rank_) - group.begin());
  const int left = group[(pos + n - 1) % n];
  const int right = group[(pos + 1) % n];

  auto it = rings_.find(group);
  if (it == rings_.end()) {
    EnsureConnected(left == right ? std::vector<int>{left} : std::vector<int>{left, right},
                    deadline);
    std::vector<transport::Connection*> l, r;
    for (int s = 0; s < options_.streams; ++s) {
      l.push_back(connections_.at(left)[s].get());
      r.push_back(connections_.at(right)[s].get());
    }
    it = rings_
             .emplace(group, Communicator::CreateOnConnections(transport_, pos, n, std::move(l),
                                                               std::move(r), options_))
             .first;
  }
  Communicator& ring = *it->second;
  const bool feedback = options_.error_feedback && options_.codec.kind != CodecKind::kNone;
  if (feedback) ring.RestoreResidual(residual_);
  ring.AllReduce(data, op, deadline, abort, call);
  if (feedback) residual_.assign(ring.residual().begin(), ring.residual().end());
  stats_ = ring.last_wire_stats();
}

}  // namespace pipesgd::collective
