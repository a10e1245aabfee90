// Width-2 Pipe-SGD (Li et al., NeurIPS 2018) on a model defined here, not in pipesgd:
// least squares  min_w  1/(2n) |X w - y|^2  with X (n x 4) generated from a fixed seed and
// y = X w*, w* = (1, -2, 3, 0.5), so w* is the exact solution. Each rank holds its own n/W rows
// and computes its local gradient X_r^T (X_r w - y_r) / n_r; pipesgd averages it over the ranks
// (one step stale, K = 2) and the update w -= lr * G is ours. Rank 0 draws the starting point
// and Broadcast gives every rank its exact bits. Run one process per rank, from a launcher's
// environment:
//   MASTER_PORT=29513 WORLD_SIZE=2 RANK=r ./train_least_squares   (r = 0, 1)
// or on two hosts with the rendezvous given by hand (nothing else: each rank listens on its
// interface toward the master, ConnectOptions::bind_host's default):
//   hostA$ ./train_least_squares 10.0.0.1:29513 0 2       (10.0.0.1: hostA's address)
//   hostB$ ./train_least_squares 10.0.0.1:29513 1 2
// Passes (exit 0) when max_i |w_i - w*_i| < 1e-3 after 400 steps and the loss fell below 1e-6.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include <pipesgd/pipesgd.h>

namespace {

constexpr int kDim = 4;
constexpr float kTrue[kDim] = {1.0f, -2.0f, 3.0f, 0.5f};

// Rows [begin, end) of X, each entry uniform in [-1, 1) from a 64-bit LCG keyed by the row,
// so every rank regenerates exactly its own rows.
std::vector<float> Rows(int begin, int end) {
  std::vector<float> x;
  for (int row = begin; row < end; ++row) {
    uint64_t s = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(row + 1);
    for (int j = 0; j < kDim; ++j) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      x.push_back(static_cast<float>((s >> 40) * 0x1p-24) * 2.0f - 1.0f);
    }
  }
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // Rank, world size and rendezvous from pipesgd run, torchrun, srun or mpirun, or from the
    // command line: MASTER_HOST:PORT RANK WORLD_SIZE.
    pipesgd::ConnectOptions options = pipesgd::ConnectOptionsFromEnv();
    if (argc == 4) {
      const std::string master = argv[1];
      const size_t colon = master.rfind(':');
      if (colon == std::string::npos) {
        std::fprintf(stderr, "train_least_squares: %s: expected HOST:PORT\n", argv[1]);
        return 2;
      }
      options = pipesgd::ConnectOptions{};
      options.master_addr = master.substr(0, colon);
      options.master_port = static_cast<uint16_t>(std::atoi(master.c_str() + colon + 1));
      options.rank = std::atoi(argv[2]);
      options.world_size = std::atoi(argv[3]);
    } else if (argc != 1) {
      std::fprintf(stderr, "usage: train_least_squares [MASTER_HOST:PORT RANK WORLD_SIZE]\n");
      return 2;
    }
    pipesgd::Communicator comm = pipesgd::Connect(options);
    const int w = comm.world_size(), r = comm.rank();
    const int n = 512, begin = n * r / w, end = n * (r + 1) / w, rows = end - begin;
    const std::vector<float> x = Rows(begin, end);
    std::vector<float> y(rows);
    for (int i = 0; i < rows; ++i) {
      for (int j = 0; j < kDim; ++j) y[i] += x[i * kDim + j] * kTrue[j];
    }

    // The caller's model: gradient of 1/(2 n_r) |X_r w - y_r|^2 into `grad`, local loss returned.
    pipesgd::GradientFn gradient =
        [&](int64_t, std::span<const float> params, std::span<float> grad) {
          for (float& g : grad) g = 0;
          double loss = 0;
          for (int i = 0; i < rows; ++i) {
            float residual = -y[i];
            for (int j = 0; j < kDim; ++j) residual += x[i * kDim + j] * params[j];
            for (int j = 0; j < kDim; ++j) grad[j] += residual * x[i * kDim + j] / rows;
            loss += 0.5 * residual * residual / rows;
          }
          return static_cast<float>(loss);
        };

    // Every rank must start from the same parameters: rank 0's (here drawn from its own rows)
    // are broadcast, so no rank needs to know how they were made.
    std::vector<float> params(kDim, 0.0f);
    if (r == 0) params = Rows(1000 + r, 1001 + r);
    comm.Broadcast(params, /*root=*/0);
    // Width 2 with the caller's update rule on the rank-averaged gradient (plain SGD here).
    const std::vector<float> losses = pipesgd::Train(comm, params, /*steps=*/400, gradient,
                                                     pipesgd::PlainSgd(0.5f), {.pipeline_width = 2});

    float err = 0;
    for (int j = 0; j < kDim; ++j) err = std::fmax(err, std::fabs(params[j] - kTrue[j]));
    std::printf("rank %d/%d: w = (%.6f, %.6f, %.6f, %.6f), max |w - w*| = %.3g, loss %.3g -> %.3g\n",
                r, w, params[0], params[1], params[2], params[3], err, losses.front(), losses.back());
    const bool ok = err < 1e-3f && losses.back() < 1e-6f;
    if (!ok) std::fprintf(stderr, "rank %d: did not converge to w* within 1e-3\n", r);
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_least_squares: %s\n", e.what());
    return 2;
  }
}
