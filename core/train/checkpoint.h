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
#include <string>

#include "core/checkpoint.pb.h"  // generated from core/train/checkpoint.proto

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

}  // namespace pipesgd::train
