#include "core/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <fstream>
#include <optional>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "transport/rendezvous.h"

namespace pipesgd::train {
namespace fs = std::filesystem;

namespace {

constexpr char kMagic[4] = {'P', 'S', 'G', 'K'};
constexpr uint32_t kFormatVersion = 1;
constexpr size_t kHeaderBytes = 16;  // magic, version, payload length
constexpr size_t kTrailerBytes = 4;  // CRC-32

static_assert(std::endian::native == std::endian::little, "checkpoints are little-endian");

uint32_t Crc32(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  // zlib takes uInt lengths: feed large payloads in pieces.
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const uInt n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(p), n);
    p += n;
    left -= n;
  }
  return static_cast<uint32_t>(crc);
}

[[noreturn]] void ThrowIo(const std::string& what, const fs::path& path) {
  Throw(ErrorCode::kIo, "checkpoint: cannot {} {}: {}", what, path.string(), std::strerror(errno));
}

// Writes all of `bytes` to fd; throws naming the path.
void WriteAll(int fd, const char* data, size_t size, const fs::path& path) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      ThrowIo("write", path);
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void FsyncDirectory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) ThrowIo("open directory", dir);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) ThrowIo("fsync directory", dir);
}

// This rank's checkpoint files in dir, newest step first.
std::vector<std::pair<int64_t, fs::path>> ListCheckpoints(const fs::path& dir, int rank) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return found;
  // ckpt-<12 digits>.rank<rank>, exactly.
  const std::string suffix = ".rank" + std::to_string(rank);
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    // Something else under a checkpoint's name (a directory in the way) is none: it must neither
    // count as the newest step when pruning nor be tried on --resume.
    if (std::error_code type_ec; !entry.is_regular_file(type_ec)) continue;
    const std::string file = entry.path().filename().string();
    if (file.size() != 5 + 12 + suffix.size() || file.compare(0, 5, "ckpt-") != 0 ||
        file.compare(17, std::string::npos, suffix) != 0) {
      continue;
    }
    const std::string digits = file.substr(5, 12);
    if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
    found.emplace_back(std::stoll(digits), entry.path());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return found;
}

}  // namespace

fs::path CheckpointPath(const fs::path& dir, int64_t step, int rank) {
  return dir / fmt::format("ckpt-{:012d}.rank{}", step, rank);
}

void WriteCheckpointFile(const fs::path& dir, const checkpoint::Checkpoint& checkpoint) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    Throw(ErrorCode::kIo, "checkpoint: cannot create directory {}: {}", dir.string(), ec.message());
  }
  std::string payload;
  if (!checkpoint.SerializeToString(&payload)) {
    Throw(ErrorCode::kInternal, "checkpoint: cannot serialize step {} ({} bytes)",
          checkpoint.steps(), checkpoint.ByteSizeLong());
  }
  std::string header(kHeaderBytes, '\0');
  std::memcpy(header.data(), kMagic, 4);
  std::memcpy(header.data() + 4, &kFormatVersion, 4);
  const uint64_t length = payload.size();
  std::memcpy(header.data() + 8, &length, 8);
  const uint32_t crc = Crc32(payload);

  const fs::path final_path = CheckpointPath(dir, checkpoint.steps(), checkpoint.rank());
  const fs::path tmp_path = final_path.string() + fmt::format(".tmp.{}", ::getpid());
  const int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) ThrowIo("create", tmp_path);
  try {
    WriteAll(fd, header.data(), header.size(), tmp_path);
    WriteAll(fd, payload.data(), payload.size(), tmp_path);
    WriteAll(fd, reinterpret_cast<const char*>(&crc), sizeof(crc), tmp_path);
    if (::fsync(fd) != 0) ThrowIo("fsync", tmp_path);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp_path.c_str());
    throw;
  }
  if (::close(fd) != 0) ThrowIo("close", tmp_path);
  if (::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    const int rename_errno = errno;
    ::unlink(tmp_path.c_str());  // a full disk must not stay full of this rank's temporaries
    errno = rename_errno;
    ThrowIo("rename into place", final_path);
  }
  FsyncDirectory(dir);

  // Temporaries of this rank's crashed writes (another pid's) can go at once: no checkpoint is
  // ever read from a temporary name.
  const std::string stale_prefix = fmt::format(".rank{}.tmp.", checkpoint.rank());
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind("ckpt-", 0) == 0 && file.find(stale_prefix) != std::string::npos &&
        entry.path() != tmp_path) {
      fs::remove(entry.path(), ec);
    }
  }
}

void PruneCheckpoints(const fs::path& dir, int rank, int64_t confirmed_step, int keep) {
  std::error_code ec;
  int kept = 0;
  for (const auto& [step, path] : ListCheckpoints(dir, rank)) {
    // Steps after the confirmed one are a stopped run's, which not every rank reached (this run
    // went back to an older step and writes its own); steps before it beyond `keep` are spent.
    if (step > confirmed_step || kept++ >= std::max(keep, 1)) {
      fs::remove(path, ec);
    }
  }
}

void WriteCheckpoint(const fs::path& dir, const checkpoint::Checkpoint& checkpoint, int keep) {
  WriteCheckpointFile(dir, checkpoint);
  PruneCheckpoints(dir, checkpoint.rank(), checkpoint.steps(), keep);
}

void WriteCheckpointRound(const fs::path& dir, const checkpoint::Checkpoint& checkpoint, int keep,
                          const std::function<std::vector<float>(float)>& gather_failed) {
  std::exception_ptr failure;
  try {
    WriteCheckpointFile(dir, checkpoint);
  } catch (const Error&) {
    failure = std::current_exception();
  }
  // Every rank takes part, its write failed or not, so that all learn the same outcome at once.
  const std::vector<float> failed = gather_failed(failure ? 1.0f : 0.0f);
  if (failure) std::rethrow_exception(failure);
  std::vector<int> ranks;
  for (size_t r = 0; r < failed.size(); ++r) {
    if (failed[r] != 0) ranks.push_back(static_cast<int>(r));
  }
  if (!ranks.empty()) {
    Error e(ErrorCode::kIo,
            fmt::format("checkpoint: rank(s) {} could not write their checkpoint of step {} "
                        "(their own errors say why); stopping, with the previous checkpoints kept "
                        "on every rank (--resume goes back to the newest step every rank has)",
                        fmt::join(ranks, ", "), checkpoint.steps()));
    throw e.set_culprit(ranks.front());
  }
  PruneCheckpoints(dir, checkpoint.rank(), checkpoint.steps(), keep);
}

checkpoint::Checkpoint ReadCheckpoint(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    if (!fs::exists(path, ec)) Throw(ErrorCode::kNotFound, "checkpoint {}: no such file", path.string());
    Throw(ErrorCode::kIo, "checkpoint {}: cannot open: {}", path.string(), std::strerror(errno));
  }
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return ParseCheckpoint(bytes, path.string());
}

checkpoint::Checkpoint ParseCheckpoint(const std::string& bytes, const std::string& name) {
  auto bad = [&](const std::string& why) {
    Throw(ErrorCode::kDataLoss, "checkpoint {}: {}", name, why);
  };
  if (bytes.size() < kHeaderBytes + kTrailerBytes) {
    bad(fmt::format("truncated: {} bytes, shorter than the {}-byte frame", bytes.size(),
                    kHeaderBytes + kTrailerBytes));
  }
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) bad("not a pipesgd checkpoint (bad magic)");
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 4, 4);
  if (version != kFormatVersion) {
    bad(fmt::format("format version {}, this program reads version {}", version, kFormatVersion));
  }
  uint64_t length = 0;
  std::memcpy(&length, bytes.data() + 8, 8);
  const uint64_t available = bytes.size() - kHeaderBytes - kTrailerBytes;
  if (length != available) {
    bad(fmt::format("truncated or padded: the header says {} payload bytes, the file has {}",
                    length, available));
  }
  const std::string payload = bytes.substr(kHeaderBytes, length);
  uint32_t stored_crc = 0;
  std::memcpy(&stored_crc, bytes.data() + kHeaderBytes + length, 4);
  const uint32_t crc = Crc32(payload);
  if (crc != stored_crc) {
    bad(fmt::format("checksum mismatch (stored {:#010x}, computed {:#010x}): the file is corrupt",
                    stored_crc, crc));
  }
  checkpoint::Checkpoint checkpoint;
  if (!checkpoint.ParseFromString(payload)) bad("the payload does not parse");
  return checkpoint;
}

std::optional<checkpoint::Checkpoint> LoadLatestCheckpoint(const fs::path& dir, int rank,
                                                           std::optional<int64_t> step) {
  for (const auto& [file_step, path] : ListCheckpoints(dir, rank)) {
    if (step && file_step != *step) continue;
    try {
      checkpoint::Checkpoint checkpoint = ReadCheckpoint(path);
      if (checkpoint.steps() != file_step || checkpoint.rank() != rank) {
        Throw(ErrorCode::kDataLoss, "checkpoint {}: holds step {} of rank {}, its name says step {} "
              "of rank {}", path.string(), checkpoint.steps(), checkpoint.rank(), file_step, rank);
      }
      return checkpoint;
    } catch (const Error& e) {
      PSGD_LOG_WARN("rank {}: skipping checkpoint: {}; trying the previous one", rank, e.what());
    }
  }
  return std::nullopt;
}

checkpoint::Checkpoint CaptureCheckpoint(const RingJobState& state,
                                         const TrainerSnapshot& snapshot) {
  for (size_t i = 0; i < state.params.size(); ++i) {
    if (!std::isfinite(state.params[i])) {
      Throw(ErrorCode::kNumerical,
            "rank {}: step {}: parameter {} is {}; not writing a checkpoint of this state",
            state.rank, snapshot.steps, i, state.params[i]);
    }
  }
  checkpoint::Checkpoint c;
  c.set_format_version(1);
  c.set_job(state.job);
  c.set_rank(state.rank);
  c.set_world_size(state.world_size);
  c.set_steps(snapshot.steps);
  c.set_applied(snapshot.applied);
  c.set_collective_sequence(state.collective_sequence);
  c.set_pipeline_width(state.pipeline_width);
  c.set_chunk_bytes(state.chunk_bytes);
  c.set_streams(state.streams);
  c.mutable_params()->Add(state.params.begin(), state.params.end());
  c.mutable_optimizer_state()->Add(state.optimizer_state.begin(), state.optimizer_state.end());
  c.mutable_residual()->Add(state.residual.begin(), state.residual.end());
  c.mutable_losses()->Add(snapshot.losses.begin(), snapshot.losses.end());
  for (const auto& p : snapshot.pending) {
    auto* pending = c.add_pending();
    pending->set_step(p.step);
    pending->mutable_aggregate()->Add(p.aggregate.begin(), p.aggregate.end());
    pending->mutable_local()->Add(p.local.begin(), p.local.end());
  }
  return c;
}

TrainerSnapshot SnapshotFromCheckpoint(const checkpoint::Checkpoint& c) {
  TrainerSnapshot snapshot;
  snapshot.steps = c.steps();
  snapshot.applied = c.applied();
  snapshot.losses.assign(c.losses().begin(), c.losses().end());
  for (const auto& p : c.pending()) {
    snapshot.pending.push_back({p.step(),
                                {p.aggregate().begin(), p.aggregate().end()},
                                {p.local().begin(), p.local().end()}});
  }
  return snapshot;
}

namespace {

// `job` (FormatConfig's text) without checkpoint.dir: checkpoints written before the directory
// was left out of the identity carry it, and must still resume from wherever they are now.
std::string WithoutCheckpointDir(const std::string& job) {
  std::string out;
  bool in_checkpoint = false;
  size_t start = 0;
  while (start < job.size()) {
    size_t end = job.find('\n', start);
    end = end == std::string::npos ? job.size() : end + 1;
    const std::string_view line(job.data() + start, end - start);
    start = end;
    if (line.starts_with("checkpoint {")) in_checkpoint = true;
    if (in_checkpoint && line.starts_with("}")) in_checkpoint = false;
    if (in_checkpoint && line.starts_with("  dir: ")) continue;
    out += line;
  }
  return out;
}

}  // namespace

void CheckCheckpointFitsJob(const checkpoint::Checkpoint& c, const std::string& dir,
                            const std::string& job, int world_size, size_t num_params) {
  const std::string theirs = WithoutCheckpointDir(c.job());
  const std::string ours = WithoutCheckpointDir(job);
  if (theirs != ours) {
    Throw(ErrorCode::kInvalidArgument,
          "--resume: the checkpoint of step {} in {} was written by another job: {}", c.steps(),
          dir, transport::DescribeJobDifference(theirs, "the checkpoint", ours, "this job"));
  }
  if (c.world_size() != world_size || c.params_size() != static_cast<int64_t>(num_params)) {
    Throw(ErrorCode::kDataLoss,
          "--resume: checkpoint of step {} has world size {} and {} parameters, the job has {} "
          "and {}",
          c.steps(), c.world_size(), c.params_size(), world_size, num_params);
  }
}

namespace {

collective::AllReduceOptions Exact() {
  collective::AllReduceOptions exact;
  exact.compress = false;
  return exact;
}

// Every rank's value of `mine` (exact below 2^24), through one AllReduce.
std::vector<int64_t> GatherSmallInts(collective::Communicator& comm, int64_t mine,
                                     double timeout_s) {
  PSGD_CHECK(mine >= 0 && mine < (int64_t{1} << 24));
  std::vector<float> all(comm.world_size(), 0.0f);
  all[comm.rank()] = static_cast<float>(mine);
  comm.AllReduce(all, collective::ReduceOp::kSum, Deadline::After(timeout_s), nullptr, Exact());
  return std::vector<int64_t>(all.begin(), all.end());
}

}  // namespace

checkpoint::Checkpoint AgreeOnCheckpoint(collective::Communicator& comm,
                                         const std::filesystem::path& dir, double timeout_s) {
  const int rank = comm.rank();
  std::optional<checkpoint::Checkpoint> mine = LoadLatestCheckpoint(dir, rank);
  if (mine && mine->steps() >= (int64_t{1} << 24) - 1) {
    Throw(ErrorCode::kInvalidArgument, "--resume: checkpoint step {} is beyond 2^24 - 2",
          mine->steps());
  }
  // 0: none; s + 1: newest verified step s.
  const std::vector<int64_t> newest = GatherSmallInts(comm, mine ? mine->steps() + 1 : 0, timeout_s);
  std::vector<int> without;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (newest[r] == 0) without.push_back(r);
  }
  if (!without.empty()) {
    Throw(ErrorCode::kNotFound, "--resume: rank(s) {} have no valid checkpoint in {}",
          fmt::join(without, ", "), dir.string());
  }
  const int64_t step = *std::min_element(newest.begin(), newest.end()) - 1;
  if (mine->steps() != step) mine = LoadLatestCheckpoint(dir, rank, step);
  const std::vector<int64_t> have = GatherSmallInts(comm, mine ? 1 : 0, timeout_s);
  without.clear();
  for (int r = 0; r < comm.world_size(); ++r) {
    if (have[r] == 0) without.push_back(r);
  }
  if (!without.empty()) {
    Throw(ErrorCode::kNotFound,
          "--resume: the newest step every rank has is {}, but rank(s) {} have no valid "
          "checkpoint of step {} in {}",
          step, fmt::join(without, ", "), step, dir.string());
  }
  return *std::move(mine);
}

}  // namespace pipesgd::train
