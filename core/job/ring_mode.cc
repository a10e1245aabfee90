#include "core/job/ring_mode.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "core/base/log.h"

namespace pipesgd::job {

train::TrainingMode::Result RingMode::Evaluate(int64_t from) {
  const layers::EvalResult local = evaluate_shard_();
  std::vector<float> sums = {static_cast<float>(local.loss_sum),
                             static_cast<float>(local.correct),
                             static_cast<float>(local.count)};
  trainer_.AllReduce(sums, collective::ReduceOp::kSum);
  Result r;
  r.test_accuracy = sums[2] > 0 ? sums[1] / sums[2] : 0.0;
  r.test_loss = sums[2] > 0 ? sums[0] / sums[2] : 0.0;
  double loss_sum = 0;
  for (int64_t t = from; t < trainer_.steps(); ++t) loss_sum += trainer_.StepLoss(t);
  r.train_loss = trainer_.steps() > from
                     ? loss_sum / static_cast<double>(trainer_.steps() - from)
                     : std::numeric_limits<double>::quiet_NaN();
  // Bytes this rank put on the wire per gradient AllReduce since the previous evaluation.
  const train::WireTotals wire = trainer_.wire_totals();
  const int64_t wire_steps = std::max<int64_t>(1, wire.steps - wire_before_.steps);
  r.wire_bytes_per_step =
      static_cast<double>(wire.bytes_sent - wire_before_.bytes_sent) / wire_steps;
  const uint64_t payload = wire.payload_bytes - wire_before_.payload_bytes;
  r.compression_ratio =
      payload == 0 ? 1.0
                   : static_cast<double>(wire.raw_payload_bytes - wire_before_.raw_payload_bytes) /
                         payload;
  if (wire.saturated > wire_before_.saturated) {
    PSGD_LOG_WARN("rank {}: step {}: {} gradient elements were beyond the codec's range and "
                  "were clamped (comm.compression = {}; fp16 saturates at +-65504)",
                  rank_, trainer_.steps(), wire.saturated - wire_before_.saturated,
                  config::Comm::Compression_Name(comm_.compression()));
  }
  wire_before_ = wire;
  return r;
}

}  // namespace pipesgd::job
