// Everything that depends on torch's version, for torch 1.13 (Debian 12's python3-torch and
// libtorch-dev): the class a c10d backend derives from, its Work and Future, and the reduce op.
// torch 2.0 split c10d::ProcessGroup into a ProcessGroup that dispatches and a c10d::Backend
// that implements; a port to 2.x derives PipesgdBackendBase from c10d::Backend, registers the
// creator with a `devices` list, and changes this file and the registration in
// python/pipesgd/torch/__init__.py only.
#pragma once

#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "pipesgd/types.h"

namespace pipesgd::torch_backend {

using BackendBase = ::c10d::ProcessGroup;
using WorkBase = ::c10d::Work;
using Store = ::c10d::Store;
using OpType = ::c10d::OpType;

// What a c10d ReduceOp asks of us: a ring reduction (sum, average) or one of the others, which
// the backend computes locally from an all-gather (see process_group.h).
enum class Reduction { kSum, kAverage, kProduct, kMin, kMax, kBitAnd, kBitOr, kBitXor, kOther };

inline Reduction ReductionOf(const ::c10d::ReduceOp& op) {
  switch (op.op_) {
    case ::c10d::ReduceOp::SUM: return Reduction::kSum;
    case ::c10d::ReduceOp::AVG: return Reduction::kAverage;
    case ::c10d::ReduceOp::PRODUCT: return Reduction::kProduct;
    case ::c10d::ReduceOp::MIN: return Reduction::kMin;
    case ::c10d::ReduceOp::MAX: return Reduction::kMax;
    case ::c10d::ReduceOp::BAND: return Reduction::kBitAnd;
    case ::c10d::ReduceOp::BOR: return Reduction::kBitOr;
    case ::c10d::ReduceOp::BXOR: return Reduction::kBitXor;
    default: return Reduction::kOther;
  }
}

// A per-call timeout, or none (the group's): c10d's options carry kUnsetTimeout (-1 ms).
inline bool TimeoutSet(std::chrono::milliseconds t) { return t.count() >= 0; }

// A Work whose completion the backend's thread reports: isCompleted/wait/exception come from
// the base class, the future holds the output tensors (what DDP's reducer and comm hooks read).
class PipesgdWork final : public WorkBase {
 public:
  PipesgdWork(int rank, OpType type, std::vector<at::Tensor> outputs)
      : WorkBase(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  // Called once, on the backend's thread. The future first, as gloo does: a waiter woken by
  // finish() may read it at once.
  void Complete(std::exception_ptr error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
    finish(error);
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace pipesgd::torch_backend
