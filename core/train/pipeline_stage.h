// One pipeline stage (PipeDream, Narayanan et al., SOSP 2019): a contiguous range of a model's
// layers with its own parameter slice, the activations of every micro-batch in flight, and
// weight stashing (Sec. 3.3): the forward of micro-batch i uses the latest weights and stashes
// them; the backward of i computes its gradient with exactly that stash (not with weights that
// later updates changed), and the update it feeds applies to the latest weights. Each update
// is a new weight version (0 = the initial weights); the stash records the version, so tests
// and callers can check which weights a backward used.
//
// Layout per micro-batch slot (slot = micro-batch mod max_in_flight; forwards and backwards
// each run in ascending order, PipelineSchedule's guarantee, so a slot is free again before it
// is reused, checked): the input x (B, in), each layer's output, their gradients, the layers'
// workspaces and the stashed weights. The first stage's caller copies data into the input; a
// later stage receives its input there (core/train/pipeline_p2p.h), and the gradient of its
// output likewise.
//
// The random layers (Dropout) get Pass::key = RandomKey(seed, step, GLOBAL layer index), so a
// split model draws exactly what the unsplit layers::Model does on the same batch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/train/trainer.h"
#include "layers/layer.h"
#include "layers/model.h"

namespace pipesgd::train {

// Where each stage after the first begins, balanced by parameter count: for k = 1..M-1,
// boundary b_k is the layer index j in [b_{k-1}+1, L-(M-k)] whose prefix parameter count (the
// parameters of layers 0..j-1) is nearest to k*total/M (the smaller j on a tie), so every stage
// gets at least one layer. `layer_params[i]` = layer i's num_params(). Throws
// Error(kInvalidArgument) if stages < 1 or stages > the number of layers.
std::vector<size_t> BalancedBoundaries(const std::vector<size_t>& layer_params, int stages);

// Checks `boundaries` (M-1 layer indices, strictly ascending, in (0, layers)). Throws
// Error(kInvalidArgument) naming the bad value and what was expected.
void CheckBoundaries(const std::vector<size_t>& boundaries, size_t layers);

// Stage `stage`'s part of a model whose layers hold `layer_params` parameters each, split at
// `boundaries` (CheckBoundaries'd): its layers [first_layer, end_layer) and their parameters
// [param_offset, param_offset + param_count) of the whole model's buffer, so that a split run
// starts from the unsplit model's initial weights. REQUIRES 0 <= stage <= boundaries.size().
struct StageSlice {
  size_t first_layer = 0;
  size_t end_layer = 0;
  size_t param_offset = 0;
  size_t param_count = 0;
};
StageSlice StageSliceOf(const std::vector<size_t>& layer_params,
                        const std::vector<size_t>& boundaries, int stage);

class PipelineStage {
 public:
  // `layers` = layers [first_layer, first_layer + layers.size()) of the full model, chaining
  // (Error kInvalidArgument naming both layers and shapes otherwise). `has_loss`: this is the
  // last stage, its output is the logits and it applies softmax cross-entropy. `max_batch`
  // bounds every micro-batch's rows; `max_in_flight` (>= 1) the micro-batches forwarded and not
  // yet backwarded. `params` = this stage's initial weights (num_params floats; Error
  // kInvalidArgument on a size mismatch).
  PipelineStage(std::vector<std::unique_ptr<layers::Layer>> layers, size_t first_layer,
                bool has_loss, size_t max_batch, int max_in_flight,
                std::span<const float> params);

  size_t num_params() const { return num_params_; }
  layers::Shape in_shape() const { return layers_.front()->in_shape(); }
  layers::Shape out_shape() const { return layers_.back()->out_shape(); }
  size_t first_layer() const { return first_layer_; }
  size_t num_layers() const { return layers_.size(); }
  bool has_loss() const { return has_loss_; }
  int max_in_flight() const { return static_cast<int>(slots_.size()); }
  std::string Describe() const;

  // The latest weights and their version (updates applied so far).
  std::span<const float> params() const { return params_; }
  int64_t version() const { return version_; }

  // Micro-batch `mb`'s input (max_batch * in floats): fill its first batch*in floats before
  // Forward(mb). The slot must be free (its previous micro-batch backwarded).
  float* InputBuffer(int mb);
  // Forward of micro-batch `mb` over `batch` rows of InputBuffer(mb) with the latest weights,
  // which it stashes (version()). The last stage takes `labels` (batch), computes the mean loss
  // and its gradient and returns the loss; other stages return 0 and leave the output in
  // Output(mb). `key`: the micro-batch's seed, step and first global row, as for layers::Model.
  // Throws Error(kInvalidArgument) for batch outside [1, max_batch], a busy slot, or a last
  // stage without labels.
  float Forward(int mb, size_t batch, const layers::BatchKey& key,
                const uint8_t* labels = nullptr);
  // The output (batch * out floats) of micro-batch mb's forward.
  const float* Output(int mb) const;
  // Where the gradient of micro-batch mb's output goes (batch * out floats) before Backward(mb)
  // on a stage without the loss.
  float* OutputGradBuffer(int mb);

  // Backward of micro-batch `mb` (forwarded, not yet backwarded) with the weights its forward
  // stashed: OVERWRITES grads (num_params floats) with dLoss/dparams of the mean loss over the
  // micro-batch and leaves dLoss/dinput in InputGrad(mb) (not on the first stage, layer 0 with
  // first_layer 0 skips it). Frees the slot's weights for reuse but keeps InputGrad(mb) valid
  // until the slot's next Forward. Returns the version of the weights it used.
  // Throws Error(kInvalidArgument) if mb is not in flight.
  int64_t Backward(int mb, std::span<float> grads);
  const float* InputGrad(int mb) const;

  // Applies `grads` to the latest weights with `optimizer` (whatever its rule) and starts a new
  // version.
  void Update(Optimizer& optimizer, std::span<const float> grads);
  // Replaces the latest weights (e.g. with their average over the stage's replicas): a new
  // version. Error(kInvalidArgument) on a size mismatch.
  void SetParams(std::span<const float> params);

 private:
  struct Slot {
    int mb = -1;  // micro-batch held, -1: free
    bool forwarded = false;
    size_t batch = 0;
    layers::BatchKey key;
    int64_t version = 0;                           // of the stashed weights
    std::vector<float> weights;                    // the stash (num_params)
    std::vector<std::vector<float>> acts;          // acts[i]: input of layer i; back(): output
    std::vector<std::vector<float>> grad_acts;     // same shapes
    std::vector<std::vector<std::byte>> workspaces;
  };
  Slot& SlotFor(int mb);
  const Slot& SlotFor(int mb) const;
  layers::Pass LayerPass(Slot& slot, size_t i);

  std::vector<std::unique_ptr<layers::Layer>> layers_;
  size_t first_layer_ = 0;
  bool has_loss_ = false;
  size_t max_batch_ = 0;
  std::vector<size_t> param_offsets_;
  size_t num_params_ = 0;
  std::vector<float> params_;
  int64_t version_ = 0;
  std::vector<Slot> slots_;
};

}  // namespace pipesgd::train
