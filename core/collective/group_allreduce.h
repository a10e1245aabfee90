// Ring AllReduce over a subset of the job's ranks: SDPipe's group-wise averaging (Miao et al.,
// VLDB 2023, Appendix C: X[k+1] = (X[k] - lr*G[k]) W[k], W averaging within the group S_k and the
// identity elsewhere). The decentralized half of SDPipe: the group's members run the chunked
// ring of ring_allreduce.h among themselves, sorted by rank (member i sends to member i+1 mod
// |S|); ranks outside the group are not involved and their data is untouched.
//
// Connections between two ranks are made the first time they are ring neighbours in some group
// (both sides learn the group at the same time, so both call Transport::Connect together) and
// kept for the rest of the job; the ring state per distinct group (its collective sequence
// number, codec) is cached like the authors' NCCL sub-communicators. With error feedback the
// residual belongs to the rank, not to the group: it is carried from group to group.
//
// Thread-compatible: one thread calls it at a time. Tested with the TCP transport (which
// accepts repeated Connect calls); UCX and ibverbs are untested here.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/collective/ring_allreduce.h"

namespace pipesgd::collective {

class GroupCommunicator {
 public:
  // `addresses[r]` = rank r's Transport::LocalAddress() (from the rendezvous). Connects nothing
  // yet. Throws Error(kInvalidArgument) for bad options.
  GroupCommunicator(std::unique_ptr<transport::Transport> transport, int world_size,
                    std::vector<std::string> addresses, const CommunicatorOptions& options);
  ~GroupCommunicator();
  GroupCommunicator(const GroupCommunicator&) = delete;
  GroupCommunicator& operator=(const GroupCommunicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  transport::Transport& transport() { return *transport_; }

  // Reduces `data` in place over the ranks of `group` (sum, or the average over |group|).
  // `group`: sorted ascending, distinct ranks in [0, world_size) that include rank(); every
  // member must call with the same group, count, op and options (as with
  // Communicator::AllReduce). A group of one is the identity (no communication). Connects to the
  // new ring neighbours first (within `deadline`). Throws Error kInvalidArgument for a bad group
  // (naming it), and what Transport::Connect and Communicator::AllReduce throw; after an error
  // the communicator (and its transport) is unusable.
  void AllReduce(std::span<float> data, ReduceOp op, const std::vector<int>& group,
                 Deadline deadline, const std::atomic<bool>* abort = nullptr,
                 const AllReduceOptions& call = {});

  // Connects now, in one Transport::Connect call, to every rank in `peers` that has no
  // connection yet. A caller that needs connections to several kinds of peers (the pipeline's
  // neighbour stages and the stage's replicas) makes them all at once this way: ranks that
  // connect to different peer sets at different times could otherwise dial a peer that is busy
  // accepting someone else. Every listed peer must call it, listing this rank, at about the same
  // time. Throws Error kInvalidArgument for a peer outside [0, world_size) or this rank, and what
  // Transport::Connect throws.
  void ConnectPeers(const std::vector<int>& peers, Deadline deadline);
  // Stream 0 of the connection to `peer` (made by ConnectPeers or a ring). A caller may send its
  // own messages on the connection to a peer that is never in a group with this rank (the
  // pipeline's stage links); Error(kInvalidArgument) if there is no connection to `peer`.
  transport::Connection& connection(int peer);

  // The ranks this rank has a connection to (made on first use), ascending.
  std::vector<int> connected_peers() const;
  // Distinct groups this rank has reduced in so far (cached rings).
  size_t cached_groups() const { return rings_.size(); }
  const WireStats& last_wire_stats() const { return stats_; }
  // This rank's error-feedback residual, in summed units (Communicator::AllReduce), carried
  // from group to group; empty before the first compressed call with error feedback.
  std::span<const float> residual() const { return residual_; }

 private:
  // Connections to `peer` (one per stream), connecting to every peer in `peers` that has none.
  void EnsureConnected(const std::vector<int>& peers, Deadline deadline);

  std::shared_ptr<transport::Transport> transport_;
  int rank_ = 0;
  int world_size_ = 1;
  std::vector<std::string> addresses_;
  CommunicatorOptions options_;
  std::map<int, std::vector<std::unique_ptr<transport::Connection>>> connections_;
  std::map<std::vector<int>, std::unique_ptr<Communicator>> rings_;
  std::vector<float> residual_;
  WireStats stats_;
};

}  // namespace pipesgd::collective
