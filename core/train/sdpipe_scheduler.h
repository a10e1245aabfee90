// SDPipe's group scheduler (Miao et al., VLDB 2023, Sec. 4 and Appendix C; the algorithm as in the
// authors' ps-lite handler `ReduceStat::getPartner` and worker `PartialReduce`, see
// ../shared/docs/papers.md Sec. 2.5): which ranks average their parameters together this round.
//
// This class is the decision logic only: pure, single-threaded, with the clock injected (every
// call takes `now` in seconds on any monotonic clock), so tests script arrival times exactly.
// core/train/sdpipe_service.h puts it behind a socket in rank 0; one GroupScheduler per pipeline
// stage (the paper keeps one scheduler state per stage; core/train/pipeline_trainer.h).
//
// A round collects the ranks that report ready (Arrive) and closes (Decide) into one group, the
// sorted list of the ready ranks, which every member gets. Three kinds of round:
//   kNormal:   closes when all N ranks are ready, or when the wait window has passed since the
//              round's first arrival. The window adapts after each normal round (the authors'
//              worker-side rule, kept here centrally): a group smaller than min_group (a rank
//              ended up alone) multiplies it by grow (capped at window_max_s); otherwise it is
//              multiplied by shrink (floored at window_min_s).
//   kConnect:  the sync-graph guarantee. A disjoint set tracks the union of the groups since its
//              last reset; once (P-1)*N worker-updates have been counted since then, the next
//              round waits (no window) until the union including this round's arrivals connects
//              all N ranks, then resets. So over every window of about P rounds per rank the groups
//              connect everyone (Appendix C's assumption), and P = 1 makes every round a connect
//              round from an empty union, i.e. everyone: plain AllReduce averaging.
//              (The authors set the flag when a multiple of P*N is crossed and apply it to the next
//              round; counting from (P-1)*N makes P = 1 exactly AllReduce from the first round.)
//   kBarrier:  the epoch boundary: a full synchronization of all N ranks that ends exactly at
//              the next multiple of epoch_updates (= steps per epoch * N, like the authors'
//              sync_every = E*N) or at the job's total: armed when the worker-updates counted
//              since the start reach that boundary less N, the barrier's own N updates. A round
//              before it takes only the first arrivals that fit (the rest wait, and their steps
//              are their barrier updates), so train.max_steps holds exactly. The round then
//              waits for all N. Its decision has epoch_end set, and stop set when the total is
//              reached (the job ends there). With eval_updates, a barrier also ends at each
//              multiple of it (an evaluation point); every barrier's decision has evaluate set.
// Every arrival is one worker-update (a local SGD step), whether its rank syncs or not.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace pipesgd::train {

struct GroupSchedulerOptions {
  int world_size = 1;          // N >= 1
  int period = 10;             // P >= 1 (authors' default 10)
  double window_init_s = 1e-3;  // the authors' initial wait: 1 ms
  double window_min_s = 1e-5;   // 0.01 ms
  double window_max_s = 1e-2;   // 10 ms
  double window_grow = 2.0;     // >= 1
  double window_shrink = 0.9;   // in (0, 1]
  int min_group = 2;            // groups smaller than this count as "alone": in [1, N]
  // Worker-updates per epoch (steps per epoch * N) and in the whole job; 0 = no epoch barrier /
  // no end. REQUIRES: >= 0.
  int64_t epoch_updates = 0;
  int64_t total_updates = 0;
  // Worker-updates between evaluation barriers (train.eval_every_steps * N; 0 = none): a barrier
  // like the epoch's, but it does not end an epoch.
  int64_t eval_updates = 0;
};

enum class RoundKind { kNormal = 0, kConnect = 1, kBarrier = 2 };
const char* RoundKindName(RoundKind kind);  // "normal", "connect", "barrier"

struct GroupDecision {
  int64_t round = 0;         // 0, 1, ... in decision order
  RoundKind kind = RoundKind::kNormal;
  std::vector<int> members;  // sorted ascending, distinct, >= 1 rank
  double decided_at = 0;     // `now` of the Decide call that closed it
  bool epoch_end = false;    // an epoch's barrier: every rank is in the group
  bool evaluate = false;     // any barrier (the epoch's or an evaluation's)
  int epoch = 0;             // epochs completed, counting this barrier
  bool stop = false;         // the job's total was reached: the last round
  int64_t updates = 0;       // worker-updates counted so far, this round's included
};

class GroupScheduler {
 public:
  // Throws Error(kInvalidArgument) naming the option for values out of range.
  explicit GroupScheduler(const GroupSchedulerOptions& options);

  // `rank` is ready at time `now` (seconds). Throws Error(kInvalidArgument) for a rank outside
  // [0, N), a rank already waiting in this round, or any arrival after the stop decision.
  void Arrive(int rank, double now);

  // Closes the current round if its condition holds at `now` and returns its group; nullopt
  // while it must wait (or when no rank is waiting).
  std::optional<GroupDecision> Decide(double now);

  // When Decide should be called again if nothing arrives: the window's end for a normal round
  // with arrivals; +infinity otherwise (the round waits for arrivals, not for time).
  double wake_time() const;

  double window_s() const { return window_s_; }
  // The kind the current round has (or will have at its first arrival).
  RoundKind pending_kind() const;
  const std::vector<int>& waiting() const { return ready_; }
  int64_t updates() const { return updates_; }
  bool stopped() const { return stopped_; }
  int world_size() const { return options_.world_size; }

 private:
  int Find(std::vector<int>& parent, int x) const;
  // Whether the union since the last reset, plus the ranks waiting now, connects all N.
  bool ConnectedWithWaiting() const;
  void ResetUnion();
  // Worker-updates at which the current epoch ends (the job's total caps it).
  int64_t EpochBoundary() const;
  // Worker-updates at which the next barrier ends: the epoch's boundary or the next evaluation
  // point; int64 max when there is none.
  int64_t NextBarrier() const;
  // Worker-updates the rounds before the next barrier may still take (its N are kept back).
  int64_t Quota() const;
  void ArmBarrierIfDue();

  GroupSchedulerOptions options_;
  double window_s_;
  std::vector<int> ready_;        // arrival order
  std::vector<bool> is_ready_;
  double opened_at_ = 0;          // first arrival of the current round
  RoundKind kind_ = RoundKind::kNormal;  // of the current round, fixed at its first arrival
  std::vector<int> parent_;       // disjoint set over ranks (union since the last reset)
  int64_t updates_ = 0;
  int64_t updates_since_reset_ = 0;
  int64_t rounds_ = 0;
  int epoch_ = 0;
  bool barrier_armed_ = false;
  bool barrier_ends_epoch_ = false;  // the armed barrier is the epoch's, not only an evaluation's
  int64_t last_barrier_updates_ = 0;
  bool stopped_ = false;
};

}  // namespace pipesgd::train
