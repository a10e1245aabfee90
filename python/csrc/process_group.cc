#include "python/csrc/process_group.h"

#include <Python.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/collective/codec.h"
#include "core/job/config.h"
#include "core/job/worker.h"
#include "transport/factory.h"

namespace pipesgd::torch_backend {

namespace {

double Seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// c10d's Store answers in bytes.
std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string Text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

std::string FirstDifference(const std::string& a, const std::string& b) {
  std::istringstream sa(a), sb(b);
  std::string la, lb;
  while (true) {
    const bool ga = static_cast<bool>(std::getline(sa, la));
    const bool gb = static_cast<bool>(std::getline(sb, lb));
    if (!ga && !gb) return "";
    if (!ga) la = "(nothing)";
    if (!gb) lb = "(nothing)";
    if (la != lb || !ga || !gb) return fmt::format("'{}' against '{}'", la, lb);
  }
}

// Waits for `keys` in the store until `deadline`; throws kDeadlineExceeded naming the ranks
// (`what`(rank) for the rank whose key is missing) that never published theirs.
void WaitForKeys(Store& store, const std::vector<std::string>& keys,
                 const std::vector<int>& ranks, Deadline deadline, const char* what) {
  const auto remaining = std::chrono::milliseconds(
      std::max<int64_t>(1, static_cast<int64_t>(deadline.remaining_s() * 1000)));
  try {
    store.wait(keys, remaining);
  } catch (const std::exception& e) {
    std::vector<int> missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      try {
        if (!store.check({keys[i]})) missing.push_back(ranks[i]);
      } catch (const std::exception&) {
        missing.push_back(ranks[i]);
      }
    }
    Throw(ErrorCode::kDeadlineExceeded,
          "pipesgd backend set-up: {} of rank(s) {} did not arrive in torch's store within the "
          "set-up timeout ({}; the store said: {})",
          what, fmt::join(missing, ", "), "init_process_group's timeout or comm.start_timeout_s",
          e.what());
  }
}

bool HasOverride(const std::vector<std::string>& overrides, const std::string& field) {
  return std::any_of(overrides.begin(), overrides.end(),
                     [&](const std::string& o) { return o.starts_with(field + "="); });
}

std::optional<CodecKind> ParseCodec(const std::string& name) {
  for (CodecKind k : {CodecKind::kNone, CodecKind::kTrunc16, CodecKind::kFp16, CodecKind::kQ8,
                      CodecKind::kQ4, CodecKind::kSign1}) {
    if (name == CodecName(k)) return k;
  }
  return std::nullopt;
}

// The tensor a collective reads and writes: itself when it is on the CPU, else a host copy (CUDA
// staging); both contiguous.
void CheckTensor(const at::Tensor& t, const char* what, int rank) {
  if (t.is_sparse() || !t.is_contiguous()) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: pipesgd backend {}: the tensor must be dense and contiguous (call "
          ".contiguous() first); got {} strides [{}]",
          rank, what, t.is_sparse() ? "a sparse tensor" : "a tensor with",
          fmt::join(t.strides(), ", "));
  }
  if (!t.is_cpu() && !t.is_cuda()) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: pipesgd backend {}: tensors on {} are not supported (expected CPU, or CUDA "
          "staged through the host)",
          rank, what, t.device().str());
  }
}

void CheckOne(const std::vector<at::Tensor>& tensors, const char* what, int rank) {
  if (tensors.size() != 1) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: pipesgd backend {}: expected exactly one tensor per call, got {}", rank, what,
          tensors.size());
  }
  CheckTensor(tensors[0], what, rank);
}

// Each tensor of a list collective's list has `like`'s size and dtype.
void CheckEachLike(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* what,
                   const char* each, const char* other, int rank) {
  for (const at::Tensor& t : list) {
    if (t.numel() != like.numel() || t.scalar_type() != like.scalar_type()) {
      Throw(ErrorCode::kInvalidArgument,
            "rank {}: pipesgd backend {}: {} of {} {} elements for {} of {} {}: expected the "
            "same size and dtype",
            rank, what, each, t.numel(), c10::toString(t.scalar_type()), other, like.numel(),
            c10::toString(like.scalar_type()));
    }
  }
}

std::span<std::byte> BytesOf(at::Tensor& t) {
  return {static_cast<std::byte*>(t.data_ptr()), t.nbytes()};
}

// Runs `fn` on a host version of `t` (itself on the CPU) and copies back to a CUDA tensor.
template <typename F>
void OnHost(at::Tensor& t, F&& fn) {
  if (t.is_cpu()) {
    fn(t);
    return;
  }
  at::Tensor host = t.to(at::kCPU).contiguous();
  fn(host);
  t.copy_(host);
}

}  // namespace

ProcessGroupPipesgd::ProcessGroupPipesgd(const c10::intrusive_ptr<Store>& store, int rank,
                                         int size, const BackendOptions& options)
    : BackendBase(rank, size), options_(options) {
  config::Job job;
  try {
    job = job::CollectiveJobConfig(options.overrides);
  } catch (const Error& e) {
    throw e.Wrap("pipesgd backend options");
  }
  const config::Comm& comm = job.comm();
  collective_timeout_s_ =
      HasOverride(options.overrides, "comm.timeout_s") ? comm.timeout_s() : options.timeout_s;
  const double start_timeout_s = HasOverride(options.overrides, "comm.start_timeout_s")
                                     ? comm.start_timeout_s()
                                     : options.timeout_s;
  const Deadline deadline = Deadline::After(start_timeout_s);
  ring_options_ = job::CommunicatorOptionsFromConfig(job);

  job::JobEnv env;
  env.rank = rank;
  env.world_size = size;
  // Only for choosing the interface on the route toward the master (torchrun's variables).
  if (const char* a = std::getenv("MASTER_ADDR"); a && *a) env.master_addr = a;
  if (const char* p = std::getenv("MASTER_PORT"); p && *p) {
    env.master_port = static_cast<uint16_t>(std::strtoul(p, nullptr, 10));
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  env.host = host;
  const std::vector<int> peers = collective::Communicator::RingPeers(rank, size);
  job::ConnectedTransport made =
      job::CreateJobTransport(env, ring_options_.streams, comm, peers);

  // Every rank's settings against every other's, so that a rank with other options fails on
  // every rank, by name, before anything connects (a rank that only compared with rank 0 would
  // leave its neighbours waiting for it until the deadline).
  const std::string settings =
      fmt::format("{}resolved transport: {}\n", job::JobDescription(job), made.transport->name());
  store->set(fmt::format("pipesgd/settings/{}", rank), Bytes(settings));
  store->set(fmt::format("pipesgd/address/{}", rank), Bytes(made.transport->LocalAddress()));
  std::vector<std::string> keys;
  std::vector<int> ranks;
  for (int r = 0; r < size; ++r) {
    keys.push_back(fmt::format("pipesgd/settings/{}", r));
    ranks.push_back(r);
  }
  WaitForKeys(*store, keys, ranks, deadline, "the settings");
  std::string mismatch;
  for (int r = 0; r < size && mismatch.empty(); ++r) {
    const std::string theirs = Text(store->get(keys[r]));
    if (theirs != settings) {
      mismatch = fmt::format(
          "rank {}: pipesgd backend: rank {}'s settings differ from this rank's: {} (every rank "
          "must pass the same comm settings and resolve the same transport)",
          rank, r, FirstDifference(theirs, settings));
    }
  }
  // Every rank has read every rank's settings before any rank leaves: rank 0 hosts torch's
  // store (env://), and a rank 0 that raised and exited first would leave the others a "Broken
  // pipe" instead of this message.
  store->set(fmt::format("pipesgd/checked/{}", rank), Bytes("1"));
  for (int r = 0; r < size; ++r) keys[r] = fmt::format("pipesgd/checked/{}", r);
  WaitForKeys(*store, keys, ranks, deadline, "the settings check");
  if (!mismatch.empty()) Throw(ErrorCode::kInvalidArgument, "{}", mismatch);
  std::vector<std::string> addresses(size);
  keys.clear();
  ranks.clear();
  for (int p : peers) {
    keys.push_back(fmt::format("pipesgd/address/{}", p));
    ranks.push_back(p);
  }
  WaitForKeys(*store, keys, ranks, deadline, "the address");
  for (size_t i = 0; i < peers.size(); ++i) addresses[peers[i]] = Text(store->get(keys[i]));
  ring_ = collective::Communicator::Create(std::move(made.transport), size, addresses,
                                           ring_options_, deadline);
  describe_ = fmt::format("{}, {} stream(s), chunks of {}", ring_->transport().Describe(),
                          ring_options_.streams,
                          ring_options_.chunk_bytes == 0
                              ? std::string("auto size")
                              : fmt::format("{} bytes", ring_options_.chunk_bytes));
  thread_ = std::thread([this] { Loop(); });
}

ProcessGroupPipesgd::~ProcessGroupPipesgd() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    // A group destroyed with work in flight or queued: that work fails (kAborted) at once
    // instead of waiting out its deadline; with none, this changes nothing.
    abort_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) {
    // The last reference often goes away on a thread that holds the GIL (DDP's Reducer destroyed
    // from Python, the garbage collector) while the communication thread drops the last
    // reference of a tensor that has a Python object, which takes the GIL: a join that kept the
    // GIL would wait forever (seen in the torch tier).
    if (Py_IsInitialized() != 0 && PyGILState_Check() != 0) {
      PyThreadState* state = PyEval_SaveThread();
      thread_.join();
      PyEval_RestoreThread(state);
    } else {
      thread_.join();
    }
  }
  // Hook rings use the job ring's connections: they go first.
  buckets_.clear();
}

c10::intrusive_ptr<WorkBase> ProcessGroupPipesgd::Enqueue(OpType type,
                                                          std::vector<at::Tensor> outputs,
                                                          Body body,
                                                          std::chrono::milliseconds timeout,
                                                          int64_t step) {
  auto work = c10::make_intrusive<PipesgdWork>(getRank(), type, std::move(outputs));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back({work, std::move(body), timeout, type, step});
  }
  wake_.notify_one();
  return work;
}

void ProcessGroupPipesgd::Loop() {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    const double seconds =
        TimeoutSet(task.timeout) ? task.timeout.count() / 1000.0 : collective_timeout_s_;
    std::exception_ptr error;
    const auto begin = std::chrono::steady_clock::now();
    try {
      task.body(Deadline::After(seconds));
    } catch (...) {
      error = std::current_exception();
    }
    const auto end = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // UNKNOWN: the backend's own bookkeeping (HookState), not a collective for a timeline.
      if (task.type != OpType::UNKNOWN) {
        if (spans_.size() == kMaxSpans) spans_.pop_front();
        spans_.push_back({task.type, task.step, Seconds(begin), Seconds(end)});
      }
    }
    task.work->Complete(error);
  }
}

void ProcessGroupPipesgd::Reduce(at::Tensor& tensor, Reduction op, Deadline deadline) {
  const bool ring_op = op == Reduction::kSum || op == Reduction::kAverage;
  const at::ScalarType type = tensor.scalar_type();
  if (ring_op && type == at::kFloat) {
    ring_->AllReduce({tensor.data_ptr<float>(), static_cast<size_t>(tensor.numel())},
                     op == Reduction::kSum ? ReduceOp::kSum : ReduceOp::kAverage, deadline,
                     &abort_);
    return;
  }
  if (ring_op && (type == at::kHalf || type == at::kBFloat16)) {
    at::Tensor wide = tensor.to(at::kFloat);
    Reduce(wide, op, deadline);
    tensor.copy_(wide);
    return;
  }
  // Every rank's bytes, then the same fold in rank order on every rank.
  at::Tensor all = at::empty({getSize(), tensor.numel()}, tensor.options());
  ring_->AllGather(BytesOf(tensor), BytesOf(all), deadline, &abort_);
  at::Tensor acc = all[0].clone();
  for (int r = 1; r < getSize(); ++r) {
    const at::Tensor next = all[r];
    switch (op) {
      case Reduction::kSum:
      case Reduction::kAverage: acc.add_(next); break;
      case Reduction::kProduct: acc.mul_(next); break;
      case Reduction::kMin: acc = at::minimum(acc, next); break;
      case Reduction::kMax: acc = at::maximum(acc, next); break;
      case Reduction::kBitAnd: acc.bitwise_and_(next); break;
      case Reduction::kBitOr: acc.bitwise_or_(next); break;
      case Reduction::kBitXor: acc.bitwise_xor_(next); break;
      case Reduction::kOther: break;
    }
  }
  if (op == Reduction::kAverage) acc.div_(getSize());
  tensor.copy_(acc.view_as(tensor));
}

namespace {
// Refuses, on the caller's thread, what Reduce cannot do for this dtype.
void CheckReduction(const at::Tensor& t, Reduction op, const char* what, int rank) {
  const bool integral = at::isIntegralType(t.scalar_type(), /*includeBool=*/true);
  const char* why = nullptr;
  if (op == Reduction::kOther) why = "PREMUL_SUM and other ops are not supported";
  if ((op == Reduction::kBitAnd || op == Reduction::kBitOr || op == Reduction::kBitXor) &&
      !integral) {
    why = "bitwise ops need an integer or bool tensor";
  }
  if (op == Reduction::kAverage && integral) why = "AVG needs a floating-point tensor";
  if (t.is_complex()) why = "complex tensors are not supported";
  if (why != nullptr) {
    Throw(ErrorCode::kInvalidArgument, "rank {}: pipesgd backend {} of a {} tensor: {}", rank,
          what, c10::toString(t.scalar_type()), why);
  }
}
}  // namespace

c10::intrusive_ptr<WorkBase> ProcessGroupPipesgd::allreduce(std::vector<at::Tensor>& tensors,
                                                            const ::c10d::AllreduceOptions& opts) {
  CheckOne(tensors, "all_reduce", getRank());
  const Reduction op = ReductionOf(opts.reduceOp);
  CheckReduction(tensors[0], op, "all_reduce", getRank());
  at::Tensor t = tensors[0];
  return Enqueue(OpType::ALLREDUCE, tensors, [this, t, op](Deadline deadline) mutable {
    OnHost(t, [&](at::Tensor& host) { Reduce(host, op, deadline); });
  }, opts.timeout);
}

c10::intrusive_ptr<WorkBase> ProcessGroupPipesgd::broadcast(std::vector<at::Tensor>& tensors,
                                                            const ::c10d::BroadcastOptions& opts) {
  CheckOne(tensors, "broadcast", getRank());
  if (opts.rootRank < 0 || opts.rootRank >= getSize()) {
    Throw(ErrorCode::kInvalidArgument, "rank {}: pipesgd backend broadcast: root rank {}: expected 0 <= root < {}",
          getRank(), opts.rootRank, getSize());
  }
  at::Tensor t = tensors[0];
  const int root = static_cast<int>(opts.rootRank);
  return Enqueue(OpType::BROADCAST, tensors, [this, t, root](Deadline deadline) mutable {
    OnHost(t, [&](at::Tensor& host) { ring_->Broadcast(BytesOf(host), root, deadline, &abort_); });
  }, opts.timeout);
}

c10::intrusive_ptr<WorkBase> ProcessGroupPipesgd::_allgather_base(
    at::Tensor& output, at::Tensor& input, const ::c10d::AllgatherOptions& opts) {
  CheckTensor(input, "all_gather", getRank());
  CheckTensor(output, "all_gather", getRank());
  if (output.numel() != input.numel() * getSize() || output.scalar_type() != input.scalar_type()) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: pipesgd backend all_gather: output of {} {} elements for an input of {} {}: "
          "expected world size {} x {} elements of the input's dtype",
          getRank(), output.numel(), c10::toString(output.scalar_type()), input.numel(),
          c10::toString(input.scalar_type()), getSize(), input.numel());
  }
  at::Tensor in = input, out = output;
  return Enqueue(OpType::_ALLGATHER_BASE, {output}, [this, in, out](Deadline deadline) mutable {
    at::Tensor host_in = in.is_cpu() ? in : in.to(at::kCPU);
    OnHost(out, [&](at::Tensor& host_out) {
      ring_->AllGather(BytesOf(host_in), BytesOf(host_out), deadline, &abort_);
    });
  }, opts.timeout);
}

c10::intrusive_ptr<WorkBase> ProcessGroupPipesgd::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const ::c10d::AllgatherOptions& opts) {
  CheckOne(inputs, "all_gather", getRank());
  if (outputs.size() != 1 || static_cast<int>(outputs[0].size()) != getSize()) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: pipesgd backend all_gather: expected one list of world size {} output "
          "tensors, got {} list(s) of {}",
          getRank(), getSize(), outputs.size(), outputs.empty() ? 0 : outputs[0].size());
  }
  const at::Tensor& in = inputs[0];
  CheckEachLike(outputs[0], in, "all_gather", "an output", "an input", getRank());
  std::vector<at::Tensor> outs = outputs[0];
  at::Tensor input = in;
  return Enqueue(OpType::ALLGATHER, outs, [this, input, outs](Deadline deadline) mutable {
    at::Tensor host_in = input.is_cpu() ? input.contiguous() : input.to(at::kCPU).contiguous();
    at::Tensor all = at::empty({getSize() * input.numel()}, host_in.options());
    ring_->AllGather(BytesOf(host_in), BytesOf(all), deadline, &abort_);
    for (int r = 0; r < getSize(); ++r) {
      outs[r].copy_(all.narrow(0, r * input.numel(), input.numel()).view_as(outs[r]));
    }
  }, opts.timeout);
}

c10::intrusive_ptr<WorkBase> ProcessGroupPipesgd::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const ::c10d::ReduceScatterOptions& opts) {
  CheckTensor(input, "reduce_scatter", getRank());
  CheckTensor(output, "reduce_scatter", getRank());
  const Reduction op = ReductionOf(opts.reduceOp);
  CheckReduction(input, op, "reduce_scatter", getRank());
  if (input.numel() != output.numel() * getSize() || output.scalar_type() != input.scalar_type()) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: pipesgd backend reduce_scatter: input of {} {} elements for an output of "
          "{} {}: expected world size {} x {} elements of the output's dtype",
          getRank(), input.numel(), c10::toString(input.scalar_type()), output.numel(),
          c10::toString(output.scalar_type()), getSize(), output.numel());
  }
  at::Tensor in = input, out = output;
  return Enqueue(OpType::_REDUCE_SCATTER_BASE, {output}, [this, in, out, op](Deadline deadline) mutable {
    at::Tensor flat = in.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).reshape({-1});
    Reduce(flat, op, deadline);
    out.copy_(flat.narrow(0, getRank() * out.numel(), out.numel()).view_as(out));
  }, opts.timeout);
}

c10::intrusive_ptr<WorkBase> ProcessGroupPipesgd::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const ::c10d::ReduceScatterOptions& opts) {
  CheckOne(outputs, "reduce_scatter", getRank());
  if (inputs.size() != 1 || static_cast<int>(inputs[0].size()) != getSize()) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: pipesgd backend reduce_scatter: expected one list of world size {} input "
          "tensors, got {} list(s) of {}",
          getRank(), getSize(), inputs.size(), inputs.empty() ? 0 : inputs[0].size());
  }
  const at::Tensor& out = outputs[0];
  const Reduction op = ReductionOf(opts.reduceOp);
  CheckReduction(out, op, "reduce_scatter", getRank());
  CheckEachLike(inputs[0], out, "reduce_scatter", "an input", "an output", getRank());
  std::vector<at::Tensor> ins = inputs[0];
  at::Tensor output = out;
  return Enqueue(OpType::REDUCE_SCATTER, outputs, [this, ins, output, op](Deadline deadline) mutable {
    std::vector<at::Tensor> flat_ins;
    for (const at::Tensor& i : ins) flat_ins.push_back(i.to(at::kCPU).reshape({-1}));
    at::Tensor flat = at::cat(flat_ins);
    Reduce(flat, op, deadline);
    output.copy_(flat.narrow(0, getRank() * output.numel(), output.numel()).view_as(output));
  }, opts.timeout);
}

c10::intrusive_ptr<WorkBase> ProcessGroupPipesgd::barrier(const ::c10d::BarrierOptions& opts) {
  // One float through the whole ring: every rank's result depends on every rank's arrival.
  return Enqueue(OpType::BARRIER, {}, [this](Deadline deadline) {
    float token = 0;
    ring_->AllReduce({&token, 1}, ReduceOp::kSum, deadline, &abort_);
  }, opts.timeout);
}

ProcessGroupPipesgd::HookBucket& ProcessGroupPipesgd::Bucket(int64_t key) {
  return buckets_[key];
}

std::unique_ptr<collective::Communicator> ProcessGroupPipesgd::HookRing(CodecKind codec,
                                                                        bool error_feedback) {
  collective::CommunicatorOptions o = ring_options_;
  o.codec.kind = codec;
  o.error_feedback = error_feedback;
  return collective::Communicator::CreateOnConnections(
      ring_->shared_transport(), getRank(), getSize(), ring_->left_connections(),
      ring_->right_connections(), o);
}

namespace {
void CheckBucket(const at::Tensor& bucket, const char* what, int rank) {
  CheckTensor(bucket, what, rank);
  if (bucket.scalar_type() != at::kFloat) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: pipesgd {}: the bucket is {}; pipesgd's codecs and PowerSGD take float32 "
          "gradients",
          rank, what, c10::toString(bucket.scalar_type()));
  }
}
}  // namespace

c10::intrusive_ptr<WorkBase> ProcessGroupPipesgd::AllReduceCodec(at::Tensor bucket, int64_t key,
                                                                 const std::string& codec,
                                                                 bool error_feedback,
                                                                 int64_t step) {
  CheckBucket(bucket, "codec hook", getRank());
  const std::optional<CodecKind> kind = ParseCodec(codec);
  if (!kind) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: pipesgd codec hook: codec '{}': expected one of none, trunc16, fp16, q8, q4, "
          "sign1",
          getRank(), codec);
  }
  return Enqueue(OpType::ALLREDUCE, {bucket},
                 [this, bucket, key, kind, codec, error_feedback](Deadline deadline) mutable {
    HookBucket& b = Bucket(key);
    if (!b.ring || b.codec != codec || b.error_feedback != error_feedback || b.powersgd) {
      b = HookBucket{};
      b.ring = HookRing(*kind, error_feedback);
      b.codec = codec;
      b.error_feedback = error_feedback;
      Restore(key, b);
    }
    OnHost(bucket, [&](at::Tensor& host) {
      b.ring->AllReduce({host.data_ptr<float>(), static_cast<size_t>(host.numel())},
                        ReduceOp::kAverage, deadline, &abort_);
    });
    const collective::WireStats& s = b.ring->last_wire_stats();
    std::lock_guard<std::mutex> lock(mutex_);
    hook_stats_ = {s.bytes_sent, s.payload_bytes, s.raw_payload_bytes, s.compressed};
  }, std::chrono::milliseconds(-1), step);
}

c10::intrusive_ptr<WorkBase> ProcessGroupPipesgd::AllReducePowerSgd(
    at::Tensor bucket, int64_t key, std::vector<std::vector<int64_t>> matrices, int rank,
    bool compress, int64_t step) {
  CheckBucket(bucket, "PowerSGD hook", getRank());
  if (rank < 1 || rank > 64) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: pipesgd PowerSGD hook: matrix rank {}: expected an integer in [1, 64]",
          getRank(), rank);
  }
  std::vector<collective::PowerSgd::Matrix> layout;
  for (const auto& m : matrices) {
    if (m.size() != 3 || m[0] < 0 || m[1] < 1 || m[2] < 1) {
      Throw(ErrorCode::kInvalidArgument,
            "rank {}: pipesgd PowerSGD hook: a matrix must be (offset >= 0, rows >= 1, cols >= "
            "1), got ({})",
            getRank(), fmt::join(m, ", "));
    }
    layout.push_back({static_cast<uint64_t>(m[0]), static_cast<uint64_t>(m[1]),
                      static_cast<uint64_t>(m[2])});
  }
  return Enqueue(OpType::ALLREDUCE, {bucket},
                 [this, bucket, key, layout, rank, compress](Deadline deadline) mutable {
    HookBucket& b = Bucket(key);
    const auto count = static_cast<uint64_t>(bucket.numel());
    auto same = [&](const std::vector<collective::PowerSgd::Matrix>& a) {
      return a.size() == layout.size() &&
             std::equal(a.begin(), a.end(), layout.begin(), [](const auto& x, const auto& y) {
               return x.offset == y.offset && x.rows == y.rows && x.cols == y.cols;
             });
    };
    if (!b.powersgd || b.count != count || b.powersgd_rank != rank || !same(b.matrices)) {
      // A new bucket, or DDP rebuilt its buckets: new factors and residuals, from the same
      // seed on every rank.
      b = HookBucket{};
      b.ring = HookRing(CodecKind::kNone, false);
      collective::PowerSgdOptions p;
      p.rank = rank;
      p.seed = static_cast<uint64_t>(key);
      b.powersgd = std::make_unique<collective::PowerSgd>(*b.ring, count, layout, p);
      b.count = count;
      b.matrices = layout;
      b.powersgd_rank = rank;
      Restore(key, b);
    }
    collective::AllReduceOptions call;
    call.compress = compress;
    OnHost(bucket, [&](at::Tensor& host) {
      b.powersgd->AllReduce({host.data_ptr<float>(), count}, ReduceOp::kAverage, deadline,
                            &abort_, call);
    });
    const collective::WireStats& s = b.powersgd->last_wire_stats();
    std::lock_guard<std::mutex> lock(mutex_);
    hook_stats_ = {s.bytes_sent, s.payload_bytes, s.raw_payload_bytes, s.compressed};
  }, std::chrono::milliseconds(-1), step);
}

std::vector<at::Tensor> ProcessGroupPipesgd::HookState(int64_t key) {
  auto out = std::make_shared<std::vector<at::Tensor>>();
  auto copy = [](std::span<const float> v) {
    at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kFloat);
    std::copy(v.begin(), v.end(), t.data_ptr<float>());
    return t;
  };
  Enqueue(OpType::UNKNOWN, {}, [this, key, out, copy](Deadline) {
    const auto it = buckets_.find(key);
    if (it == buckets_.end()) return;
    const HookBucket& b = it->second;
    if (b.powersgd) {
      *out = {copy(b.powersgd->factors()), copy(b.powersgd->residual())};
    } else if (b.ring) {
      *out = {copy(b.ring->residual())};
    }
  }, std::chrono::milliseconds(-1))->wait();
  return *out;
}

void ProcessGroupPipesgd::RestoreHookState(int64_t key, std::vector<at::Tensor> state) {
  for (const at::Tensor& t : state) CheckBucket(t, "hook state", getRank());
  Enqueue(OpType::UNKNOWN, {}, [this, key, state = std::move(state)](Deadline) {
    buckets_.erase(key);
    restore_[key] = state;
  }, std::chrono::milliseconds(-1))->wait();
}

void ProcessGroupPipesgd::Restore(int64_t key, HookBucket& b) {
  const auto it = restore_.find(key);
  if (it == restore_.end()) return;
  const std::vector<at::Tensor> state = std::move(it->second);
  restore_.erase(it);
  if (state.empty()) return;  // saved before the bucket's first call: it starts fresh
  auto span = [](const at::Tensor& t) {
    return std::span<const float>(t.data_ptr<float>(), static_cast<size_t>(t.numel()));
  };
  if (b.powersgd) {
    if (state.size() != 2) {
      Throw(ErrorCode::kInvalidArgument,
            "rank {}: hook bucket {}: a saved state of {} tensors for PowerSGD; expected 2 "
            "(factors, residual)",
            getRank(), key, state.size());
    }
    b.powersgd->Restore(span(state[0]), span(state[1]));
  } else {
    if (state.size() != 1 || (!b.error_feedback && state[0].numel() > 0)) {
      Throw(ErrorCode::kInvalidArgument,
            "rank {}: hook bucket {}: a saved state of {} tensors ({} floats first) for codec "
            "{} with error feedback {}; expected one residual, empty without error feedback",
            getRank(), key, state.size(), state[0].numel(), b.codec, b.error_feedback);
    }
    b.ring->RestoreResidual(span(state[0]));
  }
}

std::vector<CommSpan> ProcessGroupPipesgd::TakeSpans() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<CommSpan> out(std::make_move_iterator(spans_.begin()),
                            std::make_move_iterator(spans_.end()));
  spans_.clear();
  return out;
}

HookWireStats ProcessGroupPipesgd::last_hook_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hook_stats_;
}

}  // namespace pipesgd::torch_backend
