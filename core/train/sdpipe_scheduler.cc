#include "core/train/sdpipe_scheduler.h"

#include <algorithm>
#include <cmath>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::train {

const char* RoundKindName(RoundKind kind) {
  switch (kind) {
    case RoundKind::kNormal: return "normal";
    case RoundKind::kConnect: return "connect";
    case RoundKind::kBarrier: return "barrier";
  }
  return "unknown";
}

GroupScheduler::GroupScheduler(const GroupSchedulerOptions& o) : options_(o) {
  auto bad = [](const char* what, auto value, const char* expected) {
    Throw(ErrorCode::kInvalidArgument, "group scheduler: {} = {}: expected {}", what, value,
          expected);
  };
  if (o.world_size < 1) bad("world size", o.world_size, "an integer >= 1");
  if (o.period < 1) bad("period P", o.period, "an integer >= 1");
  if (!(o.window_min_s > 0) || !std::isfinite(o.window_min_s)) {
    bad("window_min_s", o.window_min_s, "a finite number of seconds > 0");
  }
  if (!(o.window_max_s >= o.window_min_s) || !std::isfinite(o.window_max_s)) {
    bad("window_max_s", o.window_max_s, "a finite number of seconds >= window_min_s");
  }
  if (!(o.window_init_s >= o.window_min_s && o.window_init_s <= o.window_max_s)) {
    bad("window_init_s", o.window_init_s, "seconds in [window_min_s, window_max_s]");
  }
  if (!(o.window_grow >= 1) || !std::isfinite(o.window_grow)) {
    bad("window_grow", o.window_grow, "a finite factor >= 1");
  }
  if (!(o.window_shrink > 0 && o.window_shrink <= 1)) {
    bad("window_shrink", o.window_shrink, "a factor in (0, 1]");
  }
  if (o.min_group < 1 || o.min_group > o.world_size) {
    bad("min_group", o.min_group, "an integer in [1, world size]");
  }
  if (o.epoch_updates < 0) bad("epoch_updates", o.epoch_updates, ">= 0");
  if (o.total_updates < 0) bad("total_updates", o.total_updates, ">= 0");
  if (o.eval_updates < 0) bad("eval_updates", o.eval_updates, ">= 0");
  window_s_ = o.window_init_s;
  is_ready_.assign(o.world_size, false);
  ResetUnion();
  ArmBarrierIfDue();  // a first epoch (or job) of one step per rank is a barrier at once
}

void GroupScheduler::ResetUnion() {
  parent_.resize(options_.world_size);
  for (int i = 0; i < options_.world_size; ++i) parent_[i] = i;
  updates_since_reset_ = 0;
}

int GroupScheduler::Find(std::vector<int>& parent, int x) const {
  while (parent[x] != x) {
    parent[x] = parent[parent[x]];  // path halving
    x = parent[x];
  }
  return x;
}

bool GroupScheduler::ConnectedWithWaiting() const {
  std::vector<int> parent = parent_;
  int components = options_.world_size;
  for (size_t i = 1; i < ready_.size(); ++i) {
    const int a = Find(parent, ready_[0]), b = Find(parent, ready_[i]);
    if (a != b) parent[a] = b;
  }
  components = 0;
  for (int i = 0; i < options_.world_size; ++i) components += Find(parent, i) == i ? 1 : 0;
  return components == 1;
}

RoundKind GroupScheduler::pending_kind() const {
  if (!ready_.empty()) return kind_;
  if (barrier_armed_) return RoundKind::kBarrier;
  if (updates_since_reset_ >= static_cast<int64_t>(options_.period - 1) * options_.world_size) {
    return RoundKind::kConnect;
  }
  return RoundKind::kNormal;
}

void GroupScheduler::Arrive(int rank, double now) {
  if (rank < 0 || rank >= options_.world_size) {
    Throw(ErrorCode::kInvalidArgument,
          "group scheduler: a request from rank {}: expected a rank in [0, {})", rank,
          options_.world_size);
  }
  if (stopped_) {
    Throw(ErrorCode::kInvalidArgument,
          "group scheduler: rank {} asked for a group after the job's last round ({} "
          "worker-updates done)",
          rank, updates_);
  }
  if (is_ready_[rank]) {
    Throw(ErrorCode::kInvalidArgument,
          "group scheduler: rank {} asked for a group twice in round {} (it is already waiting)",
          rank, rounds_);
  }
  if (ready_.empty()) {
    kind_ = pending_kind();
    opened_at_ = now;
  }
  ready_.push_back(rank);
  is_ready_[rank] = true;
}

double GroupScheduler::wake_time() const {
  if (ready_.empty() || kind_ != RoundKind::kNormal) {
    return std::numeric_limits<double>::infinity();
  }
  return opened_at_ + window_s_;
}

int64_t GroupScheduler::EpochBoundary() const {
  int64_t boundary = options_.epoch_updates > 0
                         ? (static_cast<int64_t>(epoch_) + 1) * options_.epoch_updates
                         : std::numeric_limits<int64_t>::max();
  if (options_.total_updates > 0) boundary = std::min(boundary, options_.total_updates);
  return boundary;
}

int64_t GroupScheduler::NextBarrier() const {
  int64_t boundary = EpochBoundary();
  if (options_.eval_updates > 0) {
    boundary = std::min(
        boundary, (last_barrier_updates_ / options_.eval_updates + 1) * options_.eval_updates);
  }
  return boundary;
}

int64_t GroupScheduler::Quota() const {
  const int64_t boundary = NextBarrier();
  if (boundary == std::numeric_limits<int64_t>::max()) return boundary;
  return std::max<int64_t>(0, boundary - options_.world_size - updates_);
}

void GroupScheduler::ArmBarrierIfDue() {
  if (stopped_ || barrier_armed_ || Quota() > 0) return;
  barrier_armed_ = true;
  barrier_ends_epoch_ = NextBarrier() == EpochBoundary();
}

std::optional<GroupDecision> GroupScheduler::Decide(double now) {
  if (ready_.empty()) return std::nullopt;
  const int n = options_.world_size;
  const bool all = static_cast<int>(ready_.size()) == n;
  bool close = false;
  switch (kind_) {
    case RoundKind::kNormal: close = all || now >= opened_at_ + window_s_; break;
    case RoundKind::kConnect: close = all || ConnectedWithWaiting(); break;
    case RoundKind::kBarrier: close = all; break;
  }
  if (!close) return std::nullopt;

  // A round before a barrier takes only the first arrivals that fit the barrier's quota: every
  // arrival is a local step already taken, so the ones past it wait and count as their barrier
  // step. Otherwise the barrier, N more updates, would end past its boundary, and neither the
  // epochs nor train.max_steps would hold (issue 45).
  const size_t take = kind_ == RoundKind::kBarrier
                          ? ready_.size()
                          : static_cast<size_t>(std::min<int64_t>(
                                static_cast<int64_t>(ready_.size()), Quota()));
  PSGD_CHECK_GE(take, 1u);
  const std::vector<int> group(ready_.begin(), ready_.begin() + static_cast<ptrdiff_t>(take));
  ready_.erase(ready_.begin(), ready_.begin() + static_cast<ptrdiff_t>(take));

  GroupDecision d;
  d.round = rounds_++;
  d.kind = kind_;
  d.members = group;
  std::sort(d.members.begin(), d.members.end());
  d.decided_at = now;
  for (size_t i = 1; i < group.size(); ++i) {
    const int a = Find(parent_, group[0]), b = Find(parent_, group[i]);
    if (a != b) parent_[a] = b;
  }
  const int64_t size = static_cast<int64_t>(group.size());
  updates_ += size;
  updates_since_reset_ += size;
  for (int r : group) is_ready_[r] = false;

  if (kind_ == RoundKind::kNormal) {
    window_s_ = static_cast<int>(size) < options_.min_group
                    ? std::min(window_s_ * options_.window_grow, options_.window_max_s)
                    : std::max(window_s_ * options_.window_shrink, options_.window_min_s);
  }
  if (kind_ == RoundKind::kConnect || kind_ == RoundKind::kBarrier) ResetUnion();
  if (kind_ == RoundKind::kBarrier) {
    barrier_armed_ = false;
    d.stop = options_.total_updates > 0 && updates_ >= options_.total_updates;
    // An evaluation's barrier that reaches the epoch's boundary ends the epoch too.
    d.epoch_end = barrier_ends_epoch_ || d.stop || updates_ >= EpochBoundary();
    d.evaluate = true;
    d.epoch = d.epoch_end ? ++epoch_ : epoch_;
    stopped_ = d.stop;
    last_barrier_updates_ = updates_;
  } else {
    d.epoch = epoch_;
  }
  // The next barrier is armed once the rounds before it have used its quota: the next multiple
  // of epoch_updates (capped at the total), or of eval_updates past the last barrier, less N.
  ArmBarrierIfDue();
  if (!ready_.empty()) {
    PSGD_CHECK(barrier_armed_);
    kind_ = RoundKind::kBarrier;  // the arrivals left over open the barrier round
  }
  d.updates = updates_;
  return d;
}

}  // namespace pipesgd::train
