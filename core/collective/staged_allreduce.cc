#include "core/collective/staged_allreduce.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::collective {

HostStagingCopier::HostStagingCopier(int lanes, size_t segment_elems)
    : segment_elems_(segment_elems), lanes_(static_cast<size_t>(std::max(lanes, 0))) {
  for (auto& lane : lanes_) lane.assign(segment_elems, 0.0f);
}

void HostStagingCopier::ToHost(int lane, const float* device, size_t n) {
  PSGD_CHECK_LE(n, segment_elems_);
  pending_.push_back({lanes_[lane].data(), device, n, lane, true});
  max_pending_ = std::max(max_pending_, pending_.size());
  log_.push_back(fmt::format("to_host lane {} n {}", lane, n));
}

void HostStagingCopier::WaitToHost(int lane) {
  log_.push_back(fmt::format("wait_to_host lane {}", lane));
  // The lane's last ToHost and everything queued before it.
  for (size_t i = pending_.size(); i-- > 0;) {
    if (pending_[i].to_host && pending_[i].lane == lane) {
      RunUntil(i);
      return;
    }
  }
}

void HostStagingCopier::ToDevice(int lane, float* device, size_t n) {
  PSGD_CHECK_LE(n, segment_elems_);
  pending_.push_back({device, lanes_[lane].data(), n, lane, false});
  max_pending_ = std::max(max_pending_, pending_.size());
  log_.push_back(fmt::format("to_device lane {} n {}", lane, n));
}

void HostStagingCopier::WaitAll() {
  log_.push_back("wait_all");
  if (!pending_.empty()) RunUntil(pending_.size() - 1);
}

void HostStagingCopier::RunUntil(size_t index) {
  for (size_t i = 0; i <= index; ++i) {
    if (pending_[i].n > 0) std::memcpy(pending_[i].dst, pending_[i].src, pending_[i].n * sizeof(float));
  }
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(index + 1));
}

StagedAllReduce::StagedAllReduce(Communicator& comm, StagingCopier& copier)
    : comm_(comm), copier_(copier) {
  if (copier.lanes() < 2) {
    Throw(ErrorCode::kInvalidArgument,
          "staged AllReduce: {} staging lane(s); at least 2 are needed to overlap the copies "
          "with the ring", copier.lanes());
  }
  if (copier.segment_elems() == 0) {
    Throw(ErrorCode::kInvalidArgument, "staged AllReduce: segment of 0 elements");
  }
  if (comm.options().error_feedback) {
    Throw(ErrorCode::kInvalidArgument,
          "staged AllReduce: comm.error_feedback is not supported for GPU buffers (the "
          "residual would restart at every segment); turn it off or use model.device = CPU");
  }
  for (int lane = 0; lane < copier.lanes(); ++lane) {
    regions_.push_back(comm.RegisterMemory({copier.host(lane), copier.segment_elems()}));
  }
}

StagedAllReduce::~StagedAllReduce() = default;

void StagedAllReduce::AllReduce(float* data, size_t count, ReduceOp op, Deadline deadline,
                                const std::atomic<bool>* abort, const AllReduceOptions& call,
                                const SegmentObserver& reduced) {
  PSGD_CHECK_LE(call.exact_tail, count);
  stats_ = {};
  if (count == 0) {
    comm_.AllReduce({}, op, deadline, abort, call);  // neighbours still compare headers
    stats_ = comm_.last_wire_stats();
    return;
  }
  const size_t seg = copier_.segment_elems();
  const int lanes = copier_.lanes();
  const size_t segments = (count + seg - 1) / seg;
  const size_t tail_start = count - call.exact_tail;
  auto lane_of = [lanes](size_t i) { return static_cast<int>(i % static_cast<size_t>(lanes)); };
  auto size_of = [&](size_t i) { return std::min(seg, count - i * seg); };

  copier_.Begin();
  try {
    // Prefetch: segments 0 .. L-2 go device-to-host right away.
    const size_t ahead = static_cast<size_t>(lanes) - 1;
    for (size_t j = 0; j < std::min(ahead, segments); ++j) {
      copier_.ToHost(lane_of(j), data + j * seg, size_of(j));
    }
    for (size_t i = 0; i < segments; ++i) {
      const int lane = lane_of(i);
      const size_t begin = i * seg, n = size_of(i);
      copier_.WaitToHost(lane);
      // Segment i+L-1 reuses the lane of segment i-1, whose host-to-device copy was queued in
      // the previous iteration; the copier starts it once that copy has read the lane.
      if (i + ahead < segments) {
        copier_.ToHost(lane_of(i + ahead), data + (i + ahead) * seg, size_of(i + ahead));
      }
      AllReduceOptions seg_call = call;
      // The exact tail is a suffix of the buffer, so its part in this segment is a suffix too.
      const size_t end = begin + n;
      seg_call.exact_tail = end > tail_start ? end - std::max(begin, tail_start) : 0;
      try {
        comm_.AllReduce({copier_.host(lane), n}, op, deadline, abort, seg_call);
        const WireStats& seg_stats = comm_.last_wire_stats();
        stats_.chunks_sent += seg_stats.chunks_sent;
        stats_.bytes_sent += seg_stats.bytes_sent;
        stats_.payload_bytes += seg_stats.payload_bytes;
        stats_.raw_payload_bytes += seg_stats.raw_payload_bytes;
        stats_.saturated += seg_stats.saturated;
        stats_.compressed = stats_.compressed || seg_stats.compressed;
      } catch (const Error& e) {
        throw e.Wrap(fmt::format("staged AllReduce, segment {} of {} (elements [{}, {}))", i,
                                 segments, begin, end));
      }
      if (reduced) reduced(begin, {copier_.host(lane), n});
      copier_.ToDevice(lane, data + begin, n);
    }
  } catch (...) {
    try {
      copier_.WaitAll();
    } catch (...) {
      // The first error is the one to report.
    }
    throw;
  }
  copier_.WaitAll();
}

}  // namespace pipesgd::collective
