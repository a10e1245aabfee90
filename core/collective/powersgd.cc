#include "core/collective/powersgd.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/base/check.h"
#include "core/base/error.h"

namespace pipesgd::collective {
namespace {

// Standard normal draws from a counter (SplitMix64, then Box-Muller): the same on every rank.
class Normal {
 public:
  explicit Normal(uint64_t seed) : state_(seed) {}
  float Next() {
    const double u1 = (static_cast<double>(Bits() >> 11) + 1.0) * 0x1p-53;  // (0, 1]
    const double u2 = static_cast<double>(Bits() >> 11) * 0x1p-53;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2));
  }

 private:
  uint64_t Bits() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  uint64_t state_;
};

// sum_j a[j] * b[j] in 8 float lanes, a fixed order: vectorizes, and the same bits every time.
float Dot(const float* a, const float* b, uint64_t n) {
  constexpr uint64_t kLanes = 8;
  float acc[kLanes] = {};
  uint64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (uint64_t k = 0; k < kLanes; ++k) acc[k] += a[j + k] * b[j + k];
  }
  for (; j < n; ++j) acc[0] += a[j] * b[j];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// Makes the r columns of p (rows x r, row-major) orthonormal by modified Gram-Schmidt, in
// double. A column that lies in the span of the earlier ones (to 1e-4 of its norm: P of a
// matrix of rank below r) becomes zero instead of normalised rounding noise, which would point
// anywhere.
void Orthonormalize(float* p, uint64_t rows, int r) {
  auto norm_of = [&](int k) {
    double sq = 0;
    for (uint64_t i = 0; i < rows; ++i) sq += double{p[i * r + k]} * p[i * r + k];
    return std::sqrt(sq);
  };
  for (int k = 0; k < r; ++k) {
    const double before = norm_of(k);
    for (int l = 0; l < k; ++l) {
      double dot = 0;
      for (uint64_t i = 0; i < rows; ++i) dot += double{p[i * r + k]} * p[i * r + l];
      for (uint64_t i = 0; i < rows; ++i) {
        p[i * r + k] = static_cast<float>(p[i * r + k] - dot * p[i * r + l]);
      }
    }
    const double norm = norm_of(k);
    const double inv = norm > 1e-4 * before && norm > 1e-30 ? 1.0 / norm : 0.0;
    for (uint64_t i = 0; i < rows; ++i) p[i * r + k] = static_cast<float>(p[i * r + k] * inv);
  }
}

}  // namespace

PowerSgd::PowerSgd(Communicator& comm, uint64_t count, std::vector<Matrix> matrices,
                   const PowerSgdOptions& options)
    : comm_(comm), count_(count), options_(options) {
  if (options.rank < 1 || options.rank > 64) {
    Throw(ErrorCode::kInvalidArgument, "PowerSGD rank {}: expected an integer in [1, 64]",
          options.rank);
  }
  if (!(options.min_compression_rate >= 1)) {
    Throw(ErrorCode::kInvalidArgument, "PowerSGD min_compression_rate {}: expected >= 1",
          options.min_compression_rate);
  }
  const uint64_t r = static_cast<uint64_t>(options.rank);
  uint64_t at = 0;        // end of the last compressed matrix
  uint64_t previous = 0;  // end of the last matrix
  for (size_t i = 0; i < matrices.size(); ++i) {
    const Matrix& m = matrices[i];
    if (m.rows == 0 || m.cols == 0 || m.offset < previous || m.offset + m.rows * m.cols > count) {
      Throw(ErrorCode::kInvalidArgument,
            "PowerSGD matrix {} ({} x {} at element {}): expected a non-empty matrix after the "
            "previous one (which ends at element {}) and inside the {} elements of the gradient",
            i, m.rows, m.cols, m.offset, previous, count);
    }
    previous = m.offset + m.rows * m.cols;
    const double full = static_cast<double>(m.rows) * static_cast<double>(m.cols);
    const double low = static_cast<double>(m.rows + m.cols) * static_cast<double>(r);
    if (low * options.min_compression_rate < full) {
      if (m.offset > at) plain_.push_back({at, m.offset});
      compressed_.push_back(m);
      at = m.offset + m.rows * m.cols;
    }
  }
  if (count > at) plain_.push_back({at, count});
  uint64_t p_floats = 0, q_floats = 0, m_floats = 0;
  for (const Matrix& m : compressed_) {
    p_floats += m.rows * r;
    q_floats += m.cols * r;
    m_floats += m.rows * m.cols;
  }
  for (const auto& [b, e] : plain_) plain_count_ += e - b;
  first_.resize(p_floats + plain_count_);
  second_.resize(q_floats);
  q_.resize(q_floats);
  residual_.assign(m_floats, 0.0f);
  Normal normal(options.seed ^ 0x5057455253474400ULL);  // "POWERSGD"
  for (float& q : q_) q = normal.Next();
}

void PowerSgd::Restore(std::span<const float> factors, std::span<const float> residual) {
  if (factors.size() != q_.size() || residual.size() != residual_.size()) {
    Throw(ErrorCode::kInvalidArgument,
          "PowerSGD restore: {} factor and {} residual floats; expected {} and {} (rank {}, {} "
          "compressed matrices): a state of another layout or rank",
          factors.size(), residual.size(), q_.size(), residual_.size(), options_.rank,
          compressed_.size());
  }
  std::copy(factors.begin(), factors.end(), q_.begin());
  std::copy(residual.begin(), residual.end(), residual_.begin());
}

void PowerSgd::Add(const WireStats& s) {
  stats_.chunks_sent += s.chunks_sent;
  stats_.bytes_sent += s.bytes_sent;
  stats_.payload_bytes += s.payload_bytes;
  stats_.saturated += s.saturated;
}

void PowerSgd::AllReduce(std::span<float> data, ReduceOp op, Deadline deadline,
                         const std::atomic<bool>* abort, const AllReduceOptions& call) {
  PSGD_CHECK_EQ(data.size(), count_);
  const int n = comm_.world_size();
  AllReduceOptions plain_call = call;
  plain_call.compress = false;
  plain_call.exact_tail = 0;
  if (!call.compress || compressed_.empty()) {
    comm_.AllReduce(data, op, deadline, abort, plain_call);
    stats_ = comm_.last_wire_stats();
    return;
  }
  stats_ = WireStats{};
  stats_.compressed = true;
  // What one float32 AllReduce of the whole slot would have sent: 2 (N-1) blocks of count / N.
  stats_.raw_payload_bytes = static_cast<uint64_t>(
      2.0 * (n - 1) * static_cast<double>(count_) / n * sizeof(float));
  const int r = options_.rank;

  // P = (M + e) Q for every matrix, then the plain elements, into one AllReduce.
  float* p = first_.data();
  const float* qt = q_.data();
  float* e = residual_.data();
  for (const Matrix& m : compressed_) {
    float* x = data.data() + m.offset;
    for (uint64_t i = 0; i < m.rows * m.cols; ++i) x[i] += e[i];
    for (uint64_t i = 0; i < m.rows; ++i) {
      for (int k = 0; k < r; ++k) p[i * r + k] = Dot(x + i * m.cols, qt + k * m.cols, m.cols);
    }
    p += m.rows * r;
    qt += m.cols * r;
    e += m.rows * m.cols;
  }
  for (const auto& [b, end] : plain_) p = std::copy(data.begin() + b, data.begin() + end, p);
  comm_.AllReduce(first_, op, deadline, abort, plain_call);
  Add(comm_.last_wire_stats());
  const float* reduced = first_.data() + (first_.size() - plain_count_);
  for (const auto& [b, end] : plain_) {
    std::copy(reduced, reduced + (end - b), data.begin() + b);
    reduced += end - b;
  }
  p = first_.data();

  // Q^T = (M^T P)^T with P orthonormalized: the same bits on every rank from the same P.
  float* q2 = second_.data();
  for (const Matrix& m : compressed_) {
    Orthonormalize(p, m.rows, r);
    const float* x = data.data() + m.offset;
    std::fill(q2, q2 + m.cols * r, 0.0f);
    for (uint64_t i = 0; i < m.rows; ++i) {
      for (int k = 0; k < r; ++k) {
        const float w = p[i * r + k];
        float* row = q2 + k * m.cols;
        const float* xi = x + i * m.cols;
        for (uint64_t j = 0; j < m.cols; ++j) row[j] += w * xi[j];
      }
    }
    p += m.rows * r;
    q2 += m.cols * r;
  }
  comm_.AllReduce(second_, op, deadline, abort, plain_call);
  Add(comm_.last_wire_stats());

  // result = P Q^T; e = (M + e) - result; Q kept for the next call.
  p = first_.data();
  q2 = second_.data();
  e = residual_.data();
  for (const Matrix& m : compressed_) {
    float* x = data.data() + m.offset;
    for (uint64_t i = 0; i < m.rows; ++i) {
      float* xi = x + i * m.cols;
      float* ei = e + i * m.cols;
      std::copy(xi, xi + m.cols, ei);
      std::fill(xi, xi + m.cols, 0.0f);
      for (int k = 0; k < r; ++k) {
        const float w = p[i * r + k];
        const float* row = q2 + k * m.cols;
        for (uint64_t j = 0; j < m.cols; ++j) xi[j] += w * row[j];
      }
      for (uint64_t j = 0; j < m.cols; ++j) ei[j] -= xi[j];
    }
    p += m.rows * r;
    q2 += m.cols * r;
    e += m.rows * m.cols;
  }
  // Warm start. A column of Q that came back all zero (a zero gradient matrix) would stay zero
  // forever: draw it anew, the same on every rank (Q is the same everywhere).
  std::copy(second_.begin(), second_.end(), q_.begin());
  float* qt_mut = q_.data();
  uint64_t index = 0;
  for (const Matrix& m : compressed_) {
    for (int k = 0; k < r; ++k, ++index) {
      float* row = qt_mut + k * m.cols;
      if (std::all_of(row, row + m.cols, [](float v) { return v == 0.0f; })) {
        Normal normal(options_.seed ^ (comm_.sequence() << 20) ^ index);
        for (uint64_t j = 0; j < m.cols; ++j) row[j] = normal.Next();
      }
    }
    qt_mut += m.cols * r;
  }
}

}  // namespace pipesgd::collective
