// The group scheduler as a service: rank 0 runs a GroupSchedulerService (a thread with its own
// socket); every rank, rank 0 included, asks it for its group through a GroupSchedulerClient
// after each local step. Messages: core/train/sdpipe.proto in transport/message_io.h frames.
// This is SDPipe's "centralized group scheduling, decentralized synchronization" split
// (Miao et al., VLDB 2023, Appendix Fig. 8c): only these small requests go to rank 0; the
// parameters move between the group's members (core/collective/group_allreduce.h).
//
// Failures (docs/errors.md): a rank whose connection closes before the job's last round (it
// died, was killed or lost the network) fails the job: every rank waiting on the scheduler, and
// every later request, gets an error naming that rank, at once rather than at a timeout. A
// request that breaks the protocol (wrong world size or version, a rank outside [0, N), a rank
// on two connections, a step that does not advance, a second request before its answer) also
// fails the job, naming the rank and the value. A connection that cannot prove the job token
// (transport/auth.h; the token itself never travels) is turned
// away (refused) and logged; the job goes on. Frames that are not pipesgd messages are logged
// and dropped.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/base/deadline.h"
#include "core/train/sdpipe_scheduler.h"

namespace pipesgd::train {

class GroupSchedulerService {
 public:
  // Listens on bind_host (numeric IP; "0.0.0.0" = every interface) at an ephemeral port and
  // starts the service thread. `stages` scheduler states, one per pipeline stage, each with
  // `options` (world_size = N, the replicas of a stage). A connection is bound to the stage and
  // rank of its first request: with pipeline stages, rank = the pipeline index within the
  // stage, and each (stage, rank) has its own client. Throws Error kIo if it cannot listen, kInvalidArgument for bad options.
  GroupSchedulerService(const GroupSchedulerOptions& options, int stages,
                        const std::string& bind_host, const std::string& token);
  // Stops the thread and closes every connection.
  ~GroupSchedulerService();
  GroupSchedulerService(const GroupSchedulerService&) = delete;
  GroupSchedulerService& operator=(const GroupSchedulerService&) = delete;

  uint16_t port() const { return port_; }
  // Every decision so far, per stage, in order (thread-safe copy): group sizes for the results.
  std::vector<GroupDecision> decisions(int stage = 0) const;
  // The error that failed the job, or empty.
  std::string error() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  uint16_t port_ = 0;
  std::thread thread_;
};

class GroupSchedulerClient {
 public:
  // Connects to the scheduler at host:port (retrying refused connections until the deadline).
  // Throws Error kDeadlineExceeded naming the address, kInvalidArgument if host does not resolve.
  GroupSchedulerClient(const std::string& host, uint16_t port, int rank, int world_size,
                       const std::string& token, Deadline deadline);
  ~GroupSchedulerClient();
  GroupSchedulerClient(const GroupSchedulerClient&) = delete;
  GroupSchedulerClient& operator=(const GroupSchedulerClient&) = delete;

  // Reports local step `step` (1, 2, ...) done and waits for this rank's group. Throws Error:
  // kAborted with the scheduler's error (the job failed: names the rank at fault),
  // kUnavailable if the scheduler went away, kDeadlineExceeded ("waited N s for the group").
  // `last`: this rank sends no more requests; closing after the answer does not fail the job
  // (a pipeline job's ranks end by step count rather than by the scheduler's stop round).
  // `leaving` (with `last`): the rank stopped early and took no step `step`; the answer, at
  // once and alone, only closes the connection as expected.
  GroupDecision Request(int stage, int64_t step, Deadline deadline, bool last = false,
                        bool leaving = false);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pipesgd::train
