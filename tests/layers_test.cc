// Unit tests for layers/: exact small examples, finite-difference gradient checks, the loss, SGD
// against hand-computed PyTorch recurrences, and seeded init.
// Over 600 lines: one test per layer property, each with its small exact example inline.
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

#include <gtest/gtest.h>

#include "core/base/error.h"
#include "layers/layer.h"
#include "layers/model.h"
#include "core/base/rng.h"
#include "layers/sgd.h"
#include "tests/support/gradcheck.h"

namespace pipesgd::layers {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

using testing::CentralDifference;
using testing::Dot;
using testing::RandomVector;
using testing::RelErr;

// A Pass for `batch` samples in evaluation mode without workspace (Linear and ReLU need none).
Pass BatchOf(size_t batch) {
  Pass pass;
  pass.batch = batch;
  return pass;
}

std::vector<float> InitParams(const Layer& layer, uint64_t seed) {
  std::vector<float> params(layer.num_params());
  Rng rng(seed);
  layer.Init(params, rng);
  return params;
}

std::vector<std::unique_ptr<Layer>> Mlp(size_t in, size_t hidden, size_t out) {
  std::vector<std::unique_ptr<Layer>> layers;
  layers.push_back(MakeLinear(in, hidden));
  layers.push_back(MakeRelu(hidden));
  layers.push_back(MakeLinear(hidden, out));
  return layers;
}

// ---------------------------------------------------------------------------------------------
// Shapes and counter-based random numbers

TEST(ShapeTest, SizeAndText) {
  const Shape s{32, 14, 7};
  EXPECT_EQ(s.size(), 32u * 14 * 7);
  EXPECT_EQ(ToString(s), "32x14x7");
  EXPECT_EQ(Shape{}.size(), 1u);
  EXPECT_EQ((Shape{5, 1, 1}), (Shape{5, 1, 1}));
  EXPECT_NE((Shape{5, 1, 1}), (Shape{1, 5, 1}));
}

TEST(RngTest, HashIsTheRngStreamWithoutTheDrawsBefore) {
  // A GPU thread computes draw i of a key alone; it must be the draw a CPU loop would make.
  for (uint64_t key : {uint64_t{0}, uint64_t{1}, uint64_t{0xdeadbeefcafef00d}}) {
    Rng rng(key);
    for (uint64_t i = 0; i < 1000; i++) ASSERT_EQ(Hash(key, i), rng.NextU64()) << key << " " << i;
  }
  // SplitMix64 reference value (Vigna's splitmix64.c, seed 0, first output).
  EXPECT_EQ(Hash(0, 0), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(UnitFloat(~uint64_t{0}), 1.0f - 1.0f / 16777216.0f);
  EXPECT_EQ(UnitFloat(0), 0.0f);
}

TEST(RngTest, RandomKeysDifferAcrossSeedStepAndLayer) {
  const uint64_t base = RandomKey(1, 0, 0);
  EXPECT_EQ(base, RandomKey(1, 0, 0));
  EXPECT_NE(base, RandomKey(2, 0, 0));
  EXPECT_NE(base, RandomKey(1, 1, 0));
  EXPECT_NE(base, RandomKey(1, 0, 1));
  // (step, layer) is not a sum: step 1 layer 0 differs from step 0 layer 1.
  EXPECT_NE(RandomKey(1, 1, 0), RandomKey(1, 0, 1));
}

// ---------------------------------------------------------------------------------------------
// Linear

// W = [[1, 2], [3, 4], [5, 6]], b = [0.5, -1, 2]: small integers and halves, so every product
// and sum is exact in float and the expected values are exact too.
const std::vector<float> kTinyParams = {1, 2, 3, 4, 5, 6, 0.5f, -1, 2};
const std::vector<float> kTinyX = {1, -1,     // (2, 2)
                                   2, 0.5f};

TEST(LinearTest, ForwardMatchesHandComputed) {
  auto linear = MakeLinear(2, 3);
  EXPECT_EQ(linear->name(), "linear(2->3)");
  EXPECT_EQ(linear->in_features(), 2u);
  EXPECT_EQ(linear->out_features(), 3u);
  ASSERT_EQ(linear->num_params(), kTinyParams.size());
  std::vector<float> y(6, kNaN);  // (2, 3); NaN shows any element left unwritten
  linear->Forward(kTinyParams, kTinyX.data(), y.data(), BatchOf(2));
  // row 0: [1-2+0.5, 3-4-1, 5-6+2]; row 1: [2+1+0.5, 6+2-1, 10+3+2]
  const std::vector<float> expected = {-0.5f, -2, 1, 3.5f, 7, 15};
  EXPECT_EQ(y, expected);
}

TEST(LinearTest, BackwardMatchesHandComputedAndOverwrites) {
  auto linear = MakeLinear(2, 3);
  std::vector<float> y(6);
  linear->Forward(kTinyParams, kTinyX.data(), y.data(), BatchOf(2));
  const std::vector<float> dy = {1, 0, -1,  // (2, 3)
                                 2, 1, 0};
  // Garbage in grads and dx must not leak into the result (beta = 0).
  std::vector<float> grads(linear->num_params(), kNaN);
  std::vector<float> dx(4, kNaN);
  linear->Backward(kTinyParams, kTinyX.data(), y.data(), dy.data(), grads, dx.data(),
                   BatchOf(2));
  // dW = dy^T x: row o = sum_b dy[b][o] * x[b]; db = column sums of dy.
  const std::vector<float> expected_grads = {5, 0, 2, 0.5f, -1, 1, /* db */ 3, 1, -1};
  EXPECT_EQ(grads, expected_grads);
  // dx = dy W: row 0 = 1*[1,2] - 1*[5,6]; row 1 = 2*[1,2] + 1*[3,4].
  const std::vector<float> expected_dx = {-4, -4, 5, 8};
  EXPECT_EQ(dx, expected_dx);

  // The first layer passes dx = null: same parameter gradient, nothing else written.
  std::vector<float> grads2(linear->num_params(), 123.0f);
  linear->Backward(kTinyParams, kTinyX.data(), y.data(), dy.data(), grads2, nullptr,
                   BatchOf(2));
  EXPECT_EQ(grads2, expected_grads);
}

TEST(LinearTest, GradientMatchesFiniteDifferences) {
  constexpr size_t kIn = 4, kOut = 3, kBatch = 5;
  auto linear = MakeLinear(kIn, kOut);
  std::vector<float> params = InitParams(*linear, 1);
  std::vector<float> x = RandomVector(kBatch * kIn, 2);
  const std::vector<float> r = RandomVector(kBatch * kOut, 3);  // dLoss/dy
  std::vector<float> y(kBatch * kOut);
  auto loss = [&] {
    linear->Forward(params, x.data(), y.data(), BatchOf(kBatch));
    return Dot(r, y);
  };

  std::vector<float> grads(linear->num_params());
  std::vector<float> dx(kBatch * kIn);
  loss();
  linear->Backward(params, x.data(), y.data(), r.data(), grads, dx.data(), BatchOf(kBatch));

  // The loss is linear in each parameter and each input, so central differences are exact up to
  // float rounding of y; a large step keeps that rounding small relative to the difference.
  constexpr float kEps = 1e-2f;
  for (size_t j = 0; j < params.size(); j++) {
    const double numeric = CentralDifference(params, j, kEps, loss);
    EXPECT_LT(RelErr(grads[j], numeric, 1e-3), 1e-3)
        << "param " << j << ": analytic " << grads[j] << " numeric " << numeric;
  }
  for (size_t j = 0; j < x.size(); j++) {
    const double numeric = CentralDifference(x, j, kEps, loss);
    EXPECT_LT(RelErr(dx[j], numeric, 1e-3), 1e-3)
        << "x " << j << ": analytic " << dx[j] << " numeric " << numeric;
  }
}

TEST(LinearTest, InitIsUniformInBoundDrawnInRngOrder) {
  constexpr size_t kIn = 16, kOut = 5;
  auto linear = MakeLinear(kIn, kOut);
  const std::vector<float> params = InitParams(*linear, 7);
  ASSERT_EQ(params.size(), kOut * kIn + kOut);
  const float bound = 1.0f / std::sqrt(static_cast<float>(kIn));  // 0.25
  // One draw per float, W row-major then b, all from the same bound.
  Rng rng(7);
  for (size_t i = 0; i < params.size(); i++) {
    EXPECT_EQ(params[i], rng.Uniform(-bound, bound)) << i;
    EXPECT_LE(std::abs(params[i]), bound) << i;
  }
  // Not degenerate: both signs and a spread that fills the interval.
  EXPECT_LT(*std::min_element(params.begin(), params.end()), -0.15f);
  EXPECT_GT(*std::max_element(params.begin(), params.end()), 0.15f);
}

TEST(LinearTest, RejectsZeroSizes) {
  EXPECT_THROW(MakeLinear(0, 3), Error);
  EXPECT_THROW(MakeLinear(3, 0), Error);
  EXPECT_THROW(MakeRelu(0), Error);
}

// ---------------------------------------------------------------------------------------------
// ReLU

TEST(ReluTest, ForwardBackwardValues) {
  auto relu = MakeRelu(5);
  EXPECT_EQ(relu->name(), "relu");
  EXPECT_EQ(relu->num_params(), 0u);
  const std::vector<float> x = {-1.5f, 0.0f, 2.0f, 1e-30f, -1e-30f};
  std::vector<float> y(5, kNaN);
  relu->Forward({}, x.data(), y.data(), BatchOf(1));
  EXPECT_EQ(y, (std::vector<float>{0, 0, 2, 1e-30f, 0}));

  const std::vector<float> dy = {10, 20, 30, 40, 50};
  std::vector<float> dx(5, kNaN);
  relu->Backward({}, x.data(), y.data(), dy.data(), {}, dx.data(), BatchOf(1));
  // Gradient 0 at exactly 0 (PyTorch's choice) and below.
  EXPECT_EQ(dx, (std::vector<float>{0, 0, 30, 40, 0}));
}

TEST(ReluTest, NaNPassesThrough) {
  // A diverged model must show up as a non-finite loss, not be masked to 0 by the activation.
  auto relu = MakeRelu(1);
  const float x = kNaN;
  float y = 0;
  relu->Forward({}, &x, &y, BatchOf(1));
  EXPECT_TRUE(std::isnan(y));
}

TEST(ReluTest, GradientMatchesFiniteDifferences) {
  constexpr size_t kFeatures = 6, kBatch = 3;
  auto relu = MakeRelu(kFeatures);
  std::vector<float> x = RandomVector(kBatch * kFeatures, 11);
  // Keep every point at least 0.1 away from the kink so that x +- eps stays on one side.
  for (float& v : x) v = v < 0 ? v - 0.1f : v + 0.1f;
  const std::vector<float> r = RandomVector(kBatch * kFeatures, 12);
  std::vector<float> y(x.size());
  auto loss = [&] {
    relu->Forward({}, x.data(), y.data(), BatchOf(kBatch));
    return Dot(r, y);
  };
  loss();
  std::vector<float> dx(x.size());
  relu->Backward({}, x.data(), y.data(), r.data(), {}, dx.data(), BatchOf(kBatch));

  int zero_grads = 0;
  for (size_t j = 0; j < x.size(); j++) {
    const double numeric = CentralDifference(x, j, 1e-2f, loss);
    EXPECT_LT(RelErr(dx[j], numeric, 1e-3), 1e-3)
        << "x " << j << ": analytic " << dx[j] << " numeric " << numeric;
    zero_grads += dx[j] == 0.0f;
  }
  // Both branches were exercised.
  EXPECT_GT(zero_grads, 0);
  EXPECT_LT(zero_grads, static_cast<int>(x.size()));
}

// ---------------------------------------------------------------------------------------------
// SoftmaxCrossEntropy

TEST(SoftmaxCrossEntropyTest, UniformLogitsGiveLogC) {
  constexpr size_t kBatch = 2, kClasses = 10;
  const std::vector<float> logits(kBatch * kClasses, 3.25f);
  const std::vector<uint8_t> labels = {0, 7};
  std::vector<float> dlogits(logits.size(), kNaN);
  const float loss =
      SoftmaxCrossEntropy(logits.data(), labels.data(), kBatch, kClasses, dlogits.data());
  EXPECT_NEAR(loss, std::log(10.0), 1e-6);
  // (softmax - onehot) / B = (0.1 - onehot) / 2
  for (size_t i = 0; i < kBatch; i++) {
    for (size_t c = 0; c < kClasses; c++) {
      const double expected = (0.1 - (c == labels[i] ? 1.0 : 0.0)) / 2.0;
      EXPECT_NEAR(dlogits[i * kClasses + c], expected, 1e-7) << i << "," << c;
    }
  }
}

TEST(SoftmaxCrossEntropyTest, KnownValues) {
  // Row 0: logits [1, 2, 3], label 2: log(e + e^2 + e^3) - 3.
  // Row 1: logits [0, ln 3, 0] = softmax [0.2, 0.6, 0.2], label 0: -ln 0.2.
  const std::vector<float> logits = {1, 2, 3, 0, static_cast<float>(std::log(3.0)), 0};
  const std::vector<uint8_t> labels = {2, 0};
  std::vector<float> dlogits(6);
  const double row0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3.0;
  const double row1 = -std::log(0.2);
  const float loss = SoftmaxCrossEntropy(logits.data(), labels.data(), 2, 3, dlogits.data());
  EXPECT_NEAR(loss, (row0 + row1) / 2, 1e-6);
  EXPECT_NEAR(row0, 0.4076059644, 1e-9);  // the hand value, as a cross-check of the formula
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_NEAR(dlogits[0], std::exp(1.0) / z / 2, 1e-7);
  EXPECT_NEAR(dlogits[1], std::exp(2.0) / z / 2, 1e-7);
  EXPECT_NEAR(dlogits[2], (std::exp(3.0) / z - 1) / 2, 1e-7);
  EXPECT_NEAR(dlogits[3], (0.2 - 1) / 2, 1e-7);
  EXPECT_NEAR(dlogits[4], 0.6 / 2, 1e-7);
  EXPECT_NEAR(dlogits[5], 0.2 / 2, 1e-7);
  // Without dlogits, only the loss.
  EXPECT_EQ(SoftmaxCrossEntropy(logits.data(), labels.data(), 2, 3, nullptr), loss);
}

TEST(SoftmaxCrossEntropyTest, StableWithLargeLogits) {
  // exp(1000) overflows float and double; the max-subtracted form must not care.
  const std::vector<float> logits = {1000, 1000,   // ties: ln 2
                                     1000, 0,      // label 1 is 1000 below: loss 1000
                                     -1000, 1000};  // confident and right: loss ~ 0
  const std::vector<uint8_t> labels = {0, 1, 1};
  std::vector<float> dlogits(6);
  const float loss = SoftmaxCrossEntropy(logits.data(), labels.data(), 3, 2, dlogits.data());
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, (std::log(2.0) + 1000.0 + 0.0) / 3, 1e-4);
  for (float d : dlogits) ASSERT_TRUE(std::isfinite(d));
  EXPECT_NEAR(dlogits[0], (0.5 - 1) / 3, 1e-7);
  EXPECT_NEAR(dlogits[1], 0.5 / 3, 1e-7);
  EXPECT_NEAR(dlogits[2], 1.0 / 3, 1e-7);
  EXPECT_NEAR(dlogits[3], -1.0 / 3, 1e-7);
  EXPECT_NEAR(dlogits[4], 0.0, 1e-7);
  EXPECT_NEAR(dlogits[5], 0.0, 1e-7);
}

// ---------------------------------------------------------------------------------------------
// Model

TEST(ModelTest, SizesAndDescribe) {
  Model model(Mlp(784, 256, 10), 32);
  EXPECT_EQ(model.num_params(), 784u * 256 + 256 + 256 * 10 + 10);
  EXPECT_EQ(model.in_features(), 784u);
  EXPECT_EQ(model.num_classes(), 10u);
  EXPECT_EQ(model.max_batch(), 32u);
  EXPECT_EQ(model.Describe(), "linear(784->256) relu linear(256->10): 203530 params");
}

TEST(ModelTest, RejectsMismatchedLayersNamingBoth) {
  std::vector<std::unique_ptr<Layer>> layers;
  layers.push_back(MakeLinear(5, 7));
  layers.push_back(MakeLinear(8, 3));
  try {
    Model model(std::move(layers), 4);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string message = e.what();
    EXPECT_NE(message.find("linear(5->7)"), std::string::npos) << message;
    EXPECT_NE(message.find("linear(8->3)"), std::string::npos) << message;
  }

  // A mismatch behind a relu also names both layers and the sizes.
  std::vector<std::unique_ptr<Layer>> layers2;
  layers2.push_back(MakeLinear(5, 7));
  layers2.push_back(MakeRelu(6));
  try {
    Model model(std::move(layers2), 4);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string message = e.what();
    EXPECT_NE(message.find("linear(5->7)"), std::string::npos) << message;
    EXPECT_NE(message.find("relu"), std::string::npos) << message;
    EXPECT_NE(message.find('6'), std::string::npos) << message;
  }
}

TEST(ModelTest, ShapesMustMatchNotJustSizes) {
  // 24 floats either way, but a (2, 3, 4) activation is not a flat vector of 24: a layer built
  // for one must not silently take the other.
  std::vector<std::unique_ptr<Layer>> layers;
  layers.push_back(MakeRelu(Shape{2, 3, 4}));
  layers.push_back(MakeRelu(Shape{24, 1, 1}));
  try {
    Model model(std::move(layers), 4);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string message = e.what();
    EXPECT_NE(message.find("2x3x4"), std::string::npos) << message;
    EXPECT_NE(message.find("24x1x1"), std::string::npos) << message;
  }
  // Linear flattens its input itself: built on (2, 3, 4) it chains after the relu.
  std::vector<std::unique_ptr<Layer>> ok;
  ok.push_back(MakeRelu(Shape{2, 3, 4}));
  ok.push_back(MakeLinear(Shape{2, 3, 4}, 5));
  Model model(std::move(ok), 4);
  EXPECT_EQ(model.in_shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(model.in_features(), 24u);
  EXPECT_EQ(model.num_classes(), 5u);
  EXPECT_EQ(model.Describe(), "relu linear(24->5): 125 params");
}

TEST(ModelTest, RejectsEmptyAndZeroBatch) {
  try {
    Model model({}, 4);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
  try {
    Model model(Mlp(2, 3, 2), 0);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
}

TEST(ModelTest, InitIsDeterministicAndBounded) {
  Model model(Mlp(20, 9, 4), 1);
  std::vector<float> a(model.num_params()), b(model.num_params()), c(model.num_params());
  model.Init(a, 42);
  model.Init(b, 42);
  model.Init(c, 43);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  size_t same = 0;
  for (size_t i = 0; i < a.size(); i++) same += a[i] == c[i];
  EXPECT_LT(same, a.size() / 10) << "seeds 42 and 43 gave nearly the same parameters";

  // Each linear layer within its own 1/sqrt(in); the second layer continues the same stream.
  const size_t first = 20 * 9 + 9;
  const float bound1 = 1.0f / std::sqrt(20.0f), bound2 = 1.0f / std::sqrt(9.0f);
  for (size_t i = 0; i < first; i++) EXPECT_LE(std::abs(a[i]), bound1) << i;
  for (size_t i = first; i < a.size(); i++) EXPECT_LE(std::abs(a[i]), bound2) << i;
  EXPECT_GT(*std::max_element(a.begin() + first, a.end()), bound1) << "second layer used bound1";
  Rng rng(42);
  for (size_t i = 0; i < first; i++) rng.NextU64();
  EXPECT_EQ(a[first], rng.Uniform(-bound2, bound2));
}

TEST(ModelTest, GradientMatchesFiniteDifferences) {
  constexpr size_t kIn = 5, kHidden = 7, kClasses = 3, kBatch = 4;
  constexpr float kEps = 1e-2f;
  Model model(Mlp(kIn, kHidden, kClasses), kBatch);
  std::vector<float> params(model.num_params());
  model.Init(params, 5);
  const std::vector<uint8_t> labels = {0, 2, 1, 2};

  // The relu makes the loss only piecewise smooth: no hidden pre-activation z may cross 0 under
  // a step. Perturbing W1[h][k] moves z_h by eps * x_k, perturbing b1[h] moves it by eps, and the
  // second layer does not move z at all; so with |x| <= 1, |z| > 2 eps everywhere is enough.
  // Draw inputs until that holds (a fixed seed would silently rot if Init's stream changed).
  auto first = MakeLinear(kIn, kHidden);
  auto min_abs_preactivation = [&](const std::vector<float>& x) {
    std::vector<float> z(kBatch * kHidden);  // (B, hidden)
    first->Forward(std::span<const float>(params).first(first->num_params()), x.data(),
                   z.data(), BatchOf(kBatch));
    float min = kInf;
    for (float v : z) min = std::min(min, std::abs(v));
    return min;
  };
  uint64_t x_seed = 100;
  std::vector<float> x = RandomVector(kBatch * kIn, x_seed);
  while (min_abs_preactivation(x) <= 2 * kEps) {
    ASSERT_LT(++x_seed, 200u) << "no input batch keeps the hidden units off the relu kink";
    x = RandomVector(kBatch * kIn, x_seed);
  }

  std::vector<float> grads(model.num_params());
  const float loss = model.ForwardBackward(params, x.data(), labels.data(), kBatch, grads);
  // Mean loss in double for the differences: the float return would round away the signal.
  auto mean_loss = [&] {
    return model.Evaluate(params, x.data(), labels.data(), kBatch).loss_sum / kBatch;
  };
  EXPECT_NEAR(loss, mean_loss(), 1e-6);

  double max_err = 0;
  for (size_t j = 0; j < params.size(); j++) {
    const double numeric = CentralDifference(params, j, kEps, mean_loss);
    const double err = RelErr(grads[j], numeric, 1e-3);
    max_err = std::max(max_err, err);
    EXPECT_LT(err, 1e-3) << "param " << j << ": analytic " << grads[j] << " numeric " << numeric;
  }
  std::printf("model gradient check: max relative error %.3g over %zu params\n", max_err,
              params.size());
}

TEST(ModelTest, ForwardBackwardOverwritesGradsAndIsDeterministic) {
  Model model(Mlp(5, 7, 3), 8);
  std::vector<float> params(model.num_params());
  model.Init(params, 9);
  const std::vector<float> x = RandomVector(6 * 5, 10);
  const std::vector<uint8_t> labels = {0, 1, 2, 2, 1, 0};
  std::vector<float> zeroed(model.num_params(), 0.0f);
  std::vector<float> garbage(model.num_params(), kNaN);
  const float loss1 = model.ForwardBackward(params, x.data(), labels.data(), 6, zeroed);
  const float loss2 = model.ForwardBackward(params, x.data(), labels.data(), 6, garbage);
  EXPECT_EQ(loss1, loss2);
  EXPECT_EQ(std::memcmp(zeroed.data(), garbage.data(), zeroed.size() * sizeof(float)), 0);
  // A smaller batch after a larger one reuses the activations without stale rows leaking in.
  std::vector<float> small(model.num_params());
  Model fresh(Mlp(5, 7, 3), 8);
  std::vector<float> fresh_grads(model.num_params());
  const float loss3 = model.ForwardBackward(params, x.data(), labels.data(), 2, small);
  const float loss4 = fresh.ForwardBackward(params, x.data(), labels.data(), 2, fresh_grads);
  EXPECT_EQ(loss3, loss4);
  EXPECT_EQ(small, fresh_grads);
}

TEST(ModelTest, EvaluateCountsArgmaxWithTiesToLowestIndex) {
  // A single linear(2->2) with W = I, b = 0: the logits are the inputs.
  std::vector<std::unique_ptr<Layer>> layers;
  layers.push_back(MakeLinear(2, 2));
  Model model(std::move(layers), 4);
  const std::vector<float> params = {1, 0, 0, 1, 0, 0};
  const std::vector<float> x = {1, 0,         // argmax 0, label 0: right
                                0, 1,         // argmax 1, label 0: wrong
                                0.5f, 0.5f,   // tie -> 0, label 0: right
                                0.5f, 0.5f};  // tie -> 0, label 1: wrong
  const std::vector<uint8_t> labels = {0, 0, 0, 1};
  const EvalResult r = model.Evaluate(params, x.data(), labels.data(), 4);
  EXPECT_EQ(r.count, 4);
  EXPECT_EQ(r.correct, 2);
  const double confident = std::log(1 + std::exp(-1.0));  // softmax([1, 0])[0]
  const double wrong = std::log(1 + std::exp(1.0));
  EXPECT_NEAR(r.loss_sum, confident + wrong + 2 * std::log(2.0), 1e-6);
}

TEST(ModelDeathTest, ChecksBatchAndLabels) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Model model(Mlp(2, 3, 2), 2);
  std::vector<float> params(model.num_params());
  std::vector<float> grads(model.num_params());
  model.Init(params, 1);
  const std::vector<float> x(3 * 2, 0.5f);
  const std::vector<uint8_t> labels = {0, 1, 0};
  const std::vector<uint8_t> bad_labels = {0, 2};
  EXPECT_DEATH(model.ForwardBackward(params, x.data(), labels.data(), 3, grads), "batch");
  EXPECT_DEATH(model.ForwardBackward(params, x.data(), labels.data(), 0, grads), "batch");
  EXPECT_DEATH(model.Evaluate(params, x.data(), labels.data(), 3), "batch");
  EXPECT_DEATH(model.ForwardBackward(params, x.data(), bad_labels.data(), 2, grads), "label");
  EXPECT_DEATH(model.Evaluate(params, x.data(), bad_labels.data(), 2), "label");
}

// ---------------------------------------------------------------------------------------------
// Sgd

TEST(SgdTest, MomentumAndWeightDecayMatchPyTorchOverThreeSteps) {
  // torch.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01), by hand:
  //   step 1: g' = g + 0.01 w; buf = g';            w -= 0.1 buf
  //   step 2: g' = g + 0.01 w; buf = 0.9 buf + g';  w -= 0.1 buf   (and step 3 alike)
  // w0 = [0.5, -1], g = [0.2, -0.4], [0.1, 0.3], [-0.5, 0]:
  //   step 1: g'  = [0.205, -0.41]
  //           buf = [0.205, -0.41]
  //           w   = [0.5 - 0.0205, -1 + 0.041] = [0.4795, -0.959]
  //   step 2: g'  = [0.1 + 0.004795, 0.3 - 0.00959] = [0.104795, 0.29041]
  //           buf = [0.1845 + 0.104795, -0.369 + 0.29041] = [0.289295, -0.07859]
  //           w   = [0.4795 - 0.0289295, -0.959 + 0.007859] = [0.4505705, -0.951141]
  //   step 3: g'  = [-0.5 + 0.004505705, 0 - 0.00951141] = [-0.495494295, -0.00951141]
  //           buf = [0.2603655 - 0.495494295, -0.070731 - 0.00951141]
  //               = [-0.235128795, -0.08024241]
  //           w   = [0.4505705 + 0.0235128795, -0.951141 + 0.008024241]
  //               = [0.4740833795, -0.943116759]
  Sgd sgd({.learning_rate = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f}, 2);
  std::vector<float> w = {0.5f, -1.0f};
  const std::vector<std::vector<float>> grads = {{0.2f, -0.4f}, {0.1f, 0.3f}, {-0.5f, 0.0f}};
  const std::vector<std::vector<double>> expected = {
      {0.4795, -0.959}, {0.4505705, -0.951141}, {0.4740833795, -0.943116759}};
  for (size_t t = 0; t < 3; t++) {
    sgd.Step(w, grads[t]);
    EXPECT_NEAR(w[0], expected[t][0], 1e-6) << "step " << t + 1;
    EXPECT_NEAR(w[1], expected[t][1], 1e-6) << "step " << t + 1;
  }

  // And bitwise equal to the same recurrence written out in float.
  Sgd sgd2({.learning_rate = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f}, 2);
  std::vector<float> w2 = {0.5f, -1.0f}, ref = {0.5f, -1.0f}, buf(2);
  for (size_t t = 0; t < 3; t++) {
    sgd2.Step(w2, grads[t]);
    for (size_t i = 0; i < 2; i++) {
      const float g = grads[t][i] + 0.01f * ref[i];
      buf[i] = t == 0 ? g : 0.9f * buf[i] + g;
      ref[i] = ref[i] - 0.1f * buf[i];
    }
    EXPECT_EQ(w2, ref) << "step " << t + 1;
  }
}

TEST(SgdTest, WithoutMomentumIsExactlyWMinusLrG) {
  constexpr size_t kN = 1000;
  const float lr = 0.0371f;
  Sgd sgd({.learning_rate = lr}, kN);
  std::vector<float> w = RandomVector(kN, 20, -3, 3);
  std::vector<float> ref = w;
  for (uint64_t step = 0; step < 3; step++) {
    const std::vector<float> g = RandomVector(kN, 21 + step, -2, 2);
    sgd.Step(w, g);
    for (size_t i = 0; i < kN; i++) ref[i] = ref[i] - lr * g[i];
    ASSERT_EQ(std::memcmp(w.data(), ref.data(), kN * sizeof(float)), 0) << "step " << step;
  }
}

TEST(SgdTest, WeightDecayWithoutMomentum) {
  // g' = g + wd w; w -= lr g': w = 2 - 0.5 * (1 + 0.25 * 2) = 1.25 (exact in float).
  Sgd sgd({.learning_rate = 0.5f, .weight_decay = 0.25f}, 1);
  std::vector<float> w = {2.0f};
  const std::vector<float> g = {1.0f};
  sgd.Step(w, g);
  EXPECT_EQ(w[0], 1.25f);
}

TEST(SgdTest, ZeroWeightDecayKeepsInfinityInsteadOfNaN) {
  // 0 * inf would be NaN; without weight decay nothing may multiply the weight.
  for (float momentum : {0.0f, 0.9f}) {
    Sgd sgd({.learning_rate = 0.1f, .momentum = momentum}, 2);
    std::vector<float> w = {kInf, -kInf};
    const std::vector<float> g = {0.0f, 1.0f};
    sgd.Step(w, g);
    EXPECT_EQ(w[0], kInf) << "momentum " << momentum;
    EXPECT_EQ(w[1], -kInf) << "momentum " << momentum;
  }
}

TEST(SgdTest, RejectsBadOptions) {
  EXPECT_THROW(Sgd({.learning_rate = -0.1f}, 1), Error);
  EXPECT_THROW(Sgd({.learning_rate = kNaN}, 1), Error);
  EXPECT_THROW(Sgd({.momentum = -0.5f}, 1), Error);
  EXPECT_THROW(Sgd({.weight_decay = -1.0f}, 1), Error);
  EXPECT_THROW(Sgd({.weight_decay = kInf}, 1), Error);
}

}  // namespace
}  // namespace pipesgd::layers
