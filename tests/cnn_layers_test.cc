// Unit tests for the convolutional-network layers (Conv2d, MaxPool2d, Dropout, Flatten): exact
// hand-computed cases, a direct-loop reference for the convolution, finite-difference gradient
// checks, argmax ties, dropout determinism and its identity at evaluation, and a whole CNN
// model's gradient.
// Over 600 lines: one block per layer, each with its hand-computed case and gradient check.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/base/error.h"
#include "layers/layer.h"
#include "layers/model.h"
#include "core/base/rng.h"
#include "tests/support/gradcheck.h"

namespace pipesgd::layers {
namespace {

using ::testing::HasSubstr;
using testing::CentralDifference;
using testing::Dot;
using testing::RandomVector;
using testing::RelErr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> InitParams(const Layer& layer, uint64_t seed) {
  std::vector<float> params(layer.num_params());
  Rng rng(seed);
  layer.Init(params, rng);
  return params;
}

// A layer's forward and backward with its own workspace, as Model would call them.
struct Runner {
  explicit Runner(const Layer& l, size_t batch, bool training = false, uint64_t key = 0,
                  uint64_t first_row = 0)
      : layer(l), workspace(l.workspace_bytes(batch)) {
    pass.batch = batch;
    pass.training = training;
    pass.key = key;
    pass.first_row = first_row;
    pass.workspace = workspace;
  }
  std::vector<float> Forward(std::span<const float> params, const std::vector<float>& x) {
    EXPECT_EQ(x.size(), pass.batch * layer.in_features());
    std::vector<float> y(pass.batch * layer.out_features(), kNaN);
    layer.Forward(params, x.data(), y.data(), pass);
    return y;
  }
  // Returns dx; writes the parameter gradient into grads (resized, filled with NaN first so that
  // anything left unwritten shows).
  std::vector<float> Backward(std::span<const float> params, const std::vector<float>& x,
                              const std::vector<float>& y, const std::vector<float>& dy,
                              std::vector<float>& grads) {
    grads.assign(layer.num_params(), kNaN);
    std::vector<float> dx(x.size(), kNaN);
    layer.Backward(params, x.data(), y.data(), dy.data(), grads, dx.data(), pass);
    return dx;
  }

  const Layer& layer;
  std::vector<std::byte> workspace;
  Pass pass;
};

// Checks dLoss/dparams and dLoss/dx of loss = <r, layer(x)> against central differences.
// Every layer here is linear in its parameters and piecewise linear in x, so with no kink within
// eps the differences are exact up to float rounding of y; eps = 1e-2 keeps that rounding
// small relative to the difference. Tolerance: relative error 1e-3, where gradients below 1e-2
// are compared absolutely (1e-5): rounding of y (~6e-8 per element, over dozens of outputs,
// divided by the 2e-2 step) reaches a few 1e-6.
void CheckGradients(const Layer& layer, std::vector<float> params, std::vector<float> x,
                    size_t batch, uint64_t seed, double tolerance = 1e-3) {
  Runner run(layer, batch);
  const std::vector<float> r = RandomVector(batch * layer.out_features(), seed);
  std::vector<float> y;
  auto loss = [&] {
    y = run.Forward(params, x);
    return Dot(r, y);
  };
  loss();
  std::vector<float> grads;
  const std::vector<float> dx = run.Backward(params, x, y, r, grads);
  constexpr float kEps = 1e-2f;
  double max_err = 0;
  for (size_t j = 0; j < params.size(); j++) {
    const double numeric = CentralDifference(params, j, kEps, loss);
    const double err = RelErr(grads[j], numeric, 1e-2);
    max_err = std::max(max_err, err);
    EXPECT_LT(err, tolerance) << layer.name() << " param " << j << ": analytic " << grads[j]
                              << " numeric " << numeric;
  }
  for (size_t j = 0; j < x.size(); j++) {
    const double numeric = CentralDifference(x, j, kEps, loss);
    const double err = RelErr(dx[j], numeric, 1e-2);
    max_err = std::max(max_err, err);
    EXPECT_LT(err, tolerance) << layer.name() << " x " << j << ": analytic " << dx[j]
                              << " numeric " << numeric;
  }
  std::printf("%s: max relative error %.3g over %zu params and %zu inputs\n",
              layer.name().c_str(), max_err, params.size(), x.size());
}

std::string ErrorOf(auto make) {
  try {
    make();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "expected an Error";
  return "";
}

// The convolution and pooling tests run on every CPU implementation this build has: the
// im2col + OpenBLAS reference and, where built, oneDNN.
std::vector<CpuKernels> BuiltKernels() {
  std::vector<CpuKernels> kernels = {CpuKernels::kOpenBlas};
  if (HaveOneDnn()) kernels.push_back(CpuKernels::kOneDnn);
  return kernels;
}
std::string KernelsName(const ::testing::TestParamInfo<CpuKernels>& info) {
  return ToString(info.param);
}

class Conv2dTest : public ::testing::TestWithParam<CpuKernels> {
 protected:
  std::unique_ptr<Layer> Conv(const Shape& in, size_t oc, size_t k, size_t s, size_t p) {
    return MakeConv2d(in, oc, k, s, p, GetParam());
  }
};
INSTANTIATE_TEST_SUITE_P(Kernels, Conv2dTest, ::testing::ValuesIn(BuiltKernels()), KernelsName);

class MaxPool2dTest : public ::testing::TestWithParam<CpuKernels> {
 protected:
  std::unique_ptr<Layer> Pool(const Shape& in, size_t k, size_t s) {
    return MakeMaxPool2d(in, k, s, GetParam());
  }
};
INSTANTIATE_TEST_SUITE_P(Kernels, MaxPool2dTest, ::testing::ValuesIn(BuiltKernels()),
                         KernelsName);

// ---------------------------------------------------------------------------------------------
// Conv2d

// x (1, 4, 4) = 1..16 row-major; channel 0 sums its 3x3 window (W all ones, b 0), channel 1
// picks the window's centre minus 1 (W = e_centre, b = -1); stride 2, padding 1.
const std::vector<float> kRamp = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
const std::vector<float> kTwoFilters = {1, 1, 1, 1, 1, 1, 1, 1, 1,  // W[0]
                                        0, 0, 0, 0, 1, 0, 0, 0, 0,  // W[1]
                                        0, -1};                     // b

TEST_P(Conv2dTest, ShapesNameAndSizes) {
  auto conv = Conv({1, 28, 28}, 32, 5, 1, 2);
  EXPECT_EQ(conv->out_shape(), (Shape{32, 28, 28}));
  EXPECT_EQ(conv->num_params(), 32u * 25 + 32);
  EXPECT_EQ(conv->name(), "conv2d(1x28x28->32x28x28, k5 s1 p2)");
  // floor((7 + 2 - 3) / 2) + 1 = 4 and floor((6 + 2 - 3) / 2) + 1 = 3
  auto odd = Conv({2, 7, 6}, 3, 3, 2, 1);
  EXPECT_EQ(odd->out_shape(), (Shape{3, 4, 3}));
  EXPECT_EQ(odd->num_params(), 3u * 2 * 9 + 3);
}

TEST_P(Conv2dTest, ForwardOfAKnown4x4Input) {
  auto conv = Conv({1, 4, 4}, 2, 3, 2, 1);
  ASSERT_EQ(conv->out_shape(), (Shape{2, 2, 2}));
  Runner run(*conv, 1);
  const std::vector<float> y = run.Forward(kTwoFilters, kRamp);
  // Window (i, j) covers rows 2i-1..2i+1 and columns 2j-1..2j+1 of the zero-padded input:
  //   (0,0): 1+2+5+6 = 14     (0,1): 2+3+4+6+7+8 = 30
  //   (1,0): 5+6+9+10+13+14 = 57     (1,1): 6+7+8+10+11+12+14+15+16 = 99
  // Centres x[2i][2j] = 1, 3, 9, 11, minus 1.
  EXPECT_EQ(y, (std::vector<float>{14, 30, 57, 99, 0, 2, 8, 10}));
}

TEST_P(Conv2dTest, BackwardOfAKnown4x4Input) {
  auto conv = Conv({1, 4, 4}, 2, 3, 2, 1);
  Runner run(*conv, 1);
  const std::vector<float> y = run.Forward(kTwoFilters, kRamp);
  // dy = 1 on the summing channel, 0 on the centre channel.
  const std::vector<float> dy = {1, 1, 1, 1, 0, 0, 0, 0};
  std::vector<float> grads;
  const std::vector<float> dx = run.Backward(kTwoFilters, kRamp, y, dy, grads);
  // dx[r][c] = number of windows covering (r, c) = rows[r] * cols[c]: rows/columns 1 lie in
  // both windows (-1..1 and 1..3), the others in one.
  const std::vector<float> count = {1, 2, 1, 1};
  for (size_t r = 0; r < 4; r++) {
    for (size_t c = 0; c < 4; c++) EXPECT_EQ(dx[r * 4 + c], count[r] * count[c]) << r << "," << c;
  }
  // dW[0][p][q] = sum over the 4 windows of the padded pixel at offset (p, q); e.g. the centre
  // (1, 1) sums x[0][0] + x[0][2] + x[2][0] + x[2][2] = 1 + 3 + 9 + 11 = 24, and the top-left
  // corner (0, 0) sees padding in three windows and x[1][1] = 6 in the last.
  EXPECT_EQ(grads[0], 6);
  EXPECT_EQ(grads[4], 24);
  // (2, 2): x[1][1] + x[1][3] + x[3][1] + x[3][3] = 6 + 8 + 14 + 16
  EXPECT_EQ(grads[8], 44);
  for (size_t k = 9; k < 18; k++) EXPECT_EQ(grads[k], 0) << k;  // dy was 0 on channel 1
  EXPECT_EQ(grads[18], 4);  // db[0]: four ones
  EXPECT_EQ(grads[19], 0);
}

// The convolution written as its definition, in double.
std::vector<double> DirectConv(const Shape& in, size_t oc, size_t k, size_t s, size_t p,
                               const std::vector<float>& params, const std::vector<float>& x,
                               size_t batch) {
  const size_t oh = (in.height + 2 * p - k) / s + 1, ow = (in.width + 2 * p - k) / s + 1;
  std::vector<double> y(batch * oc * oh * ow);
  const float* b = params.data() + oc * in.channels * k * k;
  for (size_t n = 0; n < batch; n++) {
    for (size_t o = 0; o < oc; o++) {
      for (size_t i = 0; i < oh; i++) {
        for (size_t j = 0; j < ow; j++) {
          double sum = b[o];
          for (size_t c = 0; c < in.channels; c++) {
            for (size_t u = 0; u < k; u++) {
              for (size_t v = 0; v < k; v++) {
                const long r = static_cast<long>(i * s + u) - static_cast<long>(p);
                const long q = static_cast<long>(j * s + v) - static_cast<long>(p);
                if (r < 0 || q < 0 || r >= static_cast<long>(in.height) ||
                    q >= static_cast<long>(in.width)) {
                  continue;
                }
                sum += static_cast<double>(params[((o * in.channels + c) * k + u) * k + v]) *
                       x[((n * in.channels + c) * in.height + r) * in.width + q];
              }
            }
          }
          y[((n * oc + o) * oh + i) * ow + j] = sum;
        }
      }
    }
  }
  return y;
}

TEST_P(Conv2dTest, ForwardMatchesTheDefinition) {
  struct Case {
    Shape in;
    size_t oc, k, s, p;
  };
  for (const Case& c : {Case{{2, 7, 6}, 3, 3, 2, 1}, Case{{3, 5, 5}, 4, 5, 1, 2},
                        Case{{1, 9, 4}, 2, 2, 3, 0}, Case{{2, 3, 3}, 1, 3, 1, 0}}) {
    auto conv = Conv(c.in, c.oc, c.k, c.s, c.p);
    const std::vector<float> params = InitParams(*conv, 3);
    constexpr size_t kBatch = 3;
    const std::vector<float> x = RandomVector(kBatch * c.in.size(), 4);
    Runner run(*conv, kBatch);
    const std::vector<float> y = run.Forward(params, x);
    const std::vector<double> expected = DirectConv(c.in, c.oc, c.k, c.s, c.p, params, x, kBatch);
    ASSERT_EQ(y.size(), expected.size()) << conv->name();
    for (size_t i = 0; i < y.size(); i++) {
      // Float sums of at most 75 products of magnitude <= 1.
      EXPECT_NEAR(y[i], expected[i], 1e-5) << conv->name() << " element " << i;
    }
  }
}

TEST_P(Conv2dTest, GradientMatchesFiniteDifferences) {
  // Stride 2 with padding (uneven coverage, padding dropped in col2im) and stride 1 with more
  // channels; batch 2 so that dW sums over samples.
  auto a = Conv({2, 5, 4}, 3, 3, 2, 1);
  CheckGradients(*a, InitParams(*a, 5), RandomVector(2 * a->in_features(), 6), 2, 7);
  auto b = Conv({3, 4, 4}, 2, 2, 1, 0);
  CheckGradients(*b, InitParams(*b, 8), RandomVector(2 * b->in_features(), 9), 2, 10);
}

TEST_P(Conv2dTest, BackwardOverwritesAndSkipsDxForTheFirstLayer) {
  auto conv = Conv({2, 5, 5}, 3, 3, 1, 1);
  const std::vector<float> params = InitParams(*conv, 11);
  const std::vector<float> x = RandomVector(2 * conv->in_features(), 12);
  Runner run(*conv, 2);
  const std::vector<float> y = run.Forward(params, x);
  const std::vector<float> dy = RandomVector(y.size(), 13);
  std::vector<float> grads;
  run.Backward(params, x, y, dy, grads);  // grads start as NaN
  for (float g : grads) ASSERT_TRUE(std::isfinite(g));
  std::vector<float> again(conv->num_params(), 1e30f);
  conv->Backward(params, x.data(), y.data(), dy.data(), again, nullptr, run.pass);
  EXPECT_EQ(again, grads);
}

TEST_P(Conv2dTest, InitIsPyTorchsDefaultBoundInRngOrder) {
  auto conv = Conv({4, 8, 8}, 6, 3, 1, 1);
  const std::vector<float> params = InitParams(*conv, 21);
  const float bound = 1.0f / std::sqrt(4.0f * 9.0f);  // 1/6
  Rng rng(21);
  for (size_t i = 0; i < params.size(); i++) {
    ASSERT_EQ(params[i], rng.Uniform(-bound, bound)) << i;
  }
  EXPECT_LT(*std::min_element(params.begin(), params.end()), -0.12f);
  EXPECT_GT(*std::max_element(params.begin(), params.end()), 0.12f);
}

TEST_P(Conv2dTest, RejectsKernelsLargerThanThePaddedInput) {
  const std::string message = ErrorOf([&] { Conv({1, 3, 5}, 4, 6, 1, 1); });
  EXPECT_THAT(message, HasSubstr("kernel 6"));
  EXPECT_THAT(message, HasSubstr("5x7"));  // padded
  EXPECT_THAT(message, HasSubstr("1x3x5"));
  EXPECT_THAT(message, HasSubstr("expected kernel <= 5"));
  // 5 fits 3 + 2*1 exactly.
  EXPECT_EQ(Conv({1, 3, 5}, 4, 5, 1, 1)->out_shape(), (Shape{4, 1, 3}));
  EXPECT_THAT(ErrorOf([&] { Conv({1, 8, 8}, 4, 3, 0, 1); }), HasSubstr("stride 0"));
  EXPECT_THAT(ErrorOf([&] { Conv({1, 8, 8}, 0, 3, 1, 1); }), HasSubstr("out_channels 0"));
  EXPECT_THAT(ErrorOf([&] { Conv({1, 8, 8}, 2, 0, 1, 1); }), HasSubstr("kernel 0"));
}

// ---------------------------------------------------------------------------------------------
// MaxPool2d

TEST_P(MaxPool2dTest, ForwardBackwardWithTiesToTheFirst) {
  auto pool = Pool({1, 4, 4}, 2, 2);
  EXPECT_EQ(pool->out_shape(), (Shape{1, 2, 2}));
  EXPECT_EQ(pool->name(), "max_pool2d(1x4x4->1x2x2, k2 s2)");
  EXPECT_EQ(pool->num_params(), 0u);
  const std::vector<float> x = {1, 3, 2, 2,    //
                                4, -1, 2, 2,   // top-right window: four 2s, the first wins
                                -5, -6, 0, 7,  //
                                -7, -5, 7, 1};  // bottom-right: 7 twice, row 2's wins
  Runner run(*pool, 1);
  const std::vector<float> y = run.Forward({}, x);
  EXPECT_EQ(y, (std::vector<float>{4, 2, -5, 7}));
  std::vector<float> grads;
  const std::vector<float> dx = run.Backward({}, x, y, {10, 20, 30, 40}, grads);
  EXPECT_EQ(dx, (std::vector<float>{0, 0, 20, 0,  //
                                    10, 0, 0, 0,  //
                                    30, 0, 0, 40,  //
                                    0, 0, 0, 0}));
}

TEST_P(MaxPool2dTest, OverlappingWindowsSumTheirGradients) {
  // Kernel 2, stride 1 over a (2, 2, 3) input: the centre column's maximum wins both windows of
  // its row pair in channel 0; channel 1 is separate.
  auto pool = Pool({2, 2, 3}, 2, 1);
  ASSERT_EQ(pool->out_shape(), (Shape{2, 1, 2}));
  const std::vector<float> x = {0, 9, 0,  //
                                1, 2, 3,  // channel 0: 9 wins both windows
                                5, 1, 1,  //
                                1, 1, 6};  // channel 1: 5, then 6
  Runner run(*pool, 1);
  const std::vector<float> y = run.Forward({}, x);
  EXPECT_EQ(y, (std::vector<float>{9, 9, 5, 6}));
  std::vector<float> grads;
  const std::vector<float> dx = run.Backward({}, x, y, {1.5f, 2.25f, 3, 4}, grads);
  EXPECT_EQ(dx, (std::vector<float>{0, 3.75f, 0, 0, 0, 0, 3, 0, 0, 0, 0, 4}));
}

TEST_P(MaxPool2dTest, NaNWinsItsWindowButNotOnOneDnn) {
  auto pool = Pool({1, 2, 4}, 2, 2);
  const std::vector<float> x = {1, kNaN, 1, 2, 5, 3, 3, 1};
  Runner run(*pool, 1);
  const std::vector<float> y = run.Forward({}, x);
  if (GetParam() == CpuKernels::kOneDnn) {
    EXPECT_EQ(y[0], 5);  // layer.h: the NaN loses to the window's largest number
  } else {
    EXPECT_TRUE(std::isnan(y[0]));
  }
  EXPECT_EQ(y[1], 3);
  // A window of NaNs only: NaN on the reference, the lowest float on oneDNN (its starting max).
  const std::vector<float> all_nan = {kNaN, kNaN, 1, 2, kNaN, kNaN, 3, 1};
  const float y_all_nan = run.Forward({}, all_nan)[0];
  if (GetParam() == CpuKernels::kOneDnn) {
    EXPECT_EQ(y_all_nan, std::numeric_limits<float>::lowest());
  } else {
    EXPECT_TRUE(std::isnan(y_all_nan));
  }
}

TEST_P(MaxPool2dTest, FloorModeDropsTheRemainder) {
  auto pool = Pool({3, 7, 5}, 2, 2);
  EXPECT_EQ(pool->out_shape(), (Shape{3, 3, 2}));
  auto pool3 = Pool({1, 7, 7}, 3, 2);
  EXPECT_EQ(pool3->out_shape(), (Shape{1, 3, 3}));
}

TEST_P(MaxPool2dTest, GradientMatchesFiniteDifferences) {
  // Distinct values at least 0.05 apart, so no +-eps step changes a window's argmax.
  auto pool = Pool({2, 5, 6}, 3, 2);
  const size_t n = 2 * pool->in_features();
  std::vector<float> x(n);
  Rng rng(31);
  for (size_t i = 0; i < n; i++) x[i] = 0.05f * static_cast<float>(i) - 3.0f;
  for (size_t i = n; i > 1; i--) std::swap(x[i - 1], x[rng.Below(i)]);
  CheckGradients(*pool, {}, x, 2, 32);
}

TEST_P(MaxPool2dTest, RejectsAKernelLargerThanItsInput) {
  const std::string message = ErrorOf([&] { Pool({8, 3, 9}, 4, 4); });
  EXPECT_THAT(message, HasSubstr("kernel 4"));
  EXPECT_THAT(message, HasSubstr("8x3x9"));
  EXPECT_THAT(message, HasSubstr("expected kernel <= 3"));
  EXPECT_THAT(ErrorOf([&] { Pool({1, 4, 4}, 2, 0); }), HasSubstr("stride 0"));
}

// ---------------------------------------------------------------------------------------------
// oneDNN against the reference, at the shapes of configs/fashion_mnist_cnn.pbtxt and odd ones

// The largest |a - b| over the tensor, relative to the reference's largest magnitude: the two
// sum the same products in different orders, so they differ by float rounding of sums whose
// size is the tensor's scale, not the element's (an element near 0 may be a cancellation).
double ScaledMaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); i++) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return scale == 0 ? diff : diff / scale;
}

struct ConvCase {
  Shape in;
  size_t oc, k, s, p, batch;
};

TEST(OneDnnTest, ConvolutionMatchesTheReferenceForwardAndBackward) {
  if (!HaveOneDnn()) GTEST_SKIP() << "this build has no oneDNN";
  for (const ConvCase& c : {ConvCase{{1, 28, 28}, 16, 5, 1, 2, 64},
                            ConvCase{{16, 14, 14}, 32, 5, 1, 2, 64},
                            ConvCase{{16, 14, 14}, 32, 5, 1, 2, 7},
                            ConvCase{{3, 11, 9}, 5, 3, 2, 1, 3},
                            ConvCase{{2, 9, 4}, 2, 2, 3, 0, 2}}) {
    auto ref = MakeConv2d(c.in, c.oc, c.k, c.s, c.p, CpuKernels::kOpenBlas);
    auto dnn = MakeConv2d(c.in, c.oc, c.k, c.s, c.p, CpuKernels::kOneDnn);
    ASSERT_EQ(dnn->name(), ref->name());
    ASSERT_EQ(dnn->num_params(), ref->num_params());
    const std::vector<float> params = InitParams(*ref, 71);
    const std::vector<float> x = RandomVector(c.batch * c.in.size(), 72);
    Runner run_ref(*ref, c.batch), run_dnn(*dnn, c.batch);
    const std::vector<float> y_ref = run_ref.Forward(params, x), y_dnn = run_dnn.Forward(params, x);
    const std::vector<float> dy = RandomVector(y_ref.size(), 73);
    std::vector<float> g_ref, g_dnn;
    const std::vector<float> dx_ref = run_ref.Backward(params, x, y_ref, dy, g_ref);
    const std::vector<float> dx_dnn = run_dnn.Backward(params, x, y_dnn, dy, g_dnn);
    const double y_err = ScaledMaxDiff(y_dnn, y_ref), g_err = ScaledMaxDiff(g_dnn, g_ref),
                 dx_err = ScaledMaxDiff(dx_dnn, dx_ref);
    std::printf("%s batch %zu: y %.2g, grads %.2g, dx %.2g (max |diff| / max |reference|)\n",
                ref->name().c_str(), c.batch, y_err, g_err, dx_err);
    EXPECT_LT(y_err, 1e-5) << ref->name();
    EXPECT_LT(g_err, 1e-5) << ref->name();
    EXPECT_LT(dx_err, 1e-5) << ref->name();
  }
}

TEST(OneDnnTest, ConvolutionIsBitwiseRepeatable) {
  // The same inputs give the same bits, call after call and layer after layer (a fresh plan),
  // so a run is reproducible for a given build and thread count.
  if (!HaveOneDnn()) GTEST_SKIP() << "this build has no oneDNN";
  const Shape in{16, 14, 14};
  auto a = MakeConv2d(in, 32, 5, 1, 2, CpuKernels::kOneDnn);
  auto b = MakeConv2d(in, 32, 5, 1, 2, CpuKernels::kOneDnn);
  const std::vector<float> params = InitParams(*a, 81);
  const std::vector<float> x = RandomVector(64 * in.size(), 82);
  Runner run_a(*a, 64), run_b(*b, 64);
  const std::vector<float> y1 = run_a.Forward(params, x);
  const std::vector<float> dy = RandomVector(y1.size(), 83);
  std::vector<float> g1, g2, g3;
  const std::vector<float> dx1 = run_a.Backward(params, x, y1, dy, g1);
  const std::vector<float> y2 = run_a.Forward(params, x);
  const std::vector<float> dx2 = run_a.Backward(params, x, y2, dy, g2);
  const std::vector<float> y3 = run_b.Forward(params, x);
  const std::vector<float> dx3 = run_b.Backward(params, x, y3, dy, g3);
  EXPECT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * 4), 0);
  EXPECT_EQ(std::memcmp(y1.data(), y3.data(), y1.size() * 4), 0);
  EXPECT_EQ(std::memcmp(g1.data(), g2.data(), g1.size() * 4), 0);
  EXPECT_EQ(std::memcmp(g1.data(), g3.data(), g1.size() * 4), 0);
  EXPECT_EQ(std::memcmp(dx1.data(), dx2.data(), dx1.size() * 4), 0);
  EXPECT_EQ(std::memcmp(dx1.data(), dx3.data(), dx1.size() * 4), 0);
}

TEST(OneDnnTest, PoolingEqualsTheReferenceBitwise) {
  // Selecting a maximum is exact, and so is routing its gradient (windows that do not overlap
  // add nothing; overlapping ones add at most kernel^2 terms, here in the same order).
  if (!HaveOneDnn()) GTEST_SKIP() << "this build has no oneDNN";
  struct Case {
    Shape in;
    size_t k, s, batch;
  };
  for (const Case& c : {Case{{16, 28, 28}, 2, 2, 64}, Case{{32, 14, 14}, 2, 2, 5},
                        Case{{3, 7, 5}, 2, 2, 2}, Case{{2, 9, 9}, 3, 2, 3}}) {
    auto ref = MakeMaxPool2d(c.in, c.k, c.s, CpuKernels::kOpenBlas);
    auto dnn = MakeMaxPool2d(c.in, c.k, c.s, CpuKernels::kOneDnn);
    // Ties in every few windows: values on a coarse grid.
    std::vector<float> x = RandomVector(c.batch * c.in.size(), 91);
    for (float& v : x) v = std::round(v * 4) / 4;
    Runner run_ref(*ref, c.batch), run_dnn(*dnn, c.batch);
    const std::vector<float> y_ref = run_ref.Forward({}, x), y_dnn = run_dnn.Forward({}, x);
    EXPECT_EQ(y_dnn, y_ref) << ref->name();
    const std::vector<float> dy = RandomVector(y_ref.size(), 92);
    std::vector<float> unused;
    const std::vector<float> dx_ref = run_ref.Backward({}, x, y_ref, dy, unused);
    EXPECT_EQ(run_dnn.Backward({}, x, y_dnn, dy, unused), dx_ref) << ref->name();
  }
}

TEST(OneDnnTest, UnavailableKernelsAreAClearError) {
  if (HaveOneDnn()) {
    EXPECT_EQ(DefaultCpuKernels(), CpuKernels::kOneDnn);
    return;
  }
  EXPECT_EQ(DefaultCpuKernels(), CpuKernels::kOpenBlas);
  try {
    MakeConv2d({1, 8, 8}, 2, 3, 1, 1, CpuKernels::kOneDnn);
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
    EXPECT_THAT(e.what(), HasSubstr("no oneDNN"));
  }
}

// ---------------------------------------------------------------------------------------------
// Dropout

TEST(DropoutTest, EvaluationIsTheIdentity) {
  auto dropout = MakeDropout({3, 4, 4}, 0.5f);
  EXPECT_EQ(dropout->name(), "dropout(0.5)");
  EXPECT_EQ(dropout->out_shape(), (Shape{3, 4, 4}));
  std::vector<float> x = RandomVector(2 * 48, 41);
  x[5] = kNaN;
  Runner run(*dropout, 2, /*training=*/false, /*key=*/123);
  const std::vector<float> y = run.Forward({}, x);
  EXPECT_EQ(std::memcmp(y.data(), x.data(), x.size() * sizeof(float)), 0);
  std::vector<float> grads;
  const std::vector<float> dy = RandomVector(x.size(), 42);
  const std::vector<float> dx = run.Backward({}, x, y, dy, grads);
  EXPECT_EQ(dx, dy);
}

TEST(DropoutTest, TrainingDropsAboutPAndScalesTheRest) {
  const float p = 0.3f;
  constexpr size_t kFeatures = 1000, kBatch = 100;
  auto dropout = MakeDropout({kFeatures, 1, 1}, p);
  const std::vector<float> x = RandomVector(kBatch * kFeatures, 43, 0.5f, 1.5f);  // no zeros
  Runner run(*dropout, kBatch, /*training=*/true, /*key=*/RandomKey(1, 0, 0));
  const std::vector<float> y = run.Forward({}, x);
  const float scale = 1.0f / (1.0f - p);
  size_t dropped = 0;
  for (size_t i = 0; i < x.size(); i++) {
    if (y[i] == 0.0f) {
      dropped++;
    } else {
      ASSERT_EQ(y[i], x[i] * scale) << i;
    }
  }
  // Binomial(100000, 0.3): standard deviation 145 elements; 0.01 is ~7 of them.
  EXPECT_NEAR(static_cast<double>(dropped) / x.size(), p, 0.01);
  // Backward applies the same mask: dx = dy * scale where kept, 0 where dropped.
  const std::vector<float> dy = RandomVector(x.size(), 44);
  std::vector<float> grads;
  const std::vector<float> dx = run.Backward({}, x, y, dy, grads);
  for (size_t i = 0; i < x.size(); i++) {
    ASSERT_EQ(dx[i], y[i] == 0.0f ? 0.0f : dy[i] * scale) << i;
  }
}

TEST(DropoutTest, MaskIsAFunctionOfKeyAndGlobalRow) {
  auto dropout = MakeDropout({2, 3, 5}, 0.5f);
  const size_t f = dropout->in_features();
  const std::vector<float> x = RandomVector(4 * f, 45, 1.0f, 2.0f);
  const uint64_t key = RandomKey(7, 11, 2);
  Runner all(*dropout, 4, true, key, /*first_row=*/8);
  const std::vector<float> y = all.Forward({}, x);
  // The same key and rows give bitwise the same output.
  EXPECT_EQ(Runner(*dropout, 4, true, key, 8).Forward({}, x), y);
  // Rows 10..11 computed alone (as another rank would) match rows 2..3 of the batch of 4.
  const std::vector<float> tail(x.begin() + 2 * f, x.end());
  const std::vector<float> y_tail = Runner(*dropout, 2, true, key, 10).Forward({}, tail);
  EXPECT_TRUE(std::equal(y_tail.begin(), y_tail.end(), y.begin() + 2 * f));
  // Another step (key) or another row offset gives another mask.
  EXPECT_NE(Runner(*dropout, 4, true, RandomKey(7, 12, 2), 8).Forward({}, x), y);
  EXPECT_NE(Runner(*dropout, 4, true, key, 9).Forward({}, x), y);
}

TEST(DropoutTest, GradientMatchesFiniteDifferencesForAFixedMask) {
  auto dropout = MakeDropout({4, 2, 3}, 0.4f);
  Runner run(*dropout, 3, true, RandomKey(3, 5, 1));
  std::vector<float> x = RandomVector(3 * dropout->in_features(), 46);
  const std::vector<float> r = RandomVector(x.size(), 47);
  std::vector<float> y;
  auto loss = [&] {
    y = run.Forward({}, x);
    return Dot(r, y);
  };
  loss();
  std::vector<float> grads;
  const std::vector<float> dx = run.Backward({}, x, y, r, grads);
  int zeros = 0;
  for (size_t j = 0; j < x.size(); j++) {
    const double numeric = CentralDifference(x, j, 1e-2f, loss);
    EXPECT_LT(RelErr(dx[j], numeric, 1e-3), 1e-3) << j;
    zeros += dx[j] == 0.0f;
  }
  EXPECT_GT(zeros, 0);
  EXPECT_LT(zeros, static_cast<int>(x.size()));
}

TEST(DropoutTest, ZeroProbabilityKeepsEverythingAndBadPIsRejected) {
  auto dropout = MakeDropout({10, 1, 1}, 0.0f);
  const std::vector<float> x = RandomVector(30, 48);
  EXPECT_EQ(Runner(*dropout, 3, true, 99).Forward({}, x), x);
  for (float p : {-0.1f, 1.0f, 1.5f, kNaN}) {
    EXPECT_THAT(ErrorOf([p] { MakeDropout({10, 1, 1}, p); }), HasSubstr("expected a probability"))
        << p;
  }
}

// ---------------------------------------------------------------------------------------------
// Flatten

TEST(FlattenTest, CopiesBothWays) {
  auto flatten = MakeFlatten({3, 2, 2});
  EXPECT_EQ(flatten->out_shape(), (Shape{12, 1, 1}));
  EXPECT_EQ(flatten->name(), "flatten(3x2x2->12)");
  const std::vector<float> x = RandomVector(24, 49);
  Runner run(*flatten, 2);
  const std::vector<float> y = run.Forward({}, x);
  EXPECT_EQ(y, x);
  std::vector<float> grads;
  const std::vector<float> dy = RandomVector(24, 50);
  EXPECT_EQ(run.Backward({}, x, y, dy, grads), dy);
}

// ---------------------------------------------------------------------------------------------
// A whole CNN

std::vector<std::unique_ptr<Layer>> SmallCnn(float dropout) {
  std::vector<std::unique_ptr<Layer>> layers;
  layers.push_back(MakeConv2d({1, 8, 8}, 3, 3, 1, 1));  // 3x8x8
  layers.push_back(MakeRelu(layers.back()->out_shape()));
  layers.push_back(MakeMaxPool2d(layers.back()->out_shape(), 2, 2));  // 3x4x4
  layers.push_back(MakeConv2d(layers.back()->out_shape(), 4, 3, 1, 0));  // 4x2x2
  layers.push_back(MakeRelu(layers.back()->out_shape()));
  layers.push_back(MakeFlatten(layers.back()->out_shape()));  // 16
  layers.push_back(MakeDropout(layers.back()->out_shape(), dropout));
  layers.push_back(MakeLinear(layers.back()->out_shape(), 3));
  return layers;
}

TEST(CnnModelTest, DescribeAndShapeErrors) {
  Model model(SmallCnn(0.25f), 4);
  EXPECT_EQ(model.in_shape(), (Shape{1, 8, 8}));
  EXPECT_EQ(model.num_params(), (3u * 9 + 3) + (4u * 27 + 4) + (16u * 3 + 3));
  EXPECT_EQ(model.Describe(),
            "conv2d(1x8x8->3x8x8, k3 s1 p1) relu max_pool2d(3x8x8->3x4x4, k2 s2) "
            "conv2d(3x4x4->4x2x2, k3 s1 p0) relu flatten(4x2x2->16) dropout(0.25) "
            "linear(16->3): 193 params");
  // A pool built for 3x8x8 after a conv that outputs 3x4x4 names both shapes.
  std::vector<std::unique_ptr<Layer>> bad;
  bad.push_back(MakeConv2d({1, 8, 8}, 3, 3, 2, 1));
  bad.push_back(MakeMaxPool2d({3, 8, 8}, 2, 2));
  const std::string message = ErrorOf([&] { Model m(std::move(bad), 4); });
  EXPECT_THAT(message, HasSubstr("3x8x8"));
  EXPECT_THAT(message, HasSubstr("3x4x4"));
  EXPECT_THAT(message, HasSubstr("max_pool2d"));
}

TEST(CnnModelTest, GradientMatchesFiniteDifferences) {
  // Through conv, relu, pool, flatten and a fixed dropout mask, with the softmax loss. ReLU and
  // max have kinks; a parameter whose +-eps steps straddle one shows one-sided slopes that
  // disagree and is skipped (at most a tenth of them).
  constexpr size_t kBatch = 3;
  constexpr float kEps = 1e-3f;
  Model model(SmallCnn(0.25f), kBatch);
  std::vector<float> params(model.num_params());
  model.Init(params, 51);
  const std::vector<float> x = RandomVector(kBatch * 64, 52);
  const std::vector<uint8_t> labels = {0, 2, 1};
  const BatchKey key{.seed = 5, .step = 17, .first_row = 6};
  std::vector<float> grads(model.num_params());
  model.ForwardBackward(params, x.data(), labels.data(), kBatch, grads, key);
  // The training loss with the same key (same dropout mask). ForwardBackward sums it in double
  // and rounds once to float: ~1e-7 relative, ~1e-4 on a slope over steps of 1e-3.
  std::vector<float> scratch(model.num_params());
  auto loss = [&] {
    return static_cast<double>(
        model.ForwardBackward(params, x.data(), labels.data(), kBatch, scratch, key));
  };
  double max_err = 0;
  int checked = 0, skipped = 0;
  for (size_t j = 0; j < params.size(); j++) {
    const float saved = params[j];
    params[j] = saved + kEps;
    const double up = loss();
    params[j] = saved - kEps;
    const double down = loss();
    params[j] = saved;
    const double centre = loss();
    const double up_at = saved + kEps, down_at = saved - kEps;
    // A kink between the two steps shows as one-sided slopes that disagree: skip that parameter.
    const double right = (up - centre) / (up_at - saved), left = (centre - down) / (saved - down_at);
    if (std::abs(right - left) > 0.05 * std::max({std::abs(right), std::abs(left), 1e-2})) {
      skipped++;
      continue;
    }
    const double numeric = (up - down) / (up_at - down_at);
    const double err = RelErr(grads[j], numeric, 1e-2);
    max_err = std::max(max_err, err);
    checked++;
    EXPECT_LT(err, 1e-2) << "param " << j << ": analytic " << grads[j] << " numeric " << numeric;
  }
  std::printf("cnn model gradient check: %d params checked, %d skipped at kinks, max relative "
              "error %.3g\n",
              checked, skipped, max_err);
  EXPECT_GT(checked, static_cast<int>(params.size()) * 9 / 10);
}

TEST(CnnModelTest, DropoutIsDeterministicPerKeyAndOffAtEvaluation) {
  constexpr size_t kBatch = 4;
  Model with(SmallCnn(0.5f), kBatch), without(SmallCnn(0.0f), kBatch);
  std::vector<float> params(with.num_params());
  with.Init(params, 61);
  const std::vector<float> x = RandomVector(kBatch * 64, 62);
  const std::vector<uint8_t> labels = {0, 1, 2, 0};
  const BatchKey key{.seed = 1, .step = 3, .first_row = 0};
  std::vector<float> g1(params.size()), g2(params.size(), kNaN), g3(params.size());
  const float l1 = with.ForwardBackward(params, x.data(), labels.data(), kBatch, g1, key);
  const float l2 = with.ForwardBackward(params, x.data(), labels.data(), kBatch, g2, key);
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(std::memcmp(g1.data(), g2.data(), g1.size() * sizeof(float)), 0);
  const float l3 = with.ForwardBackward(params, x.data(), labels.data(), kBatch, g3,
                                        BatchKey{.seed = 1, .step = 4, .first_row = 0});
  EXPECT_NE(l1, l3);
  // Evaluation ignores dropout: bitwise the model without it.
  const EvalResult a = with.Evaluate(params, x.data(), labels.data(), kBatch);
  const EvalResult b = without.Evaluate(params, x.data(), labels.data(), kBatch);
  EXPECT_EQ(a.loss_sum, b.loss_sum);
  EXPECT_EQ(a.correct, b.correct);
}

}  // namespace
}  // namespace pipesgd::layers
