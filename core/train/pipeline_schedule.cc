#include "core/train/pipeline_schedule.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/base/error.h"

namespace pipesgd::train {
namespace {

void CheckArgs(int stages, int stage, int micro_batches) {
  if (stages < 1) Throw(ErrorCode::kInvalidArgument, "pipeline stages is {}, must be >= 1", stages);
  if (stage < 0 || stage >= stages) {
    Throw(ErrorCode::kInvalidArgument, "pipeline stage {} is outside [0, {})", stage, stages);
  }
  if (micro_batches < 1) {
    Throw(ErrorCode::kInvalidArgument, "pipeline micro_batches is {}, must be >= 1",
          micro_batches);
  }
}

}  // namespace

std::string ToString(const PipelineOp& op) {
  return fmt::format("{}{}", op.kind == PipelineOp::Kind::kForward ? 'F' : 'B', op.micro_batch);
}

std::string ToString(const std::vector<PipelineOp>& ops) {
  std::string out;
  for (const auto& op : ops) {
    if (!out.empty()) out += ' ';
    out += ToString(op);
  }
  return out;
}

std::vector<PipelineOp> OneFOneBSchedule(int stages, int stage, int micro_batches) {
  CheckArgs(stages, stage, micro_batches);
  const int warmup = std::min(stages - stage - 1, micro_batches);
  std::vector<PipelineOp> ops;
  ops.reserve(2 * static_cast<size_t>(micro_batches));
  for (int i = 0; i < warmup; ++i) ops.push_back({PipelineOp::Kind::kForward, i});
  for (int j = 0; j < micro_batches - warmup; ++j) {
    ops.push_back({PipelineOp::Kind::kForward, warmup + j});
    ops.push_back({PipelineOp::Kind::kBackward, j});
  }
  for (int i = micro_batches - warmup; i < micro_batches; ++i) {
    ops.push_back({PipelineOp::Kind::kBackward, i});
  }
  return ops;
}

int MaxInFlight(int stages, int stage, int micro_batches) {
  CheckArgs(stages, stage, micro_batches);
  return std::min(stages - stage, micro_batches);
}

}  // namespace pipesgd::train
