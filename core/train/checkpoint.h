// Checkpoint files: one per rank and step, written atomically, verified on load.
//
// On disk: "PSGK" (4 bytes), format version (u32), payload length (u64), the payload (a
// serialized pipesgd.checkpoint.Checkpoint, core/train/checkpoint.proto), then the CRC-32
// (zlib's) of the payload (u32); little-endian. A file is written to a temporary name in the
// same directory, fsync'ed, renamed into place, and the directory fsync'ed, so a crash at any
// moment leaves either the previous set of files or the new one, never a torn file under a
// checkpoint's name. In a job, a rank deletes its older checkpoints (beyond `keep`) only once
// every rank has written the new step (WriteCheckpointRound), so a write that fails on one rank
// (a full disk) leaves a step that every rank still has.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/checkpoint.pb.h"  // generated from core/train/checkpoint.proto
#include "core/collective/ring_allreduce.h"
#include "core/train/trainer.h"

namespace pipesgd::train {

// dir/ckpt-<step, 12 digits>.rank<rank>
std::filesystem::path CheckpointPath(const std::filesystem::path& dir, int64_t step, int rank);

// Writes `checkpoint` (its steps() and rank() name the file) into dir, creating dir if needed,
// and durably (fsync'ed, renamed, the directory fsync'ed); deletes nothing but this rank's
// temporaries of crashed writes. Throws Error(kIo) naming the path and the system error.
void WriteCheckpointFile(const std::filesystem::path& dir,
                         const checkpoint::Checkpoint& checkpoint);

// Deletes this rank's checkpoints in dir but the newest `keep` (>= 1) of the steps up to
// `confirmed_step`, and those of later steps (a stopped run's, that not every rank reached).
void PruneCheckpoints(const std::filesystem::path& dir, int rank, int64_t confirmed_step,
                      int keep);

// WriteCheckpointFile, then PruneCheckpoints at its step: for one process alone (tests, tools).
void WriteCheckpoint(const std::filesystem::path& dir, const checkpoint::Checkpoint& checkpoint,
                     int keep);

// One checkpoint round of a job of several ranks: writes this rank's file, then tells every
// rank whether it failed and learns the same of every rank through `gather_failed` (it takes
// this rank's flag, 1 = failed, and returns every rank's, indexed by rank; one collective that
// every rank of the job calls in the same round, e.g. a sum-AllReduce of a one-hot vector), and
// only if no rank failed prunes as PruneCheckpoints at the new step. The pruning cannot run
// ahead of the slowest rank's write: the collective completes on no rank before every rank
// has reported, after its write. A failed write stops the job on every rank: this rank
// rethrows its Error(kIo) (after the collective); the others throw Error(kIo) naming the
// ranks that failed (culprit: the first). Either way each rank keeps its previous checkpoints,
// and those of the new step where it wrote them.
void WriteCheckpointRound(const std::filesystem::path& dir,
                          const checkpoint::Checkpoint& checkpoint, int keep,
                          const std::function<std::vector<float>(float)>& gather_failed);

// Reads and verifies one file. Throws Error(kDataLoss) naming the path and what is wrong
// (truncated, bad magic or version, length or checksum mismatch, unparsable payload),
// Error(kNotFound) if it does not exist.
checkpoint::Checkpoint ReadCheckpoint(const std::filesystem::path& path);
// The same for a file's bytes already in memory; `name` only names it in messages.
checkpoint::Checkpoint ParseCheckpoint(const std::string& bytes, const std::string& name);

// This rank's newest checkpoint in dir that verifies (at `step` exactly when given), skipping
// (with a warning naming the file and the reason) any that do not; nullopt if none does.
std::optional<checkpoint::Checkpoint> LoadLatestCheckpoint(const std::filesystem::path& dir,
                                                           int rank,
                                                           std::optional<int64_t> step = {});

// A ring job's state between steps, beside the trainer's own (TrainerSnapshot): what its
// checkpoint holds. The spans must stay valid for the call.
struct RingJobState {
  std::string job;  // the job's description: a resume must be of the same job
  int rank = 0;
  int world_size = 1;
  uint64_t collective_sequence = 0;  // the communicator's next sequence number
  std::span<const float> params;
  std::span<const float> optimizer_state;
  std::span<const float> residual;  // the error-feedback residual (empty without it)
  // In effect (after any auto choice), so that a resume of an auto job keeps them.
  int pipeline_width = 0;
  uint64_t chunk_bytes = 0;
  int streams = 0;
};

// The checkpoint of `state` and `snapshot`. Throws Error(kNumerical) naming the rank, the step
// and the first parameter that is not finite: no checkpoint is ever taken of such a state.
checkpoint::Checkpoint CaptureCheckpoint(const RingJobState& state,
                                         const TrainerSnapshot& snapshot);

// The trainer's part of `c`, for Trainer::Restore; the inverse of CaptureCheckpoint's.
TrainerSnapshot SnapshotFromCheckpoint(const checkpoint::Checkpoint& c);

// Throws Error when `c` (read from `dir`) cannot continue this job: kInvalidArgument when
// another job wrote it (naming the first differing line), kDataLoss when its world size or
// parameter count differ from this job's. checkpoint.dir is no part of a job's identity (a
// checkpoint directory can be moved): it is left out of both texts before they are compared.
void CheckCheckpointFitsJob(const checkpoint::Checkpoint& c, const std::string& dir,
                            const std::string& job, int world_size, size_t num_params);

// The checkpoint every rank of `comm` resumes from: the newest step that each rank has a
// verified file for in `dir` (this rank's, loaded). Every rank takes the same decision from the
// same gathered numbers (two exact AllReduces), so all fail or none. Throws Error kNotFound
// naming the ranks without a checkpoint, or without one of the agreed step; kInvalidArgument
// for a step beyond 2^24 - 2 (what one float carries exactly).
checkpoint::Checkpoint AgreeOnCheckpoint(collective::Communicator& comm,
                                         const std::filesystem::path& dir, double timeout_s);

}  // namespace pipesgd::train
