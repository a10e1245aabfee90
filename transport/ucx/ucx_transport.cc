// Over 600 lines because the connection (tag matching, endpoint errors, the op queue's request
// state) and the transport (context, worker, event fd, wire-up through the rendezvous address)
// share private state; the wait loop itself is Transport::Wait's.
#include "transport/ucx/ucx_transport.h"

#include <poll.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>
#include <set>
#include <vector>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "transport/message_io.h"
#include "transport/op_queue.h"
#include "transport/wire.pb.h"

namespace pipesgd::transport::ucx {
namespace {

// Tag layout: [kind:2][sender rank:22][stream:8][sequence:32].
enum class TagKind : uint64_t { kData = 0, kHello = 1 };
constexpr int kRankBits = 22;
constexpr int kMaxStreams = 256;
constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};

ucp_tag_t MakeTag(TagKind kind, int sender, int stream, uint32_t seq) {
  return (static_cast<uint64_t>(kind) << 62) | (static_cast<uint64_t>(sender) << 40) |
         (static_cast<uint64_t>(stream) << 32) | seq;
}

constexpr size_t kHelloBytes = 256;
// How long receives keep going after the peer's endpoint failed (see UcxConnection::Advance).
constexpr auto kPeerErrorGrace = std::chrono::milliseconds(500);  // a serialized ConnectionHello is far smaller

std::string StatusText(ucs_status_t status) {
  return fmt::format("{} (UCX status {})", ucs_status_string(status), static_cast<int>(status));
}

// Text a UCX print function writes to a FILE*.
template <typename F>
std::string Capture(F print) {
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (!f) return "";
  print(f);
  std::fclose(f);
  std::string out(text ? text : "", size);
  std::free(text);
  return out;
}

// "tcp/eth0, posix/memory" from ucp_ep_print_info's "lane[i]: ... <tl>/<dev> ..." lines.
std::string EndpointLanes(ucp_ep_h ep) {
  const std::string info = Capture([&](FILE* f) { ucp_ep_print_info(ep, f); });
  std::vector<std::string> lanes;
  size_t pos = 0;
  while ((pos = info.find("lane[", pos)) != std::string::npos) {
    size_t end = info.find('\n', pos);
    std::string line = info.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    pos = end == std::string::npos ? info.size() : end;
    // e.g. "lane[0]:  1:tcp/eth0.0 md[1]           -> md[1]/tcp/sysdev[255] am am_bw#0"
    size_t colon = line.find(':', line.find(']'));
    if (colon == std::string::npos) continue;
    size_t start = line.find(':', colon + 1);
    if (start == std::string::npos) continue;
    size_t stop = line.find(' ', start);
    std::string tl = line.substr(start + 1, stop == std::string::npos ? std::string::npos : stop - start - 1);
    size_t dot = tl.rfind('.');
    if (dot != std::string::npos && tl.find('/') != std::string::npos && dot > tl.find('/')) tl.resize(dot);
    if (std::find(lanes.begin(), lanes.end(), tl) == lanes.end()) lanes.push_back(tl);
  }
  return lanes.empty() ? std::string("unknown lanes") : fmt::format("{}", fmt::join(lanes, ", "));
}

// True if UCX_TLS names only shared-memory transports (and self): in UCX 1.13 none of them
// handles peer failure, so asking for it would only make endpoint creation fail (loudly).
bool SharedMemoryOnly(const char* tls) {
  if (!tls || !*tls || tls[0] == '^') return false;
  static const std::set<std::string> kShm = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self", "mm"};
  std::string list(tls);
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    std::string name = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!kShm.count(name)) return false;
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return true;
}

class UcxTransport;

class UcxRegion final : public MemoryRegion {
 public:
  UcxRegion(UcxTransport& owner, void* data, size_t bytes, MemoryKind kind, ucp_mem_h memh);
  ~UcxRegion() override;
  ucp_mem_h memh() const { return memh_; }

 private:
  UcxTransport& owner_;
  ucp_mem_h memh_;
};

class UcxConnection final : public Connection {
 public:
  UcxConnection(UcxTransport& owner, int self_rank, int peer_rank, int stream);
  ~UcxConnection() override;

  int peer_rank() const override { return peer_rank_; }
  int stream() const { return stream_; }
  void PostSend(Op& op) override;
  void PostRecv(Op& op) override;

  // Creates the endpoint to the peer's worker. Throws Error kUnavailable.
  void Open(const ucp_address_t* address);
  ucp_ep_h ep() const { return ep_; }
  // Completes finished ops in order; handles a failure reported by UCX. Outside progress only.
  void Advance();
  // Fails every pending and future op with `error`, cancels outstanding requests and closes the
  // endpoint. Outside progress only.
  void Fail(std::exception_ptr error);
  bool idle() const { return !send_.head && !recv_.head && !close_request_; }
  // Starts flushing the endpoint (UCX request, or null when there is nothing to wait for).
  void* StartFlush();
  const std::exception_ptr& failed() const { return failed_; }

  // UCX's endpoint error callback (inside ucp_worker_progress): only records the status.
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);

 private:
  template <bool kSend>
  void Post(Op& op);
  template <bool kSend>
  void AdvanceQueue(OpQueue& queue);
  std::exception_ptr OpError(const char* direction, const Op& op, ucs_status_t status) const;
  std::exception_ptr PeerError() const;

  UcxTransport& owner_;
  int self_rank_;
  int peer_rank_;
  int stream_;
  ucp_ep_h ep_ = nullptr;
  void* close_request_ = nullptr;
  uint32_t send_seq_ = 0;
  uint32_t recv_seq_ = 0;
  OpQueue send_;
  OpQueue recv_;
  ucs_status_t peer_error_ = UCS_OK;  // set by OnEndpointError
  Deadline::Clock::time_point peer_error_at_{};
  std::exception_ptr failed_;
};

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(const UcxOptions& options);
  ~UcxTransport() override;

  std::string name() const override { return "ucx"; }
  int rank() const override { return options_.rank; }
  Capabilities capabilities() const override {
    return {.byte_stream = false, .cuda_memory = cuda_memory_};
  }
  std::string Describe() const override;
  std::string LocalAddress() const override { return address_; }
  std::unique_ptr<MemoryRegion> RegisterMemory(void* data, size_t bytes, MemoryKind kind) override;
  std::vector<std::unique_ptr<Connection>> Connect(
      const std::vector<std::pair<int, std::string>>& peers, Deadline deadline,
      int streams) override;
  void Poll() override;
  void Close() override;

  ucp_worker_h worker() const { return worker_; }
  ucp_context_h context() const { return context_; }
  void NoteNoPeerFailureDetection(int peer) {
    if (!peer_failure_detection_) return;
    peer_failure_detection_ = false;
    PSGD_LOG_WARN("rank {}: UCX has no peer failure handling on the transports it selected for "
                  "rank {} (UCX 1.13's shared memory: UCX_TLS={}); a dead peer will be reported "
                  "only when a wait's deadline passes (comm.timeout_s)",
                  options_.rank, peer, std::getenv("UCX_TLS") ? std::getenv("UCX_TLS") : "(unset)");
  }
  void Register(UcxConnection* c) { live_.insert(c); }
  void Unregister(UcxConnection* c) { live_.erase(c); }
  void AddRegion(UcxRegion* r) { regions_.push_back(r); }
  void RemoveRegion(UcxRegion* r) { regions_.erase(std::find(regions_.begin(), regions_.end(), r)); }
  // The memory handle of the newest region containing [p, p + n), or null.
  ucp_mem_h FindMemh(const void* p, size_t n) const {
    for (auto it = regions_.rbegin(); it != regions_.rend(); ++it) {
      if ((*it)->Contains(p, n)) return (*it)->memh();
    }
    return nullptr;
  }
  // One round of progress and completions; true if UCX made progress.
  bool ProgressOnce() override;
  // Sleeps on the worker's event fd until something happens or `until`, whichever is first.
  void Sleep(Deadline::Clock::time_point until);

 protected:
  void Idle(Deadline::Clock::time_point until) override { Sleep(until); }
  // A reply is often microseconds away: spin briefly before sleeping on the event fd.
  int SpinsBeforeIdle() const override { return 64; }

 private:
  UcxOptions options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  bool cuda_memory_ = false;
  bool peer_failure_detection_ = true;
  std::string address_;
  std::string lanes_;  // what the first endpoint runs over, for Describe()
  std::set<UcxConnection*> live_;
  std::vector<UcxRegion*> regions_;
};

// ---------------------------------------------------------------------------------------------
// UcxRegion

UcxRegion::UcxRegion(UcxTransport& owner, void* data, size_t bytes, MemoryKind kind,
                     ucp_mem_h memh)
    : MemoryRegion(data, bytes, kind), owner_(owner), memh_(memh) {
  owner_.AddRegion(this);
}

UcxRegion::~UcxRegion() {
  owner_.RemoveRegion(this);
  const ucs_status_t status = ucp_mem_unmap(owner_.context(), memh_);
  if (status != UCS_OK) {
    PSGD_LOG_WARN("rank {}: ucp_mem_unmap of {} bytes failed: {}", owner_.rank(), bytes(),
                  StatusText(status));
  }
}

// ---------------------------------------------------------------------------------------------
// UcxConnection

UcxConnection::UcxConnection(UcxTransport& owner, int self_rank, int peer_rank, int stream)
    : owner_(owner), self_rank_(self_rank), peer_rank_(peer_rank), stream_(stream) {
  owner_.Register(this);
}

UcxConnection::~UcxConnection() {
  if (!failed_ && ep_ && peer_error_ == UCS_OK) {
    // Flush, then close: a send that completed locally may still be on its way, and a forced
    // close would drop it before the peer has it.
    ucp_request_param_t param{};
    void* request = ucp_ep_close_nbx(ep_, &param);
    ep_ = nullptr;
    if (UCS_PTR_IS_PTR(request)) {
      const auto until = Deadline::After(5);
      while (ucp_request_check_status(request) == UCS_INPROGRESS && !until.expired()) {
        if (!owner_.ProgressOnce()) owner_.Sleep(Deadline::After(0.01).when());
      }
      ucp_request_free(request);
    }
  }
  Fail(std::make_exception_ptr(Error(
      ErrorCode::kAborted, fmt::format("rank {}: connection to rank {} was closed locally",
                                       self_rank_, peer_rank_))));
  // Requests cancelled above complete on the next progress; bound the wait (a send whose peer
  // is wedged may never complete: its request is then released to UCX, which drops it).
  const auto until = Deadline::After(2);
  while (!idle() && !until.expired()) owner_.ProgressOnce();
  for (OpQueue* q : {&send_, &recv_}) {
    while (q->head) {
      Op* op = q->Pop();
      for (void*& h : op->handles_) {
        if (h) ucp_request_free(h);
        h = nullptr;
      }
      op->error = failed_;
      op->done = true;
    }
  }
  if (close_request_) ucp_request_free(close_request_);
  owner_.Unregister(this);
}

void UcxConnection::Open(const ucp_address_t* address) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = address;
  params.err_mode = SharedMemoryOnly(std::getenv("UCX_TLS")) ? UCP_ERR_HANDLING_MODE_NONE
                                                               : UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &UcxConnection::OnEndpointError;
  params.err_handler.arg = this;
  ucs_status_t status = ucp_ep_create(owner_.worker(), &params, &ep_);
  if (params.err_mode == UCP_ERR_HANDLING_MODE_NONE && status == UCS_OK) {
    owner_.NoteNoPeerFailureDetection(peer_rank_);
  }
  if (status != UCS_OK && params.err_mode == UCP_ERR_HANDLING_MODE_PEER) {
    // UCX 1.13's shared-memory transports have no peer failure handling: without it they are
    // usable, and a dead peer is caught by the deadline instead.
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    status = ucp_ep_create(owner_.worker(), &params, &ep_);
    if (status == UCS_OK) owner_.NoteNoPeerFailureDetection(peer_rank_);
  }
  if (status != UCS_OK) {
    ep_ = nullptr;
    Throw(ErrorCode::kUnavailable,
          "rank {}: cannot create a UCX endpoint to rank {} (stream {}): {}; check that UCX_TLS "
          "names a transport both hosts have (ucx_info -d)",
          self_rank_, peer_rank_, stream_, StatusText(status));
  }
}

std::exception_ptr UcxConnection::PeerError() const {
  return std::make_exception_ptr(Error(
      ErrorCode::kUnavailable,
      fmt::format("rank {}: the UCX connection to rank {} (stream {}) failed: {}: rank {} is "
                  "gone or unreachable",
                  self_rank_, peer_rank_, stream_, StatusText(peer_error_), peer_rank_)));
}

void UcxConnection::OnEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* self = static_cast<UcxConnection*>(arg);
  if (self->peer_error_ == UCS_OK) self->peer_error_ = status;
}

std::exception_ptr UcxConnection::OpError(const char* direction, const Op& op,
                                          ucs_status_t status) const {
  return std::make_exception_ptr(Error(
      ErrorCode::kUnavailable,
      fmt::format("rank {}: {} rank {} failed after {} of {} bytes: {}", self_rank_, direction,
                  peer_rank_, op.bytes_done, op.total_bytes(), StatusText(status))));
}

void UcxConnection::Fail(std::exception_ptr error) {
  if (!failed_) failed_ = std::move(error);
  // Receives are matched on the worker, not the endpoint: cancel them ourselves. Sends fail
  // when their endpoint closes.
  for (Op* op = recv_.head; op; op = op->next_) {
    for (void* h : op->handles_) {
      if (h) ucp_request_cancel(owner_.worker(), h);
    }
  }
  if (ep_) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* request = ucp_ep_close_nbx(ep_, &param);
    ep_ = nullptr;
    if (UCS_PTR_IS_PTR(request)) close_request_ = request;
  }
}

void* UcxConnection::StartFlush() {
  if (failed_ || !ep_ || peer_error_ != UCS_OK) return nullptr;
  ucp_request_param_t param{};
  void* request = ucp_ep_flush_nbx(ep_, &param);
  return UCS_PTR_IS_PTR(request) ? request : nullptr;
}

void UcxConnection::PostSend(Op& op) { Post<true>(op); }
void UcxConnection::PostRecv(Op& op) { Post<false>(op); }

template <bool kSend>
void UcxConnection::Post(Op& op) {
  op.done = false;
  op.bytes_done = 0;
  op.error = nullptr;
  op.handles_.fill(nullptr);
  OpQueue& queue = kSend ? send_ : recv_;
  queue.Push(&op);
  if (failed_) return Advance();
  if (kSend && peer_error_ != UCS_OK) {
    op.error = PeerError();
    return Advance();
  }
  for (int i = 0; i < op.num_parts; ++i) {
    const Op::Part& part = op.parts[i];
    if (part.bytes == 0) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_contig(1);
    if (ucp_mem_h memh = owner_.FindMemh(part.data, part.bytes)) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh;
    }
    ucs_status_ptr_t request;
    if constexpr (kSend) {
      request = ucp_tag_send_nbx(ep_, part.data, part.bytes,
                                 MakeTag(TagKind::kData, self_rank_, stream_, send_seq_++), &param);
    } else {
      // Always a request (no immediate completion), so the length is read from it.
      param.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      request = ucp_tag_recv_nbx(owner_.worker(), part.data, part.bytes,
                                 MakeTag(TagKind::kData, peer_rank_, stream_, recv_seq_++),
                                 kFullMask, &param);
    }
    if (UCS_PTR_IS_ERR(request)) {
      Fail(OpError(kSend ? "send to" : "receive from", op, UCS_PTR_STATUS(request)));
      return Advance();
    }
    if (request == nullptr) {  // a send completed in place
      op.bytes_done += part.bytes;
    } else {
      op.handles_[i] = request;
    }
  }
  Advance();
}

template <bool kSend>
void UcxConnection::AdvanceQueue(OpQueue& queue) {
  while (Op* op = queue.head) {
    for (int i = 0; i < op->num_parts; ++i) {
      void* request = op->handles_[i];
      if (!request) continue;
      ucp_tag_recv_info_t info{};
      const ucs_status_t status =
          kSend ? ucp_request_check_status(request) : ucp_tag_recv_request_test(request, &info);
      if (status == UCS_INPROGRESS) return;
      ucp_request_free(request);
      op->handles_[i] = nullptr;
      if (status == UCS_ERR_MESSAGE_TRUNCATED && !op->error) {
        op->error = std::make_exception_ptr(Error(
            ErrorCode::kDataLoss,
            fmt::format("rank {}: rank {} sent a message larger than the {} bytes this rank "
                        "expected (part {} of a receive): the two sides' ops do not mirror each "
                        "other",
                        self_rank_, peer_rank_, op->parts[i].bytes, i)));
        Fail(op->error);  // the message sequence is out of step: nothing later can match
      }
      if (status != UCS_OK) {
        if (!op->error) {
          op->error = failed_ && (status == UCS_ERR_CANCELED || peer_error_ != UCS_OK)
                          ? failed_
                          : OpError(kSend ? "send to" : "receive from", *op, status);
        }
        continue;
      }
      const size_t want = op->parts[i].bytes;
      if (!kSend && info.length != want && !op->error) {
        op->error = std::make_exception_ptr(Error(
            ErrorCode::kDataLoss,
            fmt::format("rank {}: rank {} sent a message of {} bytes where this rank expected {} "
                        "(part {} of a receive): the two sides' ops do not mirror each other",
                        self_rank_, peer_rank_, info.length, want, i)));
        Fail(op->error);
      }
      op->bytes_done += want;
    }
    queue.Pop();
    if (!op->error && failed_ && (op->bytes_done < op->total_bytes() || op->total_bytes() == 0)) {
      op->error = failed_;
    }
    op->done = true;
  }
}

void UcxConnection::Advance() {
  if (peer_error_ != UCS_OK && !failed_) {
    // The endpoint failed: sends cannot complete any more. Messages the peer sent before it
    // went may still be on their way in (on another lane, or behind the error in this progress
    // round), so receives keep going for a grace period before they are failed.
    if (peer_error_at_ == Deadline::Clock::time_point{}) {
      peer_error_at_ = Deadline::Clock::now();
      for (Op* op = send_.head; op; op = op->next_) {
        for (void* h : op->handles_) {
          if (h) ucp_request_cancel(owner_.worker(), h);
        }
      }
    }
  }
  // The grace holds even while no receive is posted: the caller may be about to post one for a
  // message already here (the ring reads an abort notice's text right after its header, and the
  // neighbour that sent it closes at once).
  if (peer_error_ != UCS_OK && !failed_ &&
      Deadline::Clock::now() - peer_error_at_ > kPeerErrorGrace) {
    Fail(PeerError());
  }
  AdvanceQueue<true>(send_);
  AdvanceQueue<false>(recv_);
  if (failed_) {
    // Ops never started (posted after the failure) have no requests: the loops above finish them.
    if (close_request_ && ucp_request_check_status(close_request_) != UCS_INPROGRESS) {
      ucp_request_free(close_request_);
      close_request_ = nullptr;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// UcxTransport

// UCX's defaults find a dead peer late or never over verbs: keepalive every 20 s, RC retries of
// 1 s x 7 (and soft-RoCE takes a retry count of 7 as "forever"), UD peers declared lost after
// 30 s. These bring it to ~8 s, like the ibverbs transport's probes and retries: keepalive every
// 0.5 s, RC tries of UCX's 1 s but 6 retries, UD peers lost after 5 s. Shorter (0.25 s tries,
// 2 s for UD) named a dead peer in ~3 s but can take a loaded, live one for dead, as the ibverbs
// transport's 268 ms tries did once on soft-RoCE under an emulated CPU. Only where the user set
// nothing: UCX's own variables (e.g. UCX_RC_VERBS_TIMEOUT) override these inherited ones.
void SetFailureDetectionDefaults() {
  static std::once_flag once;
  std::call_once(once, [] {
    setenv("UCX_KEEPALIVE_INTERVAL", "0.5s", 0);
    setenv("UCX_RC_TIMEOUT", "1s", 0);
    setenv("UCX_RC_RETRY_COUNT", "6", 0);
    setenv("UCX_UD_TIMEOUT", "5s", 0);
  });
}

UcxTransport::UcxTransport(const UcxOptions& options) : options_(options) {
  SetFailureDetectionDefaults();
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) {
    Throw(ErrorCode::kInvalidArgument, "rank {}: UCX cannot read its configuration (UCX_* "
                                       "environment variables): {}",
          options.rank, StatusText(status));
  }
  if (!options.net_devices.empty()) {
    status = ucp_config_modify(config, "NET_DEVICES", options.net_devices.c_str());
    if (status != UCS_OK) {
      ucp_config_release(config);
      Throw(ErrorCode::kInvalidArgument, "rank {}: UCX rejects NET_DEVICES='{}': {}", options.rank,
            options.net_devices, StatusText(status));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.estimated_num_eps = 4;
  status = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (status != UCS_OK) {
    context_ = nullptr;
    Throw(ErrorCode::kUnavailable,
          "rank {}: UCX cannot start: {} (check UCX_TLS and UCX_NET_DEVICES against ucx_info -d)",
          options.rank, StatusText(status));
  }
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_, &attr) == UCS_OK) {
    cuda_memory_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  status = ucp_worker_create(context_, &wparams, &worker_);
  if (status != UCS_OK) {
    worker_ = nullptr;
    ucp_cleanup(context_);
    Throw(ErrorCode::kUnavailable, "rank {}: cannot create a UCX worker: {}", options.rank,
          StatusText(status));
  }
  if (ucp_worker_get_efd(worker_, &event_fd_) != UCS_OK) event_fd_ = -1;

  ucp_address_t* address = nullptr;
  size_t length = 0;
  status = ucp_worker_get_address(worker_, &address, &length);
  if (status != UCS_OK) {
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    Throw(ErrorCode::kUnavailable, "rank {}: cannot get the UCX worker address: {}", options.rank,
          StatusText(status));
  }
  wire::UcxAddress published;
  published.set_worker_address(address, length);
  published.set_rank(options.rank);
  address_ = published.SerializeAsString();
  ucp_worker_release_address(worker_, address);
  PSGD_LOG_DEBUG("rank {}: ucx transport up (UCX {}, worker address {} bytes)", options.rank,
                 UcxVersion(), length);
}

UcxTransport::~UcxTransport() {
  PSGD_CHECK(live_.empty());     // connections must be destroyed before their transport
  PSGD_CHECK(regions_.empty());  // and memory regions too
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
}

std::string UcxTransport::Describe() const {
  return fmt::format("ucx {} ({}{})", UcxVersion(), lanes_.empty() ? "not connected" : lanes_,
                     peer_failure_detection_ ? "" : "; no peer failure detection");
}

std::unique_ptr<MemoryRegion> UcxTransport::RegisterMemory(void* data, size_t bytes,
                                                           MemoryKind kind) {
  if (kind == MemoryKind::kCuda && !cuda_memory_) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: this UCX ({}) has no CUDA memory support (no cuda_copy/cuda_ipc transport: "
          "ucx_info -d lists them), so it cannot register {} bytes of CUDA memory",
          options_.rank, UcxVersion(), bytes);
  }
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = data;
  params.length = bytes;
  params.memory_type = kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  ucp_mem_h memh = nullptr;
  const ucs_status_t status = ucp_mem_map(context_, &params, &memh);
  if (status != UCS_OK) {
    Throw(ErrorCode::kIo, "rank {}: UCX cannot register {} bytes of {} memory at {}: {}",
          options_.rank, bytes, MemoryKindName(kind), data, StatusText(status));
  }
  return std::make_unique<UcxRegion>(*this, data, bytes, kind, memh);
}

bool UcxTransport::ProgressOnce() {
  const unsigned events = ucp_worker_progress(worker_);
  for (UcxConnection* c : live_) c->Advance();
  return events > 0;
}

void UcxTransport::Sleep(Deadline::Clock::time_point until) {
  const auto now = Deadline::Clock::now();
  if (until <= now) return;
  if (event_fd_ < 0) {
    std::this_thread::yield();
    return;
  }
  // Arm, then sleep unless something arrived in between (UCS_ERR_BUSY). At most 1 ms: with
  // UCX 1.13 over tcp some protocol steps (rendezvous) do not always wake the event fd, and a
  // 50 ms sleep then costs a 1 MiB AllReduce several times its transfer (measured on the lab,
  // docs/transports.md). Wait only runs while an op is in flight, so idle ranks do not spin.
  if (ucp_worker_arm(worker_) != UCS_OK) return;
  pollfd fd{event_fd_, POLLIN, 0};
  poll(&fd, 1, until - now < std::chrono::milliseconds(1) ? 0 : 1);
}

void UcxTransport::Poll() { ProgressOnce(); }

void UcxTransport::Close() {
  // Flush first, bounded: a send that completed locally (the ring's abort notice, sent just
  // before the ring closes) may still be on its way, and the forced close below would drop it.
  std::vector<void*> flushes;
  for (UcxConnection* c : live_) {
    if (void* request = c->StartFlush()) flushes.push_back(request);
  }
  const auto until = Deadline::After(1);
  for (void* request : flushes) {
    while (ucp_request_check_status(request) == UCS_INPROGRESS && !until.expired()) {
      if (!ProgressOnce()) Sleep(std::min(until.when(), Deadline::After(0.001).when()));
    }
    ucp_request_free(request);
  }
  auto error = std::make_exception_ptr(Error(
      ErrorCode::kAborted, fmt::format("rank {}: transport closed", options_.rank)));
  for (UcxConnection* c : std::vector<UcxConnection*>(live_.begin(), live_.end())) c->Fail(error);
  ucp_worker_progress(worker_);
  for (UcxConnection* c : live_) c->Advance();
}

std::vector<std::unique_ptr<Connection>> UcxTransport::Connect(
    const std::vector<std::pair<int, std::string>>& peers, Deadline deadline, int streams) {
  PSGD_CHECK_GE(streams, 1);
  if (streams > kMaxStreams) {
    Throw(ErrorCode::kInvalidArgument, "rank {}: {} streams per peer: UCX allows at most {}",
          options_.rank, streams, kMaxStreams);
  }
  if (options_.world_size > (1 << kRankBits)) {
    Throw(ErrorCode::kInvalidArgument, "world size {}: the UCX transport allows at most {} ranks",
          options_.world_size, 1 << kRankBits);
  }
  std::vector<std::unique_ptr<UcxConnection>> connections;
  for (const auto& [peer, address] : peers) {
    PSGD_CHECK_NE(peer, options_.rank);
    wire::UcxAddress parsed;
    if (!parsed.ParseFromString(address) || parsed.worker_address().empty() ||
        parsed.rank() != peer) {
      Throw(ErrorCode::kDataLoss,
            "rank {}: the address rank {} published is not a UCX worker address of rank {} (is "
            "every rank using comm.transport = UCX?)",
            options_.rank, peer, peer);
    }
    for (int stream = 0; stream < streams; ++stream) {
      auto c = std::make_unique<UcxConnection>(*this, options_.rank, peer, stream);
      c->Open(reinterpret_cast<const ucp_address_t*>(parsed.worker_address().data()));
      connections.push_back(std::move(c));
    }
  }

  // Hello each way on every endpoint: wire-up completes, and both sides check they agree.
  wire::ConnectionHello hello;
  hello.set_protocol_version(kProtocolVersion);
  hello.set_rank(options_.rank);
  hello.set_world_size(options_.world_size);
  struct Handshake {
    std::string out;
    std::array<char, kHelloBytes> in{};
    Op send, recv;
  };
  std::vector<Handshake> shakes(connections.size());
  for (size_t i = 0; i < connections.size(); ++i) {
    UcxConnection& c = *connections[i];
    Handshake& h = shakes[i];
    hello.set_stream(c.stream());
    // [length: u8][ConnectionHello][zero padding]: a fixed size, so the receive mirrors it.
    const std::string body = hello.SerializeAsString();
    PSGD_CHECK_LT(body.size(), kHelloBytes);
    h.out = std::string(1, static_cast<char>(body.size())) + body;
    h.out.resize(kHelloBytes, '\0');
    auto post = [&](bool send) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      param.datatype = ucp_dt_make_contig(1);
      void* r = send ? ucp_tag_send_nbx(c.ep(), h.out.data(), kHelloBytes,
                                        MakeTag(TagKind::kHello, options_.rank, c.stream(), 0), &param)
                     : ucp_tag_recv_nbx(worker_, h.in.data(), kHelloBytes,
                                        MakeTag(TagKind::kHello, c.peer_rank(), c.stream(), 0),
                                        kFullMask, &param);
      if (UCS_PTR_IS_ERR(r)) {
        Throw(ErrorCode::kUnavailable, "rank {}: cannot {} rank {} over UCX: {}", options_.rank,
              send ? "send the connection hello to" : "post the connection hello receive from",
              c.peer_rank(), StatusText(UCS_PTR_STATUS(r)));
      }
      (send ? h.send : h.recv).handles_[0] = r;
    };
    post(true);
    post(false);
  }
  // Releases every handshake request still outstanding (on any exit).
  struct Cleanup {
    ucp_worker_h worker;
    std::vector<Handshake>* shakes;
    ~Cleanup() {
      for (auto& h : *shakes) {
        for (Op* op : {&h.send, &h.recv}) {
          if (void* r = op->handles_[0]) {
            if (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_request_cancel(worker, r);
            ucp_request_free(r);
          }
        }
      }
    }
  } cleanup{worker_, &shakes};

  auto finished = [&](Op& op) {
    void* r = op.handles_[0];
    if (!r) return true;
    const ucs_status_t status = ucp_request_check_status(r);
    if (status == UCS_INPROGRESS) return false;
    ucp_request_free(r);
    op.handles_[0] = nullptr;
    op.done = true;
    if (status != UCS_OK) op.error = std::make_exception_ptr(Error(ErrorCode::kUnavailable, StatusText(status)));
    return true;
  };
  int idle = 0;
  while (true) {
    bool all = true;
    for (size_t i = 0; i < shakes.size(); ++i) {
      UcxConnection& c = *connections[i];
      c.Advance();
      if (c.failed()) std::rethrow_exception(c.failed());
      for (Op* op : {&shakes[i].send, &shakes[i].recv}) {
        all = finished(*op) && all;
        if (op->error) {
          try {
            std::rethrow_exception(op->error);
          } catch (const Error& e) {
            Throw(ErrorCode::kUnavailable, "rank {}: connecting to rank {} over UCX (stream {}) "
                                           "failed: {}",
                  options_.rank, c.peer_rank(), c.stream(), e.what());
          }
        }
      }
    }
    if (all) break;
    if (deadline.expired()) {
      std::vector<std::string> missing;
      for (size_t i = 0; i < shakes.size(); ++i) {
        if (!shakes[i].recv.done || !shakes[i].send.done) {
          missing.push_back(fmt::format("rank {} stream {}", connections[i]->peer_rank(),
                                        connections[i]->stream()));
        }
      }
      Throw(ErrorCode::kDeadlineExceeded,
            "rank {}: connecting to peers over UCX timed out: no hello from {} (are all ranks "
            "running with the same UCX_TLS, and can they reach each other?)",
            options_.rank, fmt::join(missing, ", "));
    }
    if (ucp_worker_progress(worker_)) {
      idle = 0;
    } else if (++idle >= 64) {
      Sleep(std::min(deadline.when(), Deadline::Clock::now() + std::chrono::milliseconds(50)));
    }
  }
  for (size_t i = 0; i < shakes.size(); ++i) {
    wire::ConnectionHello got;
    const UcxConnection& c = *connections[i];
    std::string reason;
    const size_t length = static_cast<uint8_t>(shakes[i].in[0]);
    if (length >= kHelloBytes || !got.ParseFromArray(shakes[i].in.data() + 1, static_cast<int>(length))) {
      reason = "a connection hello that does not parse";
    } else if (got.protocol_version() != kProtocolVersion) {
      reason = fmt::format("protocol version {} (ours is {})", got.protocol_version(), kProtocolVersion);
    } else if (got.world_size() != options_.world_size) {
      reason = fmt::format("world size {} (ours is {})", got.world_size(), options_.world_size);
    } else if (got.rank() != c.peer_rank() || got.stream() != c.stream()) {
      reason = fmt::format("rank {} stream {} where rank {} stream {} was expected", got.rank(),
                           got.stream(), c.peer_rank(), c.stream());
    }
    if (!reason.empty()) {
      Throw(ErrorCode::kDataLoss, "rank {}: rank {} sent {} over UCX", options_.rank,
            c.peer_rank(), reason);
    }
  }
  if (!connections.empty() && lanes_.empty()) lanes_ = EndpointLanes(connections[0]->ep());
  std::vector<std::unique_ptr<Connection>> out;
  for (auto& c : connections) out.push_back(std::move(c));
  return out;
}

}  // namespace

std::unique_ptr<Transport> CreateUcxTransport(const UcxOptions& options) {
  return std::make_unique<UcxTransport>(options);
}

std::string UcxVersion() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return fmt::format("{}.{}.{}", major, minor, release);
}

std::vector<std::string> UcxTransportsAvailable() {
  std::vector<std::string> out;
  uct_component_h* components = nullptr;
  unsigned num_components = 0;
  if (uct_query_components(&components, &num_components) != UCS_OK) return out;
  for (unsigned c = 0; c < num_components; ++c) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
    if (uct_component_query(components[c], &attr) != UCS_OK) continue;
    std::vector<uct_md_resource_desc_t> mds(attr.md_resource_count);
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
    attr.md_resources = mds.data();
    if (uct_component_query(components[c], &attr) != UCS_OK) continue;
    for (const auto& md_desc : mds) {
      uct_md_config_t* md_config = nullptr;
      if (uct_md_config_read(components[c], nullptr, nullptr, &md_config) != UCS_OK) continue;
      uct_md_h md = nullptr;
      const ucs_status_t status = uct_md_open(components[c], md_desc.md_name, md_config, &md);
      uct_config_release(md_config);
      if (status != UCS_OK) continue;
      uct_tl_resource_desc_t* resources = nullptr;
      unsigned num_resources = 0;
      if (uct_md_query_tl_resources(md, &resources, &num_resources) == UCS_OK) {
        for (unsigned r = 0; r < num_resources; ++r) {
          out.push_back(fmt::format("{}/{}", resources[r].tl_name, resources[r].dev_name));
        }
        uct_release_tl_resource_list(resources);
      }
      uct_md_close(md);
    }
  }
  uct_release_component_list(components);
  return out;
}

}  // namespace pipesgd::transport::ucx
