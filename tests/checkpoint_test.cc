// Checkpoints: the on-disk frame rejects truncated and corrupt files by name and falls back to
// the previous one; a writer killed with SIGKILL at random moments never leaves the newest
// loadable checkpoint torn; and a training run killed mid-way and resumed ends with bitwise
// the same parameters as an uninterrupted run, for width 1 (synchronous) and width 2, and for
// the outer loop, blocking and overlapped.
#include <gtest/gtest.h>

#include <signal.h>
#include <stdlib.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/train/checkpoint.h"
#include "tests/support/multiproc.h"
#include "tests/support/ring.h"
#include "tests/support/subprocess.h"

namespace pipesgd {
namespace {

namespace fs = std::filesystem;
using train::CheckpointPath;
using train::LoadLatestCheckpoint;
using train::ReadCheckpoint;
using train::WriteCheckpoint;

const std::string kBinary = PIPESGD_BINARY;
const std::string kConfig = std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_mlp.pbtxt";

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "pipesgd_ckpt_XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// A checkpoint whose every value is a function of its step, so any load can be verified.
checkpoint::Checkpoint Make(int64_t step, int rank, size_t params) {
  checkpoint::Checkpoint c;
  c.set_format_version(1);
  c.set_job("job text");
  c.set_rank(rank);
  c.set_world_size(4);
  c.set_steps(step);
  c.set_applied(step - 1);
  // Element 0 carries the step; the rest a fixed pattern (cheap to update between writes).
  c.add_params(static_cast<float>(step));
  for (size_t i = 1; i < params; ++i) c.add_params(1e-3f * static_cast<float>(i));
  c.add_optimizer_state(0.0f);
  auto* p = c.add_pending();
  p->set_step(step - 1);
  p->add_aggregate(0.5f * step);
  return c;
}

bool Matches(const checkpoint::Checkpoint& c, int64_t step, size_t params) {
  if (c.steps() != step || c.params_size() != static_cast<int>(params)) return false;
  for (size_t i = 0; i < params; ++i) {
    const float expected = i == 0 ? static_cast<float>(step) : 1e-3f * static_cast<float>(i);
    const float got = c.params(static_cast<int>(i));
    if (std::memcmp(&got, &expected, 4) != 0) return false;
  }
  return c.pending_size() == 1 && c.pending(0).aggregate(0) == 0.5f * step;
}

std::string ErrorOf(const fs::path& path) {
  try {
    ReadCheckpoint(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(CheckpointFile, RoundTripsAndKeepsTheNewest) {
  TempDir dir;
  for (int64_t step : {10, 20, 30, 40}) WriteCheckpoint(dir.path(), Make(step, 1, 1000), 2);
  // keep = 2: steps 30 and 40 remain; nothing else is in the directory.
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir.path())) files.push_back(e.path().filename());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"ckpt-000000000030.rank1", "ckpt-000000000040.rank1"}));
  auto latest = LoadLatestCheckpoint(dir.path(), 1);
  ASSERT_TRUE(latest.has_value());
  EXPECT_TRUE(Matches(*latest, 40, 1000));
  EXPECT_FALSE(LoadLatestCheckpoint(dir.path(), 0).has_value());  // another rank's: none
  auto at30 = LoadLatestCheckpoint(dir.path(), 1, 30);
  ASSERT_TRUE(at30.has_value());
  EXPECT_TRUE(Matches(*at30, 30, 1000));
}

TEST(CheckpointFile, TruncatedOrCorruptIsRejectedAndThePreviousUsed) {
  TempDir dir;
  WriteCheckpoint(dir.path(), Make(10, 0, 1000), 2);
  WriteCheckpoint(dir.path(), Make(20, 0, 1000), 2);
  const fs::path newest = CheckpointPath(dir.path(), 20, 0);
  const auto size = fs::file_size(newest);

  // Truncated: the header's length no longer matches.
  fs::resize_file(newest, size - 100);
  EXPECT_NE(ErrorOf(newest).find("truncated or padded: the header says"), std::string::npos)
      << ErrorOf(newest);
  auto loaded = LoadLatestCheckpoint(dir.path(), 0);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_TRUE(Matches(*loaded, 10, 1000));

  // One flipped byte in the payload: the checksum catches it.
  WriteCheckpoint(dir.path(), Make(20, 0, 1000), 2);
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size / 2));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(size / 2));
    c = static_cast<char>(c ^ 0x10);
    f.write(&c, 1);
  }
  EXPECT_NE(ErrorOf(newest).find("checksum mismatch"), std::string::npos) << ErrorOf(newest);
  loaded = LoadLatestCheckpoint(dir.path(), 0);
  ASSERT_TRUE(loaded.has_value());
  EXPECT_TRUE(Matches(*loaded, 10, 1000));

  // Not a checkpoint at all; shorter than a frame; missing.
  std::ofstream(newest, std::ios::trunc) << "hello, this is not a checkpoint file";
  EXPECT_NE(ErrorOf(newest).find("bad magic"), std::string::npos) << ErrorOf(newest);
  std::ofstream(newest, std::ios::trunc) << "PSGK";
  EXPECT_NE(ErrorOf(newest).find("truncated: 4 bytes"), std::string::npos) << ErrorOf(newest);
  EXPECT_NE(ErrorOf(dir.path() / "nope").find("no such file"), std::string::npos);
}

TEST(CheckpointFile, KilledWriterNeverLeavesATornNewestCheckpoint) {
  TempDir dir;
  const size_t params = 1 << 20;  // 4 MiB per file: a write takes long enough to be hit
  int64_t last_loaded = -1;
  int killed_mid_write = 0;
  for (int round = 0; round < 12; ++round) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // The child never returns into the test: an error ends it (the parent then fails).
      try {
        checkpoint::Checkpoint c = Make(1000 * (round + 1), 0, params);
        for (int64_t step = c.steps();; ++step) {
          c.set_steps(step);
          c.set_applied(step - 1);
          c.set_params(0, static_cast<float>(step));
          c.mutable_pending(0)->set_step(step - 1);
          c.mutable_pending(0)->set_aggregate(0, 0.5f * step);
          WriteCheckpoint(dir.path(), c, 2);
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "writer of round %d: %s\n", round, e.what());
      }
      _exit(1);
    }
    // Whatever ends this round (an assertion included), the writer does not outlive it.
    struct Reap {
      pid_t pid;
      ~Reap() {
        if (pid <= 0) return;
        kill(pid, SIGKILL);
        int ignored = 0;
        waitpid(pid, &ignored, 0);
      }
    } reap{child};
    // Once this round's writer has put a checkpoint in place, kill it: in odd rounds at an
    // arbitrary later moment, in even rounds in the middle of a write. How long a write lasts
    // depends on the machine's disk (a fast one left 0 of 12 arbitrary kills inside a write), so
    // an aimed kill stops the writer while its temporary file exists, checks that the stopped
    // writer still has it (only the rename removes it), and only then kills it.
    const int64_t round_start = 1000 * (round + 1);
    auto round_started = [&] {
      for (const auto& e : fs::directory_iterator(dir.path())) {
        const std::string name = e.path().filename().string();
        if (name.starts_with("ckpt-") && name.find(".tmp.") == std::string::npos &&
            std::stoll(name.substr(5, 12)) >= round_start) {
          return true;
        }
      }
      return false;
    };
    for (int i = 0; i < 3000 && !round_started(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(round_started()) << "round " << round << ": no checkpoint written in 30 s";
    const std::string tmp_suffix = ".tmp." + std::to_string(child);
    auto writing = [&] {  // this round's writer has a temporary file
      for (const auto& e : fs::directory_iterator(dir.path())) {
        if (e.path().filename().string().ends_with(tmp_suffix)) return true;
      }
      return false;
    };
    if (round % 2 == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5 + 13 * round));
    } else {
      bool stopped_mid_write = false;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!stopped_mid_write && std::chrono::steady_clock::now() < deadline) {
        if (!writing()) {
          std::this_thread::yield();  // two cores: let the writer run
          continue;
        }
        kill(child, SIGSTOP);
        int stop_status = 0;
        ASSERT_EQ(waitpid(child, &stop_status, WUNTRACED), child);
        ASSERT_TRUE(WIFSTOPPED(stop_status));
        stopped_mid_write = writing();
        if (!stopped_mid_write) kill(child, SIGCONT);
      }
      ASSERT_TRUE(stopped_mid_write) << "round " << round << ": no write caught in 30 s";
    }
    kill(child, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    reap.pid = 0;  // reaped
    ASSERT_TRUE(WIFSIGNALED(status));
    if (writing()) ++killed_mid_write;
    auto loaded = LoadLatestCheckpoint(dir.path(), 0);
    ASSERT_TRUE(loaded.has_value()) << "round " << round;
    EXPECT_TRUE(Matches(*loaded, loaded->steps(), params)) << "round " << round;
    EXPECT_GT(loaded->steps(), last_loaded) << "round " << round;
    last_loaded = loaded->steps();
  }
  std::printf("killed in the middle of a write in %d of 12 rounds\n", killed_mid_write);
  EXPECT_GE(killed_mid_write, 6);  // every aimed round, whatever the arbitrary ones hit
}

// --- resume through the CLI ------------------------------------------------------------------

struct ResumeCase {
  int width;
  bool compressed;  // q8 with stochastic rounding and error feedback: residuals and the
                    // collective sequence (it keys the rounding noise) must be restored too
  bool dropout = false;  // a dropout layer in place of the first relu: its masks are keyed by
                         // (seed, step, row), so the resumed run must draw the same ones
  // train.staleness_compensation: the default (LOCAL_GRADIENT, after 50 synchronous steps) keeps
  // this rank's own gradient of the step in flight in the checkpoint; NONE is the plain
  // recurrence.
  const char* compensation = "LOCAL_GRADIENT";
  // More of the job's settings: the outer loop's (train.local_steps 4 after the default 50
  // synchronous steps of one-step rounds: a checkpoint at the first round end at or after each
  // multiple of 30 is at steps 30, 62, 90, 122, 150, 182 and the final 200).
  std::vector<std::string> sets = {};
  const char* name = "";
};

std::vector<std::string> Job(const fs::path& ckpt_dir, const ResumeCase& c) {
  std::vector<std::string> argv = {kBinary, "run", "-np", "2", kConfig,
          "--set", "data.train_limit=3200", "--set", "train.epochs=2",
          "--set", "train.batch_size=16",
          "--set", "train.pipeline_width=" + std::to_string(c.width),
          "--set", std::string("train.staleness_compensation=") + c.compensation,
          "--set", "train.progress_per_epoch=0",
          "--set", "checkpoint.dir=" + ckpt_dir.string(), "--set", "checkpoint.every_steps=30"};
  if (c.dropout) {
    argv.push_back("--set");
    argv.push_back("model.layers[1]={ dropout { p: 0.2 } }");
  }
  for (const std::string& set : c.sets) {
    argv.push_back("--set");
    argv.push_back(set);
  }
  if (c.compressed) {
    for (const char* s : {"comm.compression=q8", "comm.stochastic_rounding=true",
                          "comm.error_feedback=true", "comm.min_bytes=0"}) {
      argv.push_back("--set");
      argv.push_back(s);
    }
  }
  return argv;
}

// Final parameters of rank `rank` from the run's final checkpoint (step 200: 2 epochs of 100).
std::vector<float> FinalParams(const fs::path& dir, int rank) {
  auto c = LoadLatestCheckpoint(dir, rank, 200);
  if (!c) return {};
  return {c->params().begin(), c->params().end()};
}

class Resume : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(Resume, AfterAKillGivesBitwiseTheSameFinalWeights) {
  const ResumeCase& param = GetParam();
  const int width = param.width;
  TempDir straight, interrupted;
  auto a = testing::RunCommand(Job(straight.path(), param), {}, 300);
  ASSERT_EQ(a.exit_code, 0) << a.out << a.err;

  // The same job, killed (launcher and workers, SIGKILL) once its checkpoint of step 90 exists.
  std::vector<std::string> argv = Job(interrupted.path(), param);
  const pid_t run = fork();
  ASSERT_GE(run, 0);
  if (run == 0) {
    setpgid(0, 0);
    std::vector<char*> args;
    for (auto& s : argv) args.push_back(s.data());
    args.push_back(nullptr);
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    execv(args[0], args.data());
    _exit(127);
  }
  const fs::path marker = CheckpointPath(interrupted.path(), 90, 1);
  for (int i = 0; i < 3000 && !fs::exists(marker); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(fs::exists(marker)) << "no checkpoint of step 90 within 30 s";
  kill(-run, SIGKILL);  // the whole process group: launcher and workers
  waitpid(run, nullptr, 0);
  EXPECT_FALSE(fs::exists(CheckpointPath(interrupted.path(), 200, 0))) << "the run finished first";

  std::vector<std::string> again = Job(interrupted.path(), param);
  again.push_back("--resume");
  auto b = testing::RunCommand(again, {}, 300);
  ASSERT_EQ(b.exit_code, 0) << b.out << b.err;
  EXPECT_NE(b.out.find("resumed from"), std::string::npos) << b.out;

  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<float> expected = FinalParams(straight.path(), rank);
    const std::vector<float> got = FinalParams(interrupted.path(), rank);
    ASSERT_EQ(expected.size(), 235146u);  // 784*256+256 + 256*128+128 + 128*10+10
    ASSERT_EQ(got.size(), expected.size());
    EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)), 0)
        << "width " << width << (param.compressed ? " q8+EF" : "")
        << (param.dropout ? " dropout" : "") << " " << param.name << " rank " << rank
        << ": resumed weights differ";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Resume,
                         ::testing::Values(ResumeCase{1, false}, ResumeCase{2, false},
                                           ResumeCase{2, true}, ResumeCase{2, false, true},
                                           ResumeCase{2, false, false, "NONE"},
                                           // The outer loop: its inner momentum carried across
                                           // rounds; overlapped, a round in flight and q8's
                                           // residual.
                                           ResumeCase{1, false, false, "LOCAL_GRADIENT",
                                                      {"train.local_steps=4"}, "outer_h4"},
                                           ResumeCase{1, true, false, "LOCAL_GRADIENT",
                                                      {"train.local_steps=4",
                                                       "train.outer_overlap=1"},
                                                      "outer_h4_overlapped"}),
                         [](const auto& param_info) {
                           const std::string c = param_info.param.compensation;
                           if (*param_info.param.name) return std::string(param_info.param.name);
                           return fmt::format("width{}{}{}{}", param_info.param.width,
                                              param_info.param.compressed ? "_q8_ef" : "",
                                              param_info.param.dropout ? "_dropout" : "",
                                              c == "NONE" ? "_no_compensation" : "");
                         });

// Writes rank `rank`'s checkpoints of `steps` into dir, each with params = {step}.
void WriteSteps(const fs::path& dir, int rank, std::initializer_list<int64_t> steps) {
  for (int64_t step : steps) {
    train::TrainerSnapshot snapshot;
    snapshot.steps = step;
    const std::vector<float> params = {static_cast<float>(step)};
    train::WriteCheckpoint(dir, train::CaptureCheckpoint({"job", rank, 3, 0, params, {}, {}},
                                                         snapshot),
                           5);
  }
}

// Each rank's agreed step, or its error's code and text.
std::vector<std::string> Agree(const fs::path& dir) {
  auto results = testing::RunRanks(3, [&](const testing::RankContext& ctx) {
    auto comm = testing::ConnectRing(ctx);
    try {
      const checkpoint::Checkpoint c = train::AgreeOnCheckpoint(*comm, dir, 30);
      return fmt::format("step {} params {}", c.steps(), c.params(0));
    } catch (const Error& e) {
      return fmt::format("{}: {}", ErrorCodeName(e.code()), e.what());
    }
  });
  std::vector<std::string> out;
  for (const auto& r : results) out.push_back(r.exit_code == 0 ? r.output : r.error);
  return out;
}

// The newest step every rank has, loaded by each rank (the ranks ahead go back to it); all
// ranks fail together, naming the ranks that lack a checkpoint.
TEST(AgreeOnCheckpoint, TheNewestStepEveryRankHasOrOneErrorOnEveryRank) {
  TempDir dir;
  const fs::path ckpt = dir.path() / "ckpt";
  WriteSteps(ckpt, 0, {10, 20});
  WriteSteps(ckpt, 1, {10, 20});
  WriteSteps(ckpt, 2, {10});
  for (const std::string& r : Agree(ckpt)) EXPECT_EQ(r, "step 10 params 10");

  TempDir other;
  const fs::path gap = other.path() / "ckpt";
  WriteSteps(gap, 0, {10, 20});
  WriteSteps(gap, 1, {20});
  WriteSteps(gap, 2, {10});
  for (const std::string& r : Agree(gap)) {
    EXPECT_EQ(r, "not found: --resume: the newest step every rank has is 10, but rank(s) 1 have "
                 "no valid checkpoint of step 10 in " + gap.string());
  }

  TempDir none;
  const fs::path missing = none.path() / "ckpt";
  WriteSteps(missing, 0, {10});
  for (const std::string& r : Agree(missing)) {
    EXPECT_EQ(r, "not found: --resume: rank(s) 1, 2 have no valid checkpoint in " +
                     missing.string());
  }
}

TEST(ResumeErrors, NoCheckpointDirOrNoCheckpointIsAClearError) {
  auto r = testing::RunCommand({kBinary, "run", "-np", "2", kConfig, "--resume"}, {}, 120);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--resume: checkpoint.dir is not set"), std::string::npos) << r.err;
  TempDir empty;
  r = testing::RunCommand({kBinary, "run", "-np", "2", kConfig, "--set",
                           "checkpoint.dir=" + empty.path().string(), "--resume"},
                          {}, 120);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("rank(s) 0, 1 have no valid checkpoint"), std::string::npos) << r.err;
}

// The checkpoint's job and this job are told apart by name (it once read "rank 1 has
// `timeout_s: 10`, rank 1 has `timeout_s: 120`").
TEST(ResumeErrors, ADifferentJobNamesTheCheckpointAndThisJob) {
  TempDir dir;
  const std::vector<std::string> base = {kBinary, "run", "-np", "2", kConfig, "--set",
                                         "data.train_limit=640", "--set", "train.epochs=1",
                                         "--set", "data.test_limit=200", "--set",
                                         "checkpoint.dir=" + dir.path().string()};
  auto first = base;
  first.insert(first.end(), {"--set", "comm.timeout_s=10"});
  auto r = testing::RunCommand(first, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto again = base;
  again.insert(again.end(), {"--set", "comm.timeout_s=120", "--resume"});
  r = testing::RunCommand(again, {}, 120);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("was written by another job: in comm: the checkpoint has `timeout_s: 10`, "
                       "this job has `timeout_s: 120`"),
            std::string::npos)
      << r.err;
}

// A write that fails on one rank of a keep-1 round (a full disk; here a directory in the way of
// its file's name) stops the job, and every rank still has the previous round's step: the
// others delete theirs only once every rank has written the new one. It once read "the newest
// step every rank has is 4, but rank(s) 0, 1, 3 have no valid checkpoint of step 4".
TEST(ResumeAfterAFailedWrite, KeepOneLeavesAStepEveryRankHas) {
  TempDir dir;
  const std::vector<std::string> job = {
      kBinary, "run", "-np", "4", kConfig, "--set", "data.train_limit=640", "--set",
      "data.test_limit=200", "--set", "train.epochs=1", "--set", "train.batch_size=16",
      "--set", "train.progress_per_epoch=0", "--set", "checkpoint.dir=" + dir.path().string(),
      "--set", "checkpoint.every_steps=4", "--set", "checkpoint.keep=1"};
  // 10 steps of global batch 64: rounds at steps 4 and 8, and the final one at 10.
  const fs::path blocker = CheckpointPath(dir.path(), 8, 2);
  fs::create_directories(blocker);
  auto r = testing::RunCommand(job, {}, 300);
  ASSERT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("rank(s) 2 could not write their checkpoint of step 8"), std::string::npos)
      << r.err;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(fs::exists(CheckpointPath(dir.path(), 4, rank))) << "rank " << rank;
  }
  fs::remove_all(blocker);

  auto again = job;
  again.push_back("--resume");
  r = testing::RunCommand(again, {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("resumed from " + CheckpointPath(dir.path(), 4, 0).string()),
            std::string::npos)
      << r.out;
  // The confirmed final round leaves one checkpoint per rank, keep = 1.
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(fs::exists(CheckpointPath(dir.path(), 10, rank))) << "rank " << rank;
    EXPECT_FALSE(fs::exists(CheckpointPath(dir.path(), 8, rank))) << "rank " << rank;
    EXPECT_FALSE(fs::exists(CheckpointPath(dir.path(), 4, rank))) << "rank " << rank;
  }
}

// A tmpfs mounted for one test, unmounted when it ends.
class TmpfsMount {
 public:
  TmpfsMount(const fs::path& at, const std::string& options) : at_(at) {
    mounted_ = ::mount("tmpfs", at.c_str(), "tmpfs", 0, options.c_str()) == 0;
    if (!mounted_) error_ = std::strerror(errno);
  }
  ~TmpfsMount() {
    if (mounted_ && ::umount(at_.c_str()) != 0) ::umount2(at_.c_str(), MNT_DETACH);
  }
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;
  bool mounted() const { return mounted_; }
  const std::string& error() const { return error_; }
  bool Remount(const std::string& options) {
    return ::mount("tmpfs", at_.c_str(), "tmpfs", MS_REMOUNT, options.c_str()) == 0;
  }

 private:
  fs::path at_;
  bool mounted_ = false;
  std::string error_;
};

// The same on a real full file system: a tmpfs of 7 files' inodes holds the first round (4 files)
// and 3 of the second round's; the fourth rank to write gets ENOSPC, whichever it is.
TEST(ResumeAfterAFailedWrite, AFullDiskKeepsAStepEveryRankHas) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a tmpfs needs root";
  TempDir dir;
  TmpfsMount tmpfs(dir.path(), "size=128m,nr_inodes=8");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here: " << tmpfs.error();
  const std::vector<std::string> job = {
      kBinary, "run", "-np", "4", kConfig, "--set", "data.train_limit=640", "--set",
      "data.test_limit=200", "--set", "train.epochs=1", "--set", "train.batch_size=16",
      "--set", "train.progress_per_epoch=0", "--set", "checkpoint.dir=" + dir.path().string(),
      "--set", "checkpoint.every_steps=4", "--set", "checkpoint.keep=1"};
  auto r = testing::RunCommand(job, {}, 300);
  ASSERT_NE(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("could not write their checkpoint of step 8"), std::string::npos) << r.err;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(fs::exists(CheckpointPath(dir.path(), 4, rank))) << "rank " << rank;
  }
  ASSERT_TRUE(tmpfs.Remount("size=128m,nr_inodes=1000")) << std::strerror(errno);
  auto again = job;
  again.push_back("--resume");
  r = testing::RunCommand(again, {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("resumed from " + CheckpointPath(dir.path(), 4, 0).string()),
            std::string::npos)
      << r.out;
}

// A checkpoint directory copied elsewhere resumes from there: its path is no part of the job's
// identity (it was: "written by another job: in checkpoint: the checkpoint has `dir: ...`").
TEST(ResumeFromAMovedDirectory, IsTheSameJob) {
  TempDir dir;
  const fs::path first = dir.path() / "first", moved = dir.path() / "moved";
  auto job = [&](const fs::path& ckpt) {
    return std::vector<std::string>{kBinary, "run", "-np", "2", kConfig, "--set",
                                    "data.train_limit=640", "--set", "train.epochs=1", "--set",
                                    "data.test_limit=200", "--set",
                                    "checkpoint.dir=" + ckpt.string()};
  };
  auto r = testing::RunCommand(job(first), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  fs::copy(first, moved, fs::copy_options::recursive);
  fs::remove_all(first);
  auto again = job(moved);
  again.push_back("--resume");
  r = testing::RunCommand(again, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("resumed from " + moved.string()), std::string::npos) << r.out;
}

// Checkpoints written before carry their directory in their job text: still the same job.
TEST(ResumeFromAMovedDirectory, AnOlderCheckpointWithItsDirectoryFits) {
  checkpoint::Checkpoint c = Make(10, 0, 3);
  const std::string head = "pipesgd x\ntrain {\n  epochs: 1\n}\ncheckpoint {\n";
  c.set_job(head + "  dir: \"/old\"\n  keep: 2\n}\n");
  const std::string job = head + "  dir: \"\"\n  keep: 2\n}\n";
  EXPECT_NO_THROW(train::CheckCheckpointFitsJob(c, "/new", job, 4, 3));
  std::string other = job;
  other.replace(other.find("keep: 2"), 7, "keep: 3");
  EXPECT_THROW(train::CheckCheckpointFitsJob(c, "/new", other, 4, 3), Error);
}

}  // namespace
}  // namespace pipesgd
