// End-to-end tests of the `pipesgd` binary: the main job's accuracy with width 1 and 2, bad input
// failing with clear errors (never a crash or a hang), and the supervisor stopping a job when a
// worker dies.
// Over 600 lines: one case per command and failure a user meets, each a whole run of the binary.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <set>

#include <nlohmann/json.hpp>
#include <zlib.h>

#include "core/base/measure.h"
#include "tests/support/cli.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace pipesgd {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::RunCommand;

using testing::ExpectError;
using testing::kBinary;
using testing::kConfig;
using testing::Worker;
using TempDir = testing::CliTempDir;

const std::string kData = "/usr/share/datasets/fashion-mnist/";


std::string Gunzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  std::string out;
  char buf[65536];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) out.append(buf, n);
  gzclose(f);
  return out;
}

// --- the main job -------------------------------------------------------------------------

class MainJob : public ::testing::TestWithParam<int> {};

TEST_P(MainJob, ReachesAccuracyWithinThreeEpochs) {
  const int width = GetParam();
  TempDir dir;
  auto r = RunCommand({kBinary, "run", "-np", "4", kConfig, "--set",
                       "train.pipeline_width=" + std::to_string(width), "--out", dir.path("out")},
                      {}, 600);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] final test accuracy: "), std::string::npos) << r.out;

  std::ifstream summary_file(dir.path("out/summary.json"));
  ASSERT_TRUE(summary_file) << "no summary.json";
  auto summary = nlohmann::json::parse(summary_file);
  const double accuracy = summary.at("final_test_accuracy").get<double>();
  // Seeds 1-6 (scripts/compression_seeds.sh's "none" rows; OpenBLAS's Haswell and Cooperlake
  // kernels): width 2 reached 0.8589-0.8731, mean 0.8688, standard deviation 0.0043; width 1
  // (Haswell) 0.8564-0.8740, mean 0.8679, standard deviation 0.0064. 0.84 is 4 of width 1's
  // standard deviations below its mean: another CPU's kernels move a run as another seed does.
  EXPECT_GE(accuracy, 0.84) << "width " << width;
  EXPECT_EQ(summary.at("world_size"), 4);
  EXPECT_EQ(summary.at("details").at("pipeline_width"), width);
  EXPECT_EQ(summary.at("transport"), "tcp");
  EXPECT_EQ(summary.at("config").at("train").at("pipeline_width"), width);
  EXPECT_GT(summary.at("wall_s").get<double>(), 0);

  std::ifstream metrics(dir.path("out/metrics.jsonl"));
  std::string line;
  int epochs = 0;
  while (std::getline(metrics, line)) {
    auto m = nlohmann::json::parse(line);
    ++epochs;
    EXPECT_EQ(m.at("epoch"), epochs);
    for (const char* key : {"train_loss", "test_accuracy", "samples_per_s", "wall_s"}) {
      EXPECT_TRUE(m.contains(key)) << key;
    }
    EXPECT_GT(m.at("samples_per_s").get<double>(), 0);
  }
  EXPECT_EQ(epochs, 3);
  std::printf("width %d: final test accuracy %.4f in %.1f s\n", width, accuracy,
              summary.at("wall_s").get<double>());
}

INSTANTIATE_TEST_SUITE_P(Widths, MainJob, ::testing::Values(1, 2));

// The CNN job (configs/fashion_mnist_cnn.pbtxt), CI-sized: 4 workers, width 2, the first 20000
// training samples for 2 epochs, the first 2000 test samples. Over seeds 1-4 on oneDNN, with its
// AVX-512 kernels and with ONEDNN_MAX_CPU_ISA=AVX2 (8 runs, 2026-12-07;
// docs/results/compression_seeds.md): 0.8300-0.8605, mean 0.8488, standard deviation 0.0118;
// seed 1, the one run here, 0.8305 and 0.8300. Another CPU's kernels move a run as another seed
// does, so the bound is 4 standard deviations below the mean: 0.80. The full job (60000 samples, 4 epochs) reaches 0.8976
// on oneDNN and 0.8967 on OpenBLAS (`pipesgd run -np 4 configs/fashion_mnist_cnn.pbtxt`, with
// `--set model.kernels=OPENBLAS`), too long for CI.
TEST(CnnJob, CiSizedRunReachesAccuracy) {
  TempDir dir;
  const std::string config = std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_cnn.pbtxt";
  auto r = RunCommand({kBinary, "run", "-np", "4", config, "--set", "data.train_limit=20000",
                       "--set", "data.test_limit=2000", "--set", "train.epochs=2", "--set",
                       "train.progress_per_epoch=0", "--out", dir.path("out")},
                      {}, 600);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("conv2d(1x28x28->16x28x28, k5 s1 p2)"), std::string::npos) << r.out;
  // Each rank names its convolution library; oneDNN's OpenMP team is one thread per rank, as
  // `pipesgd run` sets OMP_NUM_THREADS=1 where it is unset (as torchrun does).
  const std::string kernels = "model.kernels = AUTO: convolutions and pooling on ";
  const size_t at = r.out.find(kernels);
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
  const bool onednn = line.find("onednn") != std::string::npos;
  if (onednn) {
    EXPECT_NE(line.find("OpenMP, 1 thread(s)"), std::string::npos) << line;
  }
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    EXPECT_NE(r.out.find("OMP_NUM_THREADS=1"), std::string::npos) << "the launcher's notice";
  }
  std::ifstream summary_file(dir.path("out/summary.json"));
  ASSERT_TRUE(summary_file) << "no summary.json";
  auto summary = nlohmann::json::parse(summary_file);
  // The library that ran, not the field as written (AUTO).
  EXPECT_EQ(summary.at("kernels"), onednn ? "onednn" : "openblas");
  const double accuracy = summary.at("final_test_accuracy").get<double>();
  EXPECT_GE(accuracy, 0.80);
  EXPECT_EQ(summary.at("details").at("pipeline_width"), 2);
  EXPECT_EQ(summary.at("world_size"), 4);
  std::printf("cnn (CI-sized): final test accuracy %.4f in %.1f s\n", accuracy,
              summary.at("wall_s").get<double>());
}

// The main job with compression, width 2, same seed and epochs: the wire carries 2x (trunc16),
// ~4x (q8), ~7.5x (q4), ~28x (sign1) or ~35x (PowerSGD rank 4) fewer bytes, and the final test
// accuracy stays within what the spread over seeds allows. Another CPU's floating-point kernels
// move a run's digits as another seed does (OpenBLAS's Haswell and Cooperlake kernels give
// 0.8705 and 0.8722 uncompressed for seed 1), so the bounds come from that spread
// (scripts/compression_seeds.sh, seeds 1-6 with each of those two kernels, 12 runs per setting;
// docs/compression.md): trunc16, q8 and q4 with error feedback and PowerSGD rank 4 landed
// -0.0076..+0.0037 from the uncompressed run of the same seed, mean -0.0004, standard deviation
// 0.0026: within 1 point, about 4 standard deviations. sign1 with error feedback costs accuracy
// on this model: 2.03 points on average (0.33 to 3.41, standard deviation 0.88): within 5
// points, 3.4 standard deviations past its mean.
TEST(CompressedMainJob, AccuracyWithinTheSpreadOverSeedsOfUncompressed) {
  struct Run {
    std::vector<std::string> sets;
    double accuracy = 0;
    double ratio = 0;
  };
  std::vector<Run> runs = {{{"comm.compression=none"}},
                           {{"comm.compression=trunc16"}},
                           {{"comm.compression=q8", "comm.error_feedback=true"}},
                           {{"comm.compression=q4", "comm.error_feedback=true"}},
                           {{"comm.compression=sign1", "comm.error_feedback=true"}},
                           {{"comm.powersgd_rank=4"}}};
  for (Run& run : runs) {
    TempDir dir;
    std::vector<std::string> argv = {kBinary, "run", "-np", "4", kConfig, "--out", dir.path("out")};
    for (const auto& s : run.sets) {
      argv.push_back("--set");
      argv.push_back(s);
    }
    auto r = RunCommand(argv, {}, 600);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    std::ifstream summary_file(dir.path("out/summary.json"));
    auto summary = nlohmann::json::parse(summary_file);
    run.accuracy = summary.at("final_test_accuracy").get<double>();
    EXPECT_EQ(summary.at("details").at("saturated_elements"), 0);
    std::ifstream metrics(dir.path("out/metrics.jsonl"));
    std::string line;
    while (std::getline(metrics, line)) {
      run.ratio = nlohmann::json::parse(line).at("compression_ratio").get<double>();
    }
    std::printf("%s: final test accuracy %.4f, compression %.3fx\n", run.sets[0].c_str(),
                run.accuracy, run.ratio);
  }
  EXPECT_EQ(runs[0].ratio, 1.0);
  // trunc16 halves every gradient byte; only the loss element (the exact tail) stays float32.
  EXPECT_NEAR(runs[1].ratio, 2.0, 1e-4);
  // q8: 4n bytes become 8 + n per chunk (n <= 2^18 elements per 1 MiB chunk).
  EXPECT_GT(runs[2].ratio, 3.99);
  EXPECT_LT(runs[2].ratio, 4.0);
  // q4: 4n bytes become 8 per 256 + n/2; sign1 4 per 256 + n/8 (7.529x and 28.44x for whole
  // groups; each chunk's last group is shorter).
  EXPECT_NEAR(runs[3].ratio, 1048576.0 / 139264, 0.01);
  EXPECT_NEAR(runs[4].ratio, 1048576.0 / 36864, 0.05);
  // PowerSGD rank 4: (256 + 784) 4 + (128 + 256) 4 + (10 + 128) 4 floats and 394 biases + the
  // loss against 235146 + 1, over two collectives of the 4-rank ring.
  EXPECT_GT(runs[5].ratio, 30);
  for (size_t i = 1; i < runs.size(); ++i) {
    const double tolerance = runs[i].sets[0] == "comm.compression=sign1" ? 0.05 : 0.01;
    EXPECT_NEAR(runs[i].accuracy, runs[0].accuracy, tolerance) << runs[i].sets[0];
  }
}

// --- bad input -----------------------------------------------------------------------------

TEST(BadInput, HtmlPageAsImages) {
  TempDir dir;
  auto html = dir.File("train.gz", "<!DOCTYPE html><html><body>404 Not Found</body></html>\n");
  ExpectError(Worker({"data.train_images=" + html}), {html, "not an IDX file", "<!DO"});
}

TEST(BadInput, WrongMagic) {
  TempDir dir;
  std::string bytes = Gunzip(kData + "train-images-idx3-ubyte.gz").substr(0, 16 + 784);
  bytes[2] = 0x0d;  // element type float instead of unsigned byte
  auto path = dir.File("images", bytes);
  ExpectError(Worker({"data.train_images=" + path}), {path, "0x"});
}

TEST(BadInput, LabelsFileGivenAsImages) {
  ExpectError(Worker({"data.train_images=" + kData + "train-labels-idx1-ubyte.gz"}),
              {"train-labels-idx1-ubyte.gz", "labels"});
}

TEST(BadInput, TruncatedFile) {
  TempDir dir;
  std::string bytes = Gunzip(kData + "t10k-images-idx3-ubyte.gz");
  auto path = dir.File("truncated", bytes.substr(0, bytes.size() / 2));
  ExpectError(Worker({"data.test_images=" + path}), {path, std::to_string(bytes.size())});
}

TEST(BadInput, TenImagesNineLabels) {
  TempDir dir;
  std::string images = Gunzip(kData + "t10k-images-idx3-ubyte.gz").substr(0, 16 + 10 * 784);
  images[4] = images[5] = images[6] = 0;
  images[7] = 10;
  std::string labels = Gunzip(kData + "t10k-labels-idx1-ubyte.gz").substr(0, 8 + 9);
  labels[4] = labels[5] = labels[6] = 0;
  labels[7] = 9;
  auto ipath = dir.File("images", images);
  auto lpath = dir.File("labels", labels);
  ExpectError(Worker({"data.test_images=" + ipath, "data.test_labels=" + lpath}),
              {ipath, lpath, "10 images", "9 labels"});
}

TEST(BadInput, UnknownConfigField) {
  TempDir dir;
  auto config = dir.File("job.pbtxt", "train {\n  batch_size: 8\n  pipeline_widht: 2\n}\n");
  ExpectError(Worker({}, config), {config + ":3:3", "pipeline_widht"});
}

TEST(BadInput, WidthOutOfRange) {
  TempDir dir;
  auto config = dir.File("job.pbtxt", "model { layers { linear { out_features: 10 } } }\n"
                                      "train {\n  pipeline_width: 17\n}\n");
  ExpectError(Worker({}, config), {config + ":3:", "pipeline_width", "[1, 16]"});
}

TEST(BadInput, WidthOutOfRangeOnTheCommandLineOfRun) {
  // The launcher checks the config before starting any worker: one clear error, no [rank] noise.
  auto r = RunCommand({kBinary, "run", "-np", "4", kConfig, "--set", "train.pipeline_width=17"});
  ExpectError(r, {"--set train.pipeline_width=17", "0 (auto) or an integer in [1, 16]"});
  EXPECT_EQ(r.out.find("[rank"), std::string::npos) << r.out;
}

TEST(BadInput, BadEnvironment) {
  auto r = RunCommand({kBinary, "worker", kConfig}, {{"RANK", "4"}, {"WORLD_SIZE", "4"}});
  ExpectError(r, {"RANK='4'", "[0, WORLD_SIZE=4)"});
  r = RunCommand({kBinary, "worker", kConfig}, {{"RANK", "0"}});
  ExpectError(r, {"WORLD_SIZE"});
}

TEST(BadInput, EveryRankReportsDataErrorsThroughRun) {
  TempDir dir;
  auto html = dir.File("t.html", "<html>nope</html>");
  auto r = RunCommand({kBinary, "run", "-np", "2", kConfig, "--set", "data.train_images=" + html});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("not an IDX file"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("failed: rank"), std::string::npos) << r.out << r.err;
}

// Regression: a 10x10 test set with a 28x28 training set used to crash a worker (SIGSEGV).
TEST(BadInput, TestImagesOfAnotherShape) {
  TempDir dir;
  std::string images(16 + 10 * 100, '\x7f');
  const unsigned char header[16] = {0, 0, 8, 3, 0, 0, 0, 10, 0, 0, 0, 10, 0, 0, 0, 10};
  images.replace(0, 16, reinterpret_cast<const char*>(header), 16);
  std::string labels = Gunzip(kData + "t10k-labels-idx1-ubyte.gz").substr(0, 8 + 10);
  labels[4] = labels[5] = labels[6] = 0;
  labels[7] = 10;
  auto ipath = dir.File("images", images);
  auto lpath = dir.File("labels", labels);
  ExpectError(Worker({"data.test_images=" + ipath, "data.test_labels=" + lpath}),
              {ipath, "10x10", "28x28"});
}

TEST(BadInput, HugeModelIsRefusedBeforeAllocating) {
  ExpectError(Worker({"model.layers[4].linear.out_features=2000000000"}),
              {"parameters", "GiB", "more than this machine's"});
}

TEST(BadInput, ImagesOfAnotherShapeThanTheModelInput) {
  ExpectError(Worker({"model.input_height=32"}),
              {"model.input_channels x input_height x input_width = 1x32x28", "expected 1x28x28",
               "train-images-idx3-ubyte.gz"});
  ExpectError(Worker({"model.input_channels=3"}), {"= 3x28x28", "one channel"});
}

// Every training mode checks the images against the model's input before it builds anything
// (the SDPipe, pipeline and parameter-server workers once skipped the check).
TEST(BadInput, ImagesOfAnotherShapeThanTheModelInputInEveryMode) {
  const std::string pipeline =
      std::string(PIPESGD_SOURCE_DIR) + "/configs/fashion_mnist_mlp_pipeline.pbtxt";
  const std::vector<std::pair<std::vector<std::string>, std::string>> modes = {
      {{"run", "-np", "2", kConfig, "--set", "train.mode=SDPIPE"}, "SDPIPE"},
      {{"run", "-np", "2", kConfig, "--set", "train.mode=PS_SYNC"}, "PS_SYNC"},
      {{"run", "-np", "4", pipeline}, "pipeline stages"}};
  for (const auto& [args, name] : modes) {
    SCOPED_TRACE(name);
    std::vector<std::string> argv = {kBinary};
    argv.insert(argv.end(), args.begin(), args.end());
    for (const char* set : {"model.input_height=32", "train.max_steps=5"}) {
      argv.push_back("--set");
      argv.push_back(set);
    }
    auto r = RunCommand(argv, {}, 120);
    EXPECT_FALSE(r.timed_out);
    EXPECT_NE(r.exit_code, 0);
    for (const char* needle : {"model.input_channels x input_height x input_width = 1x32x28",
                               "expected 1x28x28", "train-images-idx3-ubyte.gz"}) {
      EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr lacks '" << needle << "':\n"
                                                       << r.err;
    }
  }
}

TEST(BadInput, OutputDirectoryInUseByAnotherJob) {
  TempDir dir;
  fs::create_directories(dir.path("out"));
  int fd = open(dir.path("out/.pipesgd.lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_EQ(flock(fd, LOCK_EX | LOCK_NB), 0);
  ExpectError(RunCommand({kBinary, "worker", kConfig, "--set", "train.max_steps=5", "--out",
                          dir.path("out")}),
              {"another pipesgd job is writing to this directory"});
  close(fd);
}

TEST(BadInput, OutputPathIsAFile) {
  TempDir dir;
  auto file = dir.File("afile", "x");
  ExpectError(RunCommand({kBinary, "run", "-np", "2", kConfig, "--out", file}),
              {"--out " + file, "cannot create the directory"});
}

// Ranks started by hand with different settings must not train different models silently.
TEST(BadInput, WorkersWithDifferentConfigsAreRejectedAtRendezvous) {
  const std::string port = std::to_string(20000 + getpid() % 10000);
  auto start = [&](int rank, const std::string& width, const std::string& out) {
    pid_t pid = fork();
    if (pid == 0) {
      freopen(out.c_str(), "w", stderr);
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", "2", 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      execl(kBinary.c_str(), kBinary.c_str(), "worker", kConfig.c_str(), "--set",
            ("train.pipeline_width=" + width).c_str(), "--set", "comm.start_timeout_s=20",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    return pid;
  };
  TempDir dir;
  pid_t r0 = start(0, "2", dir.path("err0"));
  pid_t r1 = start(1, "1", dir.path("err1"));
  for (auto [pid, file] : {std::pair{r0, dir.path("err0")}, std::pair{r1, dir.path("err1")}}) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1);
    std::ifstream f(file);
    std::string err((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_NE(err.find("rank 1 (from 127.0.0.1:"), std::string::npos) << err;
    EXPECT_NE(err.find("different job than rank 0: in train: rank 1 has `pipeline_width: 1`, "
                       "rank 0 has `pipeline_width: 2`"),
              std::string::npos)
        << err;
  }
}

// --- transports ----------------------------------------------------------------------------

#ifdef PIPESGD_HAVE_UCX
// The same short job over UCX and over TCP: the ring reduces in the same order whatever moves
// the bytes, so accuracy and losses are bitwise the same.
TEST(Transports, UcxTrainsToTheSameAccuracyAsTcp) {
  struct Run {
    std::string transport;
    double accuracy = 0;
    std::vector<double> losses;
  };
  std::vector<Run> runs = {{"tcp", 0, {}}, {"ucx", 0, {}}};
  for (Run& run : runs) {
    TempDir dir;
    auto r = RunCommand({kBinary, "run", "-np", "4", kConfig, "--set", "train.max_steps=300",
                         "--set", "comm.transport=" + run.transport, "--out", dir.path("out")},
                        {}, 300);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    std::ifstream summary_file(dir.path("out/summary.json"));
    auto summary = nlohmann::json::parse(summary_file);
    EXPECT_EQ(summary.at("transport"), run.transport);
    EXPECT_EQ(summary.at("steps"), 300);
    run.accuracy = summary.at("final_test_accuracy").get<double>();
    std::ifstream metrics(dir.path("out/metrics.jsonl"));
    std::string line;
    while (std::getline(metrics, line)) {
      const auto m = nlohmann::json::parse(line);
      run.losses.push_back(m.at("train_loss").get<double>());
      run.losses.push_back(m.at("test_loss").get<double>());
    }
    std::printf("%s: final test accuracy %.4f after 300 steps\n", run.transport.c_str(), run.accuracy);
  }
  EXPECT_EQ(runs[1].accuracy, runs[0].accuracy);  // to the bit, hence to 4 decimals
  EXPECT_EQ(runs[1].losses, runs[0].losses);
  EXPECT_GT(runs[0].accuracy, 0.7);
}

// auto on a host without RDMA picks UCX, and every rank says so and why.
TEST(Transports, AutoChoosesTcpHereAndEveryRankLogsWhy) {
  auto r = RunCommand({kBinary, "bench", "allreduce", "--np", "3", "--transport", "auto", "-b",
                       "64K", "-e", "64K", "-n", "2", "-w", "1", "-c"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  if (r.out.find("AUTO chose ibverbs") != std::string::npos) GTEST_SKIP() << "this host has RDMA";
  for (int rank = 0; rank < 3; ++rank) {
    const std::string line = fmt::format(
        "# rank {}: comm.transport = AUTO chose tcp: no RDMA device (ibv_get_device_list "
        "found none); tcp: faster than UCX over TCP",
        rank);  // the bench's log lines are comments
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  }
  EXPECT_NE(r.out.find("3 ranks, tcp x 1 stream"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\n       65536         16384     float     sum      -1 "), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("float     sum", r.out.find("float     sum") + 1), std::string::npos);
}
#endif

TEST(Transports, TransportNamesInAnyCaseOnTheCommandLine) {
  auto r = Worker({"comm.transport=tcp", "data.train_limit=320"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = Worker({"comm.transport=Tcp", "data.train_limit=320"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  r = Worker({"comm.transport=rdma"});
  ExpectError(r, {"--set comm.transport=rdma: expected one of TCP, UCX, IBVERBS, AUTO"});
}

TEST(Transports, BadInterfaceFilterIsRejectedWhereItWasGiven) {
  ExpectError(Worker({"comm.network_interface=eth0,,lo"}),
              {"--set comm.network_interface=eth0,,lo: comm.network_interface = 'eth0,,lo': an "
               "empty entry"});
}

// Interface selection on a real 2-rank job: the environment variable is honoured and logged,
// and a filter that admits nothing fails on every rank, naming the interfaces there are.
TEST(Transports, SocketIfnameEnvironmentVariable) {
  // -v: the reason for the interface is a debug line.
  auto r = RunCommand({kBinary, "run", "-np", "2", "-v", kConfig, "--set", "train.max_steps=2",
                       "--set", "data.train_limit=640", "--set", "data.test_limit=100"},
                      {{"PIPESGD_SOCKET_IFNAME", "=lo"}}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string line = fmt::format(
        "[rank {}] debug: rank {}: tcp on lo 127.0.0.1 (on the subnet 127.0.0.0/8 of the rendezvous "
        "address 127.0.0.1 among those PIPESGD_SOCKET_IFNAME = '=lo' admits)",
        rank, rank);
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  }
  r = RunCommand({kBinary, "run", "-np", "2", kConfig, "--set", "train.max_steps=2"},
                 {{"PIPESGD_SOCKET_IFNAME", "nosuchif"}}, 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("PIPESGD_SOCKET_IFNAME = 'nosuchif' admits none of this host's "
                       "interfaces (lo 127.0.0.1/8"),
            std::string::npos)
      << r.err;
}

#ifdef PIPESGD_HAVE_IBVERBS
TEST(Transports, IbverbsWithoutADeviceFailsClearly) {
  auto r = RunCommand({kBinary, "info"});
  ASSERT_EQ(r.exit_code, 0);
  if (r.out.find("RDMA devices and ports seen: none") == std::string::npos) {
    GTEST_SKIP() << "this host has RDMA devices";
  }
  r = RunCommand({kBinary, "run", "-np", "2", kConfig, "--set", "comm.transport=IBVERBS",
                  "--set", "comm.start_timeout_s=10"},
                 {}, 60);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("no RDMA device found (ibv_get_device_list returned none"),
            std::string::npos)
      << r.err;
}
#endif

TEST(Cli, InfoPrintsTheBuildsCapabilities) {
  auto r = RunCommand({kBinary, "info"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* needle : {"pipesgd 0.1.0\ntransports:\n  tcp: built in", "  ucx: ",
                             "  ibverbs: ", "  GPUDirect RDMA: ", "  RLIMIT_MEMLOCK: ",
                             "comm.transport = AUTO picks: ",
                             "network interfaces (up, IPv4 then IPv6): lo 127.0.0.1/8",
                             "CUDA: ", "BLAS: OpenBLAS", "\nthreads: "}) {
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle << "\n" << r.out;
  }
}

// --- supervision ---------------------------------------------------------------------------

std::vector<pid_t> Children(pid_t parent) {
  std::ifstream f("/proc/" + std::to_string(parent) + "/task/" + std::to_string(parent) +
                  "/children");
  std::vector<pid_t> pids;
  pid_t p;
  while (f >> p) pids.push_back(p);
  return pids;
}

int RankOf(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string env((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::stringstream ss(env);
  std::string var;
  while (std::getline(ss, var, '\0')) {
    if (var.rfind("RANK=", 0) == 0) return std::stoi(var.substr(5));
  }
  return -1;
}

TEST(Supervisor, KilledWorkerStopsTheJobAndIsNamed) {
  TempDir dir;
  const std::string out = dir.path("stdout");
  const std::string err = dir.path("stderr");
  pid_t run = fork();
  if (run == 0) {
    freopen(out.c_str(), "w", stdout);
    freopen(err.c_str(), "w", stderr);
    execl(kBinary.c_str(), kBinary.c_str(), "run", "-np", "3", kConfig.c_str(), "--set",
          "train.epochs=100", static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait for the three workers to be training.
  std::vector<pid_t> workers;
  for (int i = 0; i < 300 && workers.size() < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    workers = Children(run);
  }
  ASSERT_EQ(workers.size(), 3u);
  std::this_thread::sleep_for(std::chrono::seconds(3));
  pid_t victim = -1;
  for (pid_t w : workers) {
    if (RankOf(w) == 1) victim = w;
  }
  ASSERT_GT(victim, 0);
  const auto killed_at = std::chrono::steady_clock::now();
  kill(victim, SIGKILL);

  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(run, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - killed_at < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (done == 0) {
    kill(run, SIGKILL);
    for (pid_t w : workers) kill(w, SIGKILL);
    waitpid(run, &status, 0);
    FAIL() << "pipesgd run did not stop within 30 s of a worker's death";
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  EXPECT_LT(took, 15);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 0);
  std::ifstream e(err);
  std::string errors((std::istreambuf_iterator<char>(e)), std::istreambuf_iterator<char>());
  EXPECT_NE(errors.find("rank 1 (pid " + std::to_string(victim) + ") was killed by signal 9"),
            std::string::npos)
      << errors;
  // Every worker is gone (reaped by the launcher).
  for (pid_t w : workers) EXPECT_NE(kill(w, 0), 0) << "worker " << w << " still exists";
}

// Regression: workers used to outlive a launcher killed with SIGKILL.
TEST(Supervisor, WorkersStopWhenTheLauncherDies) {
  pid_t run = fork();
  if (run == 0) {
    freopen("/dev/null", "w", stdout);
    execl(kBinary.c_str(), kBinary.c_str(), "run", "-np", "2", kConfig.c_str(), "--set",
          "train.epochs=100", static_cast<char*>(nullptr));
    _exit(127);
  }
  std::vector<pid_t> workers;
  for (int i = 0; i < 300 && workers.size() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    workers = Children(run);
  }
  ASSERT_EQ(workers.size(), 2u);
  kill(run, SIGKILL);
  waitpid(run, nullptr, 0);
  // Orphans are re-parented to init, which reaps them: poll until their /proc entries go.
  for (pid_t w : workers) {
    bool gone = false;
    for (int i = 0; i < 100 && !gone; ++i) {
      gone = !fs::exists("/proc/" + std::to_string(w));
      if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!gone) kill(w, SIGKILL);
    EXPECT_TRUE(gone) << "worker " << w << " outlived its launcher by 10 s";
  }
}

TEST(Cli, ProgressLinesPerEpochAsConfigured) {
  auto r = RunCommand({kBinary, "worker", kConfig, "--set", "data.train_limit=1600", "--set",
                       "train.epochs=1", "--set", "train.progress_per_epoch=4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  size_t lines = 0;
  for (size_t at = r.out.find("epoch 1/1 step"); at != std::string::npos;
       at = r.out.find("epoch 1/1 step", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 4u) << r.out;
}

TEST(Cli, UnknownSubcommandIsAUsageError) {
  auto r = RunCommand({kBinary, "bogus"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("unknown subcommand 'bogus'"), std::string::npos) << r.err;
  r = RunCommand({kBinary, "run", "-np", "0", kConfig});
  EXPECT_EQ(r.exit_code, 2) << r.err;
}

TEST(Bench, AllReduceTableInTheNcclTestsConvention) {
  TempDir dir;
  auto r = RunCommand({kBinary, "bench", "allreduce", "-np", "3", "-b", "4K", "-e", "64K", "-f",
                       "4", "-n", "3", "-w", "1", "-c", "--link-gbps", "10", "--json",
                       dir.path("rows.json")});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // all_reduce_perf's header and footer (tests/bench_output_test.sh parses the whole table).
  for (const char* line :
       {"#       size         count      type   redop    root     time   algbw   busbw  #wrong"
        "     time   algbw   busbw  #wrong  %link  %link\n",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)",
        "out-of-place", "in-place", "\n# Out of bounds values : 0 OK\n# Avg bus bandwidth    : "}) {
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  }
  EXPECT_EQ(r.out.find("[rank"), std::string::npos) << "bench lines carry no rank prefix\n" << r.out;
  std::ifstream f(dir.path("rows.json"));
  auto rows = nlohmann::json::parse(f);
  ASSERT_EQ(rows.size(), 3u);  // 4 KiB, 16 KiB, 64 KiB
  const uint64_t sizes[] = {4096, 16384, 65536};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(rows[i].at("size_bytes"), sizes[i]);
    EXPECT_EQ(rows[i].at("count"), sizes[i] / 4);
    EXPECT_EQ(rows[i].at("ranks"), 3);
    for (const char* kind : {"out_of_place", "in_place"}) {
      const auto& m = rows[i].at(kind);
      EXPECT_EQ(m.at("wrong"), 0) << kind;
      // busbw = algbw * 2(n-1)/n, algbw = bytes / time.
      EXPECT_NEAR(m.at("busbw_gbs").get<double>(), m.at("algbw_gbs").get<double>() * 4.0 / 3.0, 1e-9);
      EXPECT_NEAR(m.at("algbw_gbs").get<double>(),
                  sizes[i] / (m.at("time_us").get<double>() * 1e-6) / 1e9, 1e-6);
      EXPECT_NEAR(m.at("busbw_link_share").get<double>(), m.at("busbw_gbs").get<double>() * 8 / 10, 1e-9);
    }
  }
}

TEST(Bench, CompressionColumnsAndBounds) {
  TempDir dir;
  auto r = RunCommand({kBinary, "bench", "allreduce", "-np", "3", "-b", "256K", "-e", "1M", "-f",
                       "4", "-n", "2", "-w", "1", "-c", "--compression", "trunc16", "--json",
                       dir.path("rows.json")});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("compression trunc16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("#wrong     none  speedup\n"), std::string::npos) << r.out;
  std::ifstream f(dir.path("rows.json"));
  auto rows = nlohmann::json::parse(f);
  ASSERT_EQ(rows.size(), 2u);
  for (const auto& row : rows) {
    EXPECT_EQ(row.at("compression"), "trunc16");
    // Compressed passes are within N times the codec's bound; the uncompressed one exact.
    EXPECT_EQ(row.at("out_of_place").at("wrong"), 0);
    EXPECT_EQ(row.at("in_place").at("wrong"), 0);
    EXPECT_EQ(row.at("in_place_uncompressed").at("wrong"), 0);
    // In place gives bitwise what out of place gave, and every rank holds the same bits.
    EXPECT_EQ(row.at("in_place").at("differs_from_out_of_place"), 0);
    for (const char* pass : {"out_of_place", "in_place", "in_place_uncompressed"}) {
      EXPECT_TRUE(row.at(pass).at("same_bits_on_every_rank").get<bool>()) << pass;
    }
    EXPECT_NEAR(row.at("speedup_over_none").get<double>(),
                row.at("in_place_uncompressed").at("time_us").get<double>() /
                    row.at("in_place").at("time_us").get<double>(),
                1e-9);
  }
  EXPECT_NE(RunCommand({kBinary, "bench", "allreduce", "--compression", "q2"}).exit_code, 0);
}

// Every comm field is settable in the bench as in a job, with the job's rules and messages;
// --set comes after the flags that stand for comm fields.
TEST(Bench, CommFieldsBySetAsInAJob) {
  TempDir dir;
  auto r = RunCommand({kBinary, "bench", "allreduce", "-np", "2", "-b", "64K", "-e", "64K", "-n",
                       "2", "-w", "1", "--streams", "1", "--set", "comm.streams=2", "--set",
                       "comm.chunk_bytes=16384", "--json", dir.path("rows.json")});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("x 2 stream(s) per neighbour, chunk 16384 B"), std::string::npos) << r.out;
  std::ifstream f(dir.path("rows.json"));
  auto rows = nlohmann::json::parse(f);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].at("streams"), 2);
  EXPECT_EQ(rows[0].at("out_of_place").at("wrong"), 0);

  // Named before any rank starts.
  r = RunCommand({kBinary, "bench", "allreduce", "-np", "2", "--set", "comm.timeout_s=0"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--set comm.timeout_s=0: comm.timeout_s = 0: expected a finite number > 0"),
            std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("rank 0"), std::string::npos) << r.err;
  r = RunCommand({kBinary, "bench", "allreduce", "--set", "train.epochs=2"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--set train.epochs=2: only comm.* fields apply here"), std::string::npos)
      << r.err;
  // Error feedback: a call carries the previous call's residual, so there is no per-call bound
  // to check; times only.
  r = RunCommand({kBinary, "bench", "allreduce", "--compression", "q8", "--set",
                  "comm.error_feedback=true"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("-c 1 with comm.error_feedback"), std::string::npos) << r.err;
  r = RunCommand({kBinary, "bench", "allreduce", "-np", "2", "-b", "64K", "-e", "64K", "-n", "2",
                  "-w", "1", "-c", "0", "--compression", "q8", "--set",
                  "comm.error_feedback=true"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("N/A"), std::string::npos) << r.out;
}

// One meaning per flag across subcommands: -np counts ranks everywhere, -n is only bench's
// iterations (as in nccl-tests).
TEST(Cli, NpCountsRanksEverywhereAndNIsOnlyBenchIterations) {
  auto r = RunCommand({kBinary, "run", "-n", "2", kConfig});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("not expected"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("-n"), std::string::npos) << r.err;
  EXPECT_EQ(RunCommand({kBinary, "probe", "-n", "2", kConfig}).exit_code, 2);
  r = RunCommand({kBinary, "bench", "allreduce", "-np", "2", "-b", "4K", "-e", "4K", "-n",
                       "3", "-w", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("iters: 3"), std::string::npos) << r.out;
}

TEST(Cli, HelpListsSubcommands) {
  auto r = RunCommand({kBinary, "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("run"), std::string::npos);
  EXPECT_NE(r.out.find("worker"), std::string::npos);
  r = RunCommand({kBinary, "run", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--set"), std::string::npos);
  EXPECT_NE(r.out.find("--out"), std::string::npos);
}

}  // namespace
}  // namespace pipesgd
