// Checkpoint files: one per rank and step, written atomically, verified on load.
//
// On disk: "PSGK" (4 bytes), format version (u32), payload length (u64), the payload (a
// serialized pipesgd.checkpoint.Checkpoint, core/train/checkpoint.proto), then the CRC-32
// (zlib's) of the payload (u32); little-endian. A file is written to a temporary name in the
// same directory, fsync'ed, renamed into place, and the directory fsync'ed, so a crash at any
// moment leaves either the previous set of files or the new one, never a torn file under a
// checkpoint's name. Older checkpoints beyond `keep` are deleted only after the new one is in
// place, so the previous good checkpoint always survives a failed write.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>

#include "core/checkpoint.pb.h"  // generated from core/train/checkpoint.proto
#include "core/collective/ring_allreduce.h"
#include "core/train/trainer.h"

namespace pipesgd::train {

// dir/ckpt-<step, 12 digits>.rank<rank>
std::filesystem::path CheckpointPath(const std::filesystem::path& dir, int64_t step, int rank);

// Writes `checkpoint` (its steps() and rank() name the file) into dir, creating dir if needed,
// then deletes this rank's checkpoints older than the newest `keep` (>= 1).
// Throws Error(kIo) naming the path and the system error.
void WriteCheckpoint(const std::filesystem::path& dir, const checkpoint::Checkpoint& checkpoint,
                     int keep);

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
