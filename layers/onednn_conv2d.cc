// 2-D convolution on oneDNN's direct kernels, the library PyTorch's CPU convolutions come from:
// the same layer as conv2d.cc (the same parameters, the same plain NCHW buffers in and out), with
// the activations and weights reordered into the blocked layouts oneDNN picks for this CPU.
//
// Per batch size, the three primitives (forward, backward data, backward weights) and the
// reorders around them are made once and kept: making them costs milliseconds, running them
// microseconds. The workspace holds the reordered input from Forward to Backward (backward
// weights reads it again) and the scratch copies of the other tensors.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "core/base/check.h"
#include "core/base/error.h"
#include "layers/layer.h"
#include "layers/onednn.h"
#include "core/base/rng.h"
#include "layers/spatial.h"

namespace pipesgd::layers {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;
constexpr auto kF32 = memory::data_type::f32;

memory::dim Dim(size_t n) { return static_cast<memory::dim>(n); }

// Everything one batch size needs, made once.
struct Plan {
  dnnl::convolution_forward forward;
  dnnl::convolution_backward_data backward_data;
  dnnl::convolution_backward_weights backward_weights;
  // The plain buffers as seen by each primitive.
  onednn::Layout src, weights, dst;                            // forward
  onednn::Layout diff_dst_data, weights_data, diff_src;        // backward data
  onednn::Layout src_weights, diff_dst_weights, diff_weights;  // backward weights
  memory::desc bias;                                           // always plain (x)
  // Workspace: [src (kept from Forward to Backward) | the rest, reused within one call].
  size_t src_offset = 0, scratch_offset = 0, bytes = 0;
};

class OneDnnConv2d final : public Conv2dLayer {
 public:
  explicit OneDnnConv2d(const Conv2dGeometry& geom) : Conv2dLayer(geom) {}

  size_t workspace_bytes(size_t batch) const override {
    return PlanFor(batch).bytes + onednn::kAlignSlack;
  }

  void Forward(std::span<const float> params, const float* x, float* y,
               const Pass& pass) const override {
    PSGD_CHECK_EQ(params.size(), num_params());
    const Plan& plan = PlanFor(pass.batch);
    std::byte* ws = Workspace(pass, plan);
    std::byte* scratch = ws + plan.scratch_offset;
    dnnl::stream stream(onednn::Engine());
    const memory src = plan.src.Read(stream, x, ws + plan.src_offset);
    const memory weights = plan.weights.Read(stream, params.data(), scratch);
    scratch += plan.weights.scratch_bytes();
    const memory bias(plan.bias, onednn::Engine(),
                      const_cast<float*>(params.data() + g_.out_channels * g_.patch));
    const memory dst = plan.dst.Output(y, scratch);
    plan.forward.execute(stream, {{DNNL_ARG_SRC, src},
                                  {DNNL_ARG_WEIGHTS, weights},
                                  {DNNL_ARG_BIAS, bias},
                                  {DNNL_ARG_DST, dst}});
    plan.dst.Store(stream, dst, y);
    stream.wait();
  }

  void Backward(std::span<const float> params, const float* x, const float* y, const float* dy,
                std::span<float> grads, float* dx, const Pass& pass) const override {
    PSGD_CHECK_EQ(params.size(), num_params());
    PSGD_CHECK_EQ(grads.size(), num_params());
    const Plan& plan = PlanFor(pass.batch);
    std::byte* ws = Workspace(pass, plan);
    dnnl::stream stream(onednn::Engine());
    // The input as Forward reordered it, unless backward weights wants another layout.
    std::byte* scratch = ws + plan.scratch_offset;
    memory src = plan.src.converts()
                     ? memory(plan.src.kernel(), onednn::Engine(), ws + plan.src_offset)
                     : memory(plan.src.kernel(), onednn::Engine(), const_cast<float*>(x));
    if (plan.src_weights.kernel() != plan.src.kernel()) {
      src = plan.src_weights.Read(stream, x, scratch);
      scratch += plan.src_weights.scratch_bytes();
    }
    const memory diff_dst = plan.diff_dst_weights.Read(stream, dy, scratch);
    scratch += plan.diff_dst_weights.scratch_bytes();
    const memory diff_weights = plan.diff_weights.Output(grads.data(), scratch);
    scratch += plan.diff_weights.scratch_bytes();
    const memory diff_bias(plan.bias, onednn::Engine(), grads.data() + g_.out_channels * g_.patch);
    plan.backward_weights.execute(stream, {{DNNL_ARG_SRC, src},
                                           {DNNL_ARG_DIFF_DST, diff_dst},
                                           {DNNL_ARG_DIFF_WEIGHTS, diff_weights},
                                           {DNNL_ARG_DIFF_BIAS, diff_bias}});
    plan.diff_weights.Store(stream, diff_weights, grads.data());
    if (dx != nullptr) {
      const memory diff_dst_data = plan.diff_dst_data.kernel() == plan.diff_dst_weights.kernel()
                                       ? diff_dst
                                       : plan.diff_dst_data.Read(stream, dy, scratch);
      scratch += plan.diff_dst_data.scratch_bytes();
      const memory weights = plan.weights_data.Read(stream, params.data(), scratch);
      scratch += plan.weights_data.scratch_bytes();
      const memory diff_src = plan.diff_src.Output(dx, scratch);
      plan.backward_data.execute(stream, {{DNNL_ARG_DIFF_DST, diff_dst_data},
                                          {DNNL_ARG_WEIGHTS, weights},
                                          {DNNL_ARG_DIFF_SRC, diff_src}});
      plan.diff_src.Store(stream, diff_src, dx);
    }
    stream.wait();
  }

 private:
  std::byte* Workspace(const Pass& pass, const Plan& plan) const {
    PSGD_CHECK_GE(pass.workspace.size(), plan.bytes + onednn::kAlignSlack);
    return onednn::Aligned(pass.workspace);
  }

  const Plan& PlanFor(size_t batch) const {
    PSGD_CHECK_GE(batch, size_t{1});
    return plans_.Get(batch, [this](size_t b) { return MakePlan(b); });
  }

  std::unique_ptr<Plan> MakePlan(size_t batch) const {
    const auto& engine = onednn::Engine();
    const memory::dims src_dims{Dim(batch), Dim(g_.in.channels), Dim(g_.in.height),
                                Dim(g_.in.width)};
    const memory::dims weights_dims{Dim(g_.out_channels), Dim(g_.in.channels), Dim(g_.kernel),
                                    Dim(g_.kernel)};
    const memory::dims dst_dims{Dim(batch), Dim(g_.out.channels), Dim(g_.out.height),
                                Dim(g_.out.width)};
    const memory::dims strides{Dim(g_.stride), Dim(g_.stride)};
    const memory::dims padding{Dim(g_.padding), Dim(g_.padding)};
    const memory::desc src_any(src_dims, kF32, Tag::any), dst_any(dst_dims, kF32, Tag::any),
        weights_any(weights_dims, kF32, Tag::any);
    const memory::desc src_plain(src_dims, kF32, Tag::nchw), dst_plain(dst_dims, kF32, Tag::nchw),
        weights_plain(weights_dims, kF32, Tag::oihw);
    auto plan = std::make_unique<Plan>();
    plan->bias = memory::desc({Dim(g_.out_channels)}, kF32, Tag::x);

    const dnnl::convolution_forward::primitive_desc forward(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training,
                                        dnnl::algorithm::convolution_direct, src_any, weights_any,
                                        plan->bias, dst_any, strides, padding, padding),
        engine);
    const dnnl::convolution_backward_data::primitive_desc backward_data(
        dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, src_any,
                                              weights_any, dst_any, strides, padding, padding),
        engine, forward);
    const dnnl::convolution_backward_weights::primitive_desc backward_weights(
        dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src_any,
                                                 weights_any, plan->bias, dst_any, strides, padding,
                                                 padding),
        engine, forward);
    plan->forward = dnnl::convolution_forward(forward);
    plan->backward_data = dnnl::convolution_backward_data(backward_data);
    plan->backward_weights = dnnl::convolution_backward_weights(backward_weights);
    plan->src = onednn::Layout(src_plain, forward.src_desc());
    plan->weights = onednn::Layout(weights_plain, forward.weights_desc());
    plan->dst = onednn::Layout(dst_plain, forward.dst_desc());
    plan->diff_dst_data = onednn::Layout(dst_plain, backward_data.diff_dst_desc());
    plan->weights_data = onednn::Layout(weights_plain, backward_data.weights_desc());
    plan->diff_src = onednn::Layout(src_plain, backward_data.diff_src_desc());
    plan->src_weights = onednn::Layout(src_plain, backward_weights.src_desc());
    plan->diff_dst_weights = onednn::Layout(dst_plain, backward_weights.diff_dst_desc());
    plan->diff_weights = onednn::Layout(weights_plain, backward_weights.diff_weights_desc());
    if (backward_weights.diff_bias_desc() != plan->bias) {
      Throw(ErrorCode::kInternal, "oneDNN backward weights of {} wants a blocked bias gradient",
            name());
    }

    plan->src_offset = 0;
    plan->scratch_offset = plan->src.scratch_bytes();
    const size_t forward_scratch = plan->weights.scratch_bytes() + plan->dst.scratch_bytes();
    const size_t backward_scratch =
        plan->src_weights.scratch_bytes() + plan->diff_dst_weights.scratch_bytes() +
        plan->diff_weights.scratch_bytes() + plan->diff_dst_data.scratch_bytes() +
        plan->weights_data.scratch_bytes() + plan->diff_src.scratch_bytes();
    plan->bytes = plan->scratch_offset + std::max(forward_scratch, backward_scratch);
    return plan;
  }

  onednn::PlanCache<Plan> plans_;
};

}  // namespace

std::unique_ptr<Layer> MakeOneDnnConv2d(const Shape& in, size_t out_channels, size_t kernel,
                                        size_t stride, size_t padding) {
  try {
    auto layer =
        std::make_unique<OneDnnConv2d>(Conv2dGeometry(in, out_channels, kernel, stride, padding));
    (void)layer->workspace_bytes(1);  // a shape oneDNN cannot take fails here, not mid-step
    return layer;
  } catch (const dnnl::error& e) {
    Throw(ErrorCode::kInvalidArgument, "oneDNN has no convolution for input {}: {} (status {})",
          ToString(in), e.what(), static_cast<int>(e.status));
  }
}

}  // namespace pipesgd::layers
