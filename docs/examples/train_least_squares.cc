// Width-2 Pipe-SGD (Li et al., NeurIPS 2018) on a model defined here, not in pipesgd:
// least squares  min_w  1/(2n) |X w - y|^2  with X (n x 4) generated from a fixed seed and
// y = X w*, w* = (1, -2, 3, 0.5), so w* is the exact solution. Each rank holds its own n/W rows
// and computes its local gradient X_r^T (X_r w - y_r) / n_r; pipesgd averages it over the ranks
// (one step stale, K = 2) and the update w -= lr * G is ours. Run one process per rank:
//   MASTER_PORT=29513 WORLD_SIZE=2 RANK=r ./train_least_squares   (r = 0, 1)
// Passes (exit 0) when max_i |w_i - w*_i| < 1e-3 after 400 steps and the loss fell below 1e-6.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
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

int main() {
  try {
    // Rank, world size and rendezvous from pipesgd run, torchrun, srun or mpirun.
    auto comm = pipesgd::Connect(pipesgd::ConnectOptionsFromEnv());
    const int w = comm->world_size(), r = comm->rank();
    const int n = 512, begin = n * r / w, end = n * (r + 1) / w, rows = end - begin;
    const std::vector<float> x = Rows(begin, end);
    std::vector<float> y(rows);
    for (int i = 0; i < rows; ++i) {
      for (int j = 0; j < kDim; ++j) y[i] += x[i * kDim + j] * kTrue[j];
    }

    // The caller's model: gradient of 1/(2 n_r) |X_r w - y_r|^2 into `grad`, local loss returned.
    pipesgd::FunctionObjective objective(
        kDim, [&](int64_t, std::span<const float> params, std::span<float> grad) {
          for (float& g : grad) g = 0;
          double loss = 0;
          for (int i = 0; i < rows; ++i) {
            float residual = -y[i];
            for (int j = 0; j < kDim; ++j) residual += x[i * kDim + j] * params[j];
            for (int j = 0; j < kDim; ++j) grad[j] += residual * x[i * kDim + j] / rows;
            loss += 0.5 * residual * residual / rows;
          }
          return static_cast<float>(loss);
        });
    // The caller's update rule on the rank-averaged gradient.
    auto sgd = pipesgd::PlainSgd(0.5f);

    std::vector<float> params(kDim, 0.0f);  // identical start on every rank
    const std::vector<float> losses =
        pipesgd::Train(*comm, objective, sgd, params, /*steps=*/400, /*pipeline_width=*/2);

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
