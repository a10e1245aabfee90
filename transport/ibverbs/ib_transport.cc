// Tested on soft-RoCE only (see ib_transport.h). Written against rdma-core 44's libibverbs.
// Over 600 lines because the connection (queue pair states, hello, credits, CTS/write protocol,
// liveness probes) and the transport (device, CQ dispatch, regions) share private state; the
// pure parts (addresses, device/port/GID choice, the memlock check) are in ib_common.cc.
#include "transport/ibverbs/ib_transport.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <poll.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "transport/ibverbs/gpudirect.h"
#include "transport/op_queue.h"

namespace pipesgd::transport::ibverbs {
namespace {

constexpr uint32_t kCredits = 32;          // outstanding CTS per connection
constexpr size_t kStageBytes = 8192;       // staging slot: parts up to this size are copied
constexpr size_t kCtrlBytes = 32;          // one control message
constexpr uint32_t kRecvDepth = 2 * kCredits + 8;  // peer's CTS + our credits' writes + hello
constexpr uint32_t kCtrlSendSlots = kCredits + 8;
constexpr uint32_t kSendDepth = kCtrlSendSlots + kCredits + 8;
constexpr uint32_t kCtrlMagic = 0x58475350;  // "PSGX"
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
// The ACK timeout and retry count (IbOptions: comm.ib_timeout, comm.ib_retry_count) decide when
// a queue pair whose peer is gone sees IBV_WC_RETRY_EXC_ERR: (retries + 1) x 4.096 us x
// 2^timeout after its last unacknowledged packet, ~7.5 s at 18 and 6.
// A peer that dies sends nothing, and a receiver with nothing to send never learns of it: after
// this long without a completion on a connection with pending ops, a zero-length RDMA write
// (acknowledged by the peer's NIC, whatever its process is doing) asks whether its queue pair
// still exists. Detection: this plus the retries above.
constexpr auto kProbeAfter = std::chrono::milliseconds(500);

enum class CtrlType : uint8_t { kHello = 1, kCts = 2 };

// A control message, sent with IBV_WR_SEND into the peer's posted receive slots. 32 bytes,
// little-endian (docs/wire_protocol.md).
struct Ctrl {
  uint32_t magic = kCtrlMagic;
  uint8_t type = 0;
  uint8_t version = 1;
  uint16_t stream = 0;  // hello: the sender's stream
  uint32_t seq = 0;     // CTS: sequence number
  uint32_t rkey = 0;    // CTS: target rkey
  uint64_t addr = 0;    // CTS: target address
  uint32_t length = 0;  // CTS: target bytes; hello: world size
  int32_t rank = 0;     // hello: the sender's rank
};
static_assert(sizeof(Ctrl) == kCtrlBytes);

// wr_id: [connection index:24][kind:8][slot or sequence:32].
enum class WrKind : uint64_t { kRecv = 1, kCtrlSend = 2, kWrite = 3, kProbe = 4 };
uint64_t WrId(size_t conn, WrKind kind, uint32_t n) {
  return (static_cast<uint64_t>(conn) << 40) | (static_cast<uint64_t>(kind) << 32) | n;
}

// RAII for verbs objects.
template <auto Destroy>
struct VerbsDeleter {
  template <typename T>
  void operator()(T* p) const {
    if (p) Destroy(p);
  }
};
using ContextPtr = std::unique_ptr<ibv_context, VerbsDeleter<ibv_close_device>>;
using PdPtr = std::unique_ptr<ibv_pd, VerbsDeleter<ibv_dealloc_pd>>;
using ChannelPtr = std::unique_ptr<ibv_comp_channel, VerbsDeleter<ibv_destroy_comp_channel>>;
using CqPtr = std::unique_ptr<ibv_cq, VerbsDeleter<ibv_destroy_cq>>;
using QpPtr = std::unique_ptr<ibv_qp, VerbsDeleter<ibv_destroy_qp>>;
using MrPtr = std::unique_ptr<ibv_mr, VerbsDeleter<ibv_dereg_mr>>;
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

[[noreturn]] void ThrowVerbs(int rank, const char* call, int err) {
  Throw(ErrorCode::kInternal, "rank {}: {} failed: {} (errno {})", rank, call, std::strerror(err), err);
}

const char* PortStateName(ibv_port_state state) {
  return ibv_port_state_str(state);
}

int MtuBytes(uint8_t mtu) { return 128 << mtu; }

// Op::seq_ holds a bit per finished part; an op is finished when every part's bit is set.
bool Finished(const Op& op) { return op.seq_ == (uint64_t{1} << op.num_parts) - 1; }

class IbTransport;

class IbRegion final : public MemoryRegion {
 public:
  IbRegion(IbTransport& owner, void* data, size_t bytes, MemoryKind kind, MrPtr mr);
  ~IbRegion() override;
  const ibv_mr* mr() const { return mr_.get(); }

 private:
  IbTransport& owner_;
  MrPtr mr_;
};

class IbConnection final : public Connection {
 public:
  IbConnection(IbTransport& owner, size_t index, int self_rank, int peer_rank, int stream);
  ~IbConnection() override;

  int peer_rank() const override { return peer_rank_; }
  int stream() const { return stream_; }
  uint32_t qpn() const { return qp_->qp_num; }
  uint32_t psn() const { return psn_; }
  void PostSend(Op& op) override;
  void PostRecv(Op& op) override;

  // INIT -> RTR -> RTS toward the peer's queue pair, then post every receive slot and the hello.
  void Establish(const IbAddress& remote, const QpInfo& qp, int world_size);
  bool hello_done() const { return hello_received_ && hello_sent_; }
  // While connecting: if the hello ran out of retries because the peer's queue pair was not yet
  // listening (RTR), and every flushed request has come back, takes the queue pair through RESET
  // to RTS again and resends it.
  void RetryHelloIfDue();
  // Sends a liveness probe if ops wait on this connection and nothing completed for kProbeAfter.
  void ProbeIfIdle(Deadline::Clock::time_point now);
  // The peer's hello (valid once hello_done()).
  const Ctrl& peer_hello() const { return peer_hello_; }
  size_t index() const { return index_; }
  const std::exception_ptr& failed() const { return failed_; }
  void OnCompletion(const ibv_wc& wc);
  void Fail(std::exception_ptr error);
  bool quiet() const { return posted_ == 0; }

 private:
  // Advertises receive parts while credits last, writes send parts while CTS are queued, and
  // completes finished ops in order.
  void Pump();
  void PostCtrl(const Ctrl& ctrl);
  void PostRecvSlot(uint32_t slot);
  void ToInit();
  void ToRts();
  void Complete(OpQueue& queue);
  void FailWith(ErrorCode code, const std::string& what);
  // Why a retry-exceeded completion most likely happened, with the knobs that set its time.
  std::string RetryExceededWhy() const;
  uint8_t* CtrlRecvSlot(uint32_t i) { return arena_.get() + i * kCtrlBytes; }
  uint8_t* CtrlSendSlot(uint32_t i) { return CtrlRecvSlot(kRecvDepth) + i * kCtrlBytes; }
  uint8_t* StageRecv(uint32_t i) { return CtrlSendSlot(kCtrlSendSlots) + i * kStageBytes; }
  uint8_t* StageSend(uint32_t i) { return StageRecv(kCredits) + i * kStageBytes; }
  static size_t ArenaBytes() {
    return (kRecvDepth + kCtrlSendSlots) * kCtrlBytes + 2 * kCredits * kStageBytes;
  }

  IbTransport& owner_;
  size_t index_;
  int self_rank_;
  int peer_rank_;
  int stream_;
  QpPtr qp_;
  uint32_t psn_;
  std::unique_ptr<uint8_t[], FreeDeleter> arena_;
  MrPtr arena_mr_;
  uint32_t ctrl_send_next_ = 0;
  uint32_t ctrl_in_flight_ = 0;  // control sends posted, not yet completed (<= kCtrlSendSlots)
  int64_t posted_ = 0;  // work requests not yet completed (sends and receives)
  bool established_ = false;
  IbAddress remote_;  // for ToRts (again, after a hello retry)
  QpInfo remote_qp_;
  int world_size_ = 0;
  bool hello_retry_ = false;  // the hello's retries ran out before the peer listened
  int hello_attempts_ = 0;
  bool probe_outstanding_ = false;
  Deadline::Clock::time_point last_progress_ = Deadline::Clock::now();
  bool hello_sent_ = false;
  bool hello_received_ = false;
  Ctrl peer_hello_;

  // Receive side.
  struct Target {
    Op* op = nullptr;
    int part = 0;
    bool staged = false;
    MrPtr temp;  // a registration for this part only
  };
  CreditWindow credits_{kCredits};
  std::array<Target, kCredits> targets_;  // by CTS sequence mod kCredits
  OpQueue recv_;
  Op* adv_op_ = nullptr;  // next receive part to advertise
  int adv_part_ = 0;

  // Send side.
  struct Outgoing {
    Op* op = nullptr;
    int part = 0;
    MrPtr temp;
  };
  CtsSequence cts_seq_;
  std::array<Ctrl, kCredits> cts_;  // CTS received, not yet answered (ring)
  uint32_t cts_head_ = 0, cts_count_ = 0;
  // Writes posted and not yet completed, in posting order (the order an RC send queue completes
  // them), each with its send staging slot. Not keyed by CTS sequence: the peer frees a credit
  // when the data lands, which can be before this side polls the write's completion, so CTS
  // s + kCredits may arrive while write s is still in flight.
  CreditWindow writes_{kCredits};
  std::array<Outgoing, kCredits> outgoing_;  // by writes_ sequence mod kCredits
  OpQueue send_;
  Op* send_op_ = nullptr;  // next send part to write
  int send_part_ = 0;

  std::exception_ptr failed_;
};

class IbTransport final : public Transport {
 public:
  explicit IbTransport(const IbOptions& options);
  ~IbTransport() override;

  std::string name() const override { return "ibverbs"; }
  int rank() const override { return options_.rank; }
  // CUDA memory only where GPUDirect RDMA can work at run time: a CUDA build on a host without
  // a GPU (CI, most build machines) must say no, not fail later in RegisterMemory.
  Capabilities capabilities() const override {
    return {.byte_stream = false, .cuda_memory = cuda_memory_};
  }
  std::string Describe() const override { return describe_; }
  std::string LocalAddress() const override { return address_; }
  std::unique_ptr<MemoryRegion> RegisterMemory(void* data, size_t bytes, MemoryKind kind) override;
  std::vector<std::unique_ptr<Connection>> Connect(
      const std::vector<std::pair<int, std::string>>& peers, Deadline deadline,
      int streams) override;
  void Poll() override { PollCq(); }
  void Close() override;

 protected:
  bool ProgressOnce() override { return PollCq() > 0; }
  // Idle connections with pending ops probe their peer first (kProbeAfter).
  void Idle(Deadline::Clock::time_point until) override;
  int SpinsBeforeIdle() const override { return 256; }

 public:

  ibv_pd* pd() const { return pd_.get(); }
  ibv_cq* cq() const { return cq_.get(); }
  uint8_t port() const { return port_; }
  uint8_t mtu() const { return mtu_; }
  bool ethernet() const { return ethernet_; }
  int gid_index() const { return gid_index_; }
  const IbOptions& options() const { return options_; }
  void Attach(size_t index, IbConnection* c) { live_[index] = c; }
  void Detach(size_t index) { live_.erase(index); }
  void AddRegion(IbRegion* r) { regions_.push_back(r); }
  void RemoveRegion(IbRegion* r) { regions_.erase(std::find(regions_.begin(), regions_.end(), r)); }
  const ibv_mr* FindMr(const void* p, size_t n) const {
    for (auto it = regions_.rbegin(); it != regions_.rend(); ++it) {
      if ((*it)->Contains(p, n)) return (*it)->mr();
    }
    return nullptr;
  }
  // Registers host memory, checking RLIMIT_MEMLOCK first and naming it on failure.
  MrPtr RegisterHost(void* data, size_t bytes, const char* what);
  void Unpinned(size_t bytes) { pinned_ -= bytes; }
  // Polls the CQ once; returns the number of completions handled.
  int PollCq();
  void Sleep(Deadline::Clock::time_point until);

 private:
  IbOptions options_;
  ContextPtr context_;
  PdPtr pd_;
  ChannelPtr channel_;
  CqPtr cq_;
  uint8_t port_ = 1;
  uint8_t mtu_ = IBV_MTU_1024;
  bool ethernet_ = false;
  int gid_index_ = 0;
  uint64_t pinned_ = 0;
  bool ipc_lock_ = false;
  MemlockLimit memlock_;
  bool cuda_memory_ = false;
  std::string no_cuda_why_;  // why not, when !cuda_memory_
  std::string address_;
  std::string describe_;
  std::map<std::pair<int, int>, std::unique_ptr<IbConnection>> unconnected_;  // (peer, stream)
  std::map<size_t, IbConnection*> live_;
  std::vector<IbRegion*> regions_;
};

// ---------------------------------------------------------------------------------------------
// IbRegion

IbRegion::IbRegion(IbTransport& owner, void* data, size_t bytes, MemoryKind kind, MrPtr mr)
    : MemoryRegion(data, bytes, kind), owner_(owner), mr_(std::move(mr)) {
  owner_.AddRegion(this);
}

IbRegion::~IbRegion() {
  owner_.RemoveRegion(this);
  if (kind() == MemoryKind::kHost) owner_.Unpinned(bytes());
}

// ---------------------------------------------------------------------------------------------
// IbConnection

IbConnection::IbConnection(IbTransport& owner, size_t index, int self_rank, int peer_rank,
                           int stream)
    : owner_(owner), index_(index), self_rank_(self_rank), peer_rank_(peer_rank), stream_(stream) {
  ibv_qp_init_attr init{};
  init.send_cq = owner.cq();
  init.recv_cq = owner.cq();
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = kSendDepth;
  init.cap.max_recv_wr = kRecvDepth;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.sq_sig_all = 1;
  qp_.reset(ibv_create_qp(owner.pd(), &init));
  if (!qp_) ThrowVerbs(self_rank, "ibv_create_qp", errno);
  ToInit();
  psn_ = std::random_device{}() & 0xffffff;

  void* arena = std::aligned_alloc(4096, (ArenaBytes() + 4095) / 4096 * 4096);
  if (!arena) Throw(ErrorCode::kInternal, "rank {}: out of memory for RDMA staging", self_rank);
  arena_.reset(static_cast<uint8_t*>(arena));
  arena_mr_ = owner.RegisterHost(arena_.get(), ArenaBytes(), "the ibverbs staging area");
}

IbConnection::~IbConnection() {
  if (!failed_) {
    Fail(std::make_exception_ptr(Error(
        ErrorCode::kAborted, fmt::format("rank {}: connection to rank {} was closed locally",
                                         self_rank_, peer_rank_))));
  }
  // The QP is in the error state: every outstanding work request flushes with an error. Let
  // them drain before the buffers they reference go away.
  const auto until = Deadline::After(2);
  while (!quiet() && !until.expired()) owner_.PollCq();
  owner_.Detach(index_);
  qp_.reset();
  if (arena_mr_) owner_.Unpinned(ArenaBytes());
}

void IbConnection::ToInit() {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = owner_.port();
  attr.qp_access_flags = kAccess;
  if (int err = ibv_modify_qp(qp_.get(), &attr,
                              IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
    ThrowVerbs(self_rank_, "ibv_modify_qp(INIT)", err);
  }
}

void IbConnection::Establish(const IbAddress& remote, const QpInfo& qp, int world_size) {
  remote_ = remote;
  remote_qp_ = qp;
  world_size_ = world_size;
  ToRts();
}

void IbConnection::RetryHelloIfDue() {
  if (!hello_retry_ || !quiet() || failed_) return;
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RESET;
  if (int err = ibv_modify_qp(qp_.get(), &attr, IBV_QP_STATE)) {
    ThrowVerbs(self_rank_, fmt::format("ibv_modify_qp(RESET) toward rank {}", peer_rank_).c_str(), err);
  }
  hello_retry_ = false;
  ctrl_send_next_ = 0;
  PSGD_LOG_DEBUG("rank {}: rank {} stream {} was not listening yet; hello attempt {}", self_rank_,
                 peer_rank_, stream_, hello_attempts_ + 1);
  ToInit();
  ToRts();
}

void IbConnection::ToRts() {
  const IbAddress& remote = remote_;
  const QpInfo& qp = remote_qp_;
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = static_cast<ibv_mtu>(std::min(owner_.mtu(), remote.mtu));
  attr.dest_qp_num = qp.qpn;
  attr.rq_psn = qp.psn;
  attr.max_dest_rd_atomic = 1;
  attr.min_rnr_timer = 12;
  attr.ah_attr.port_num = owner_.port();
  attr.ah_attr.sl = 0;
  if (owner_.ethernet() || remote.lid == 0) {
    attr.ah_attr.is_global = 1;
    std::memcpy(attr.ah_attr.grh.dgid.raw, remote.gid.data(), 16);
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(owner_.gid_index());
    attr.ah_attr.grh.hop_limit = 64;
  } else {
    attr.ah_attr.dlid = remote.lid;
  }
  if (int err = ibv_modify_qp(qp_.get(), &attr,
                              IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
    ThrowVerbs(self_rank_, fmt::format("ibv_modify_qp(RTR) toward rank {}", peer_rank_).c_str(), err);
  }
  for (uint32_t slot = 0; slot < kRecvDepth; ++slot) PostRecvSlot(slot);

  attr = {};
  attr.qp_state = IBV_QPS_RTS;
  // A peer later than the retries to reach RTR costs a hello retry (RetryHelloIfDue), not the
  // connection; a dead peer is reported (retries + 1) tries after the first packet it did not
  // acknowledge.
  attr.timeout = static_cast<uint8_t>(owner_.options().ack_timeout);
  attr.retry_cnt = static_cast<uint8_t>(owner_.options().retry_count);
  attr.rnr_retry = 7;  // receive slots are always posted; 7 = retry forever
  attr.sq_psn = psn_;
  attr.max_rd_atomic = 1;
  if (int err = ibv_modify_qp(qp_.get(), &attr,
                              IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)) {
    ThrowVerbs(self_rank_, fmt::format("ibv_modify_qp(RTS) toward rank {}", peer_rank_).c_str(), err);
  }
  established_ = true;
  Ctrl hello;
  hello.type = static_cast<uint8_t>(CtrlType::kHello);
  hello.stream = static_cast<uint16_t>(stream_);
  hello.rank = self_rank_;
  hello.length = static_cast<uint32_t>(world_size_);
  ++hello_attempts_;
  PostCtrl(hello);  // the first control send: its completion sets hello_sent_
}

std::string IbConnection::RetryExceededWhy() const {
  const IbOptions& o = owner_.options();
  const double try_s = 4.096e-6 * std::ldexp(1.0, o.ack_timeout);
  return fmt::format(
      ": rank {} is gone or unreachable (no acknowledgement in {} tries of {:.3g} s: "
      "comm.ib_timeout = {}, comm.ib_retry_count = {})",
      peer_rank_, o.retry_count + 1, try_s, o.ack_timeout, o.retry_count);
}

void IbConnection::ProbeIfIdle(Deadline::Clock::time_point now) {
  if (!established_ || failed_ || probe_outstanding_ || !hello_done() ||
      (!recv_.head && !send_.head) || now - last_progress_ < kProbeAfter) {
    return;
  }
  // Zero bytes need no valid remote address or key (IBTA C9-88) and consume no receive.
  ibv_send_wr wr{};
  wr.wr_id = WrId(index_, WrKind::kProbe, 0);
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.num_sge = 0;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (int err = ibv_post_send(qp_.get(), &wr, &bad)) {
    return FailWith(ErrorCode::kInternal, fmt::format("ibv_post_send(liveness probe) to rank {} failed: {}",
                                                      peer_rank_, std::strerror(err)));
  }
  ++posted_;
  probe_outstanding_ = true;
}

void IbConnection::PostRecvSlot(uint32_t slot) {
  ibv_sge sge{reinterpret_cast<uint64_t>(CtrlRecvSlot(slot)), kCtrlBytes, arena_mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = WrId(index_, WrKind::kRecv, slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (int err = ibv_post_recv(qp_.get(), &wr, &bad)) {
    return FailWith(ErrorCode::kInternal, fmt::format("ibv_post_recv failed: {}", std::strerror(err)));
  }
  ++posted_;
}

void IbConnection::PostCtrl(const Ctrl& ctrl) {
  const uint32_t slot = ctrl_send_next_++ % kCtrlSendSlots;
  std::memcpy(CtrlSendSlot(slot), &ctrl, kCtrlBytes);
  ibv_sge sge{reinterpret_cast<uint64_t>(CtrlSendSlot(slot)), kCtrlBytes, arena_mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = WrId(index_, WrKind::kCtrlSend, slot);
  wr.opcode = IBV_WR_SEND;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (int err = ibv_post_send(qp_.get(), &wr, &bad)) {
    return FailWith(ErrorCode::kInternal, fmt::format("ibv_post_send(SEND) to rank {} failed: {}",
                                                      peer_rank_, std::strerror(err)));
  }
  ++posted_;
  ++ctrl_in_flight_;
}

void IbConnection::FailWith(ErrorCode code, const std::string& what) {
  Fail(std::make_exception_ptr(
      Error(code, fmt::format("rank {}: connection to rank {} (ibverbs, stream {}): {}",
                              self_rank_, peer_rank_, stream_, what))));
}

void IbConnection::Fail(std::exception_ptr error) {
  if (failed_) return;
  failed_ = std::move(error);
  if (qp_) {
    // Outstanding work requests flush with IBV_WC_WR_FLUSH_ERR; incoming writes are dropped.
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(qp_.get(), &attr, IBV_QP_STATE);
  }
  for (auto& t : targets_) t = Target{};
  for (auto& o : outgoing_) o = Outgoing{};
  for (OpQueue* q : {&send_, &recv_}) {
    while (q->head) {
      Op* op = q->Pop();
      op->error = failed_;
      op->done = true;
    }
  }
  adv_op_ = send_op_ = nullptr;
}

void IbConnection::PostSend(Op& op) {
  op.done = false;
  op.bytes_done = 0;
  op.error = nullptr;
  op.seq_ = 0;
  if (failed_) {
    op.error = failed_;
    op.done = true;
    return;
  }
  send_.Push(&op);
  if (!send_op_) {
    send_op_ = &op;
    send_part_ = 0;
  }
  Pump();
}

void IbConnection::PostRecv(Op& op) {
  op.done = false;
  op.bytes_done = 0;
  op.error = nullptr;
  op.seq_ = 0;
  if (failed_) {
    op.error = failed_;
    op.done = true;
    return;
  }
  recv_.Push(&op);
  if (!adv_op_) {
    adv_op_ = &op;
    adv_part_ = 0;
  }
  Pump();
}

void IbConnection::Pump() {
  if (!established_) return;
  // Receive side: one CTS per non-empty part, while credits last.
  while (!failed_ && adv_op_) {
    if (adv_part_ == adv_op_->num_parts) {
      adv_op_ = adv_op_->next_;
      adv_part_ = 0;
      continue;
    }
    Op& op = *adv_op_;
    const int i = adv_part_;
    const Op::Part& part = op.parts[i];
    if (part.bytes == 0) {
      op.seq_ |= uint64_t{1} << i;
      ++adv_part_;
      continue;
    }
    // A control slot is rewritten only once its send completed (a retransmission reads it).
    if (!credits_.CanAdvertise() || ctrl_in_flight_ == kCtrlSendSlots) break;
    Target target;
    target.op = &op;
    target.part = i;
    Ctrl cts;
    cts.type = static_cast<uint8_t>(CtrlType::kCts);
    cts.length = static_cast<uint32_t>(part.bytes);
    if (part.bytes > UINT32_MAX) {
      return FailWith(ErrorCode::kInvalidArgument,
                      fmt::format("a receive part of {} bytes: RDMA writes carry at most 4 GiB - 1",
                                  part.bytes));
    }
    const uint32_t seq = credits_.Advertise();
    cts.seq = seq;
    if (const ibv_mr* mr = owner_.FindMr(part.data, part.bytes)) {
      cts.addr = reinterpret_cast<uint64_t>(part.data);
      cts.rkey = mr->rkey;
    } else if (part.bytes <= kStageBytes) {
      target.staged = true;
      cts.addr = reinterpret_cast<uint64_t>(StageRecv(seq % kCredits));
      cts.rkey = arena_mr_->rkey;
    } else {
      try {
        target.temp = owner_.RegisterHost(part.data, part.bytes, "a receive into unregistered memory");
      } catch (const Error& e) {
        return Fail(std::make_exception_ptr(e));
      }
      cts.addr = reinterpret_cast<uint64_t>(part.data);
      cts.rkey = target.temp->rkey;
    }
    targets_[seq % kCredits] = std::move(target);
    PostCtrl(cts);
    ++adv_part_;
  }
  // Send side: one RDMA write with immediate per non-empty part, answering the CTS in order.
  while (!failed_ && send_op_) {
    if (send_part_ == send_op_->num_parts) {
      send_op_ = send_op_->next_;
      send_part_ = 0;
      continue;
    }
    Op& op = *send_op_;
    const int i = send_part_;
    const Op::Part& part = op.parts[i];
    if (part.bytes == 0) {
      op.seq_ |= uint64_t{1} << i;
      ++send_part_;
      continue;
    }
    if (cts_count_ == 0 || !writes_.CanAdvertise()) break;
    const Ctrl cts = cts_[cts_head_];
    cts_head_ = (cts_head_ + 1) % kCredits;
    --cts_count_;
    if (cts.length != part.bytes) {
      return FailWith(ErrorCode::kDataLoss,
                      fmt::format("rank {} posted a receive of {} bytes where this rank sends {} "
                                  "(part {} of a send): the two sides' ops do not mirror each other",
                                  peer_rank_, cts.length, part.bytes, i));
    }
    const uint32_t write = writes_.Advertise();
    Outgoing out;
    out.op = &op;
    out.part = i;
    ibv_sge sge{};
    sge.length = static_cast<uint32_t>(part.bytes);
    if (const ibv_mr* mr = owner_.FindMr(part.data, part.bytes)) {
      sge.addr = reinterpret_cast<uint64_t>(part.data);
      sge.lkey = mr->lkey;
    } else if (part.bytes <= kStageBytes) {
      uint8_t* slot = StageSend(write % kCredits);
      std::memcpy(slot, part.data, part.bytes);
      sge.addr = reinterpret_cast<uint64_t>(slot);
      sge.lkey = arena_mr_->lkey;
    } else {
      try {
        out.temp = owner_.RegisterHost(part.data, part.bytes, "a send from unregistered memory");
      } catch (const Error& e) {
        return Fail(std::make_exception_ptr(e));
      }
      sge.addr = reinterpret_cast<uint64_t>(part.data);
      sge.lkey = out.temp->lkey;
    }
    ibv_send_wr wr{};
    wr.wr_id = WrId(index_, WrKind::kWrite, write);
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.imm_data = htonl(cts.seq);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = cts.addr;
    wr.wr.rdma.rkey = cts.rkey;
    outgoing_[write % kCredits] = std::move(out);
    ibv_send_wr* bad = nullptr;
    if (int err = ibv_post_send(qp_.get(), &wr, &bad)) {
      return FailWith(ErrorCode::kInternal,
                      fmt::format("ibv_post_send(RDMA_WRITE_WITH_IMM, {} bytes) failed: {}",
                                  part.bytes, std::strerror(err)));
    }
    ++posted_;
    ++send_part_;
  }
  Complete(send_);
  Complete(recv_);
}

void IbConnection::Complete(OpQueue& queue) {
  while (queue.head && Finished(*queue.head)) {
    Op* op = queue.Pop();
    op->done = true;
  }
}

void IbConnection::OnCompletion(const ibv_wc& wc) {
  --posted_;
  const auto kind = static_cast<WrKind>((wc.wr_id >> 32) & 0xff);
  const auto n = static_cast<uint32_t>(wc.wr_id & 0xffffffff);
  if (kind == WrKind::kCtrlSend) --ctrl_in_flight_;  // flushed or not, its slot is free
  if (wc.status != IBV_WC_SUCCESS) {
    // The hello (the only request before the peer's hello arrives) found no listener: retry it
    // once the flushes that follow are in (RetryHelloIfDue), not fail the connection.
    if (!failed_ && !hello_received_ && !hello_sent_ &&
        (hello_retry_ || (kind == WrKind::kCtrlSend && wc.status == IBV_WC_RETRY_EXC_ERR))) {
      hello_retry_ = true;
      return;
    }
    if (!failed_) {
      FailWith(ErrorCode::kUnavailable,
               fmt::format("{} failed: {} (vendor error {:#x}){}",
                           kind == WrKind::kRecv    ? "a receive"
                           : kind == WrKind::kWrite ? "an RDMA write"
                           : kind == WrKind::kProbe ? "a liveness probe"
                                                    : "a control send",
                           ibv_wc_status_str(wc.status), wc.vendor_err,
                           wc.status == IBV_WC_RETRY_EXC_ERR ? RetryExceededWhy() : ""));
    }
    return;
  }
  if (failed_) return;
  last_progress_ = Deadline::Clock::now();
  switch (kind) {
    case WrKind::kProbe:
      probe_outstanding_ = false;
      break;
    case WrKind::kRecv: {
      if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        const uint32_t seq = ntohl(wc.imm_data);
        if (std::string problem = credits_.Consume(seq); !problem.empty()) {
          return FailWith(ErrorCode::kDataLoss, problem);
        }
        Target& t = targets_[seq % kCredits];
        const Op::Part& part = t.op->parts[t.part];
        if (wc.byte_len != part.bytes) {
          return FailWith(ErrorCode::kDataLoss,
                          fmt::format("rank {} wrote {} bytes where this rank expected {}",
                                      peer_rank_, wc.byte_len, part.bytes));
        }
        if (t.staged) std::memcpy(part.data, StageRecv(seq % kCredits), part.bytes);
        t.op->bytes_done += part.bytes;
        t.op->seq_ |= uint64_t{1} << t.part;
        t = Target{};
      } else {
        Ctrl ctrl;
        std::memcpy(&ctrl, CtrlRecvSlot(n), kCtrlBytes);
        if (wc.byte_len != kCtrlBytes || ctrl.magic != kCtrlMagic || ctrl.version != 1) {
          return FailWith(ErrorCode::kDataLoss,
                          fmt::format("a control message of {} bytes with magic {:#010x} version "
                                      "{} (expected {} bytes, {:#010x}, 1)",
                                      wc.byte_len, ctrl.magic, ctrl.version, kCtrlBytes, kCtrlMagic));
        }
        if (ctrl.type == static_cast<uint8_t>(CtrlType::kHello)) {
          peer_hello_ = ctrl;
          hello_received_ = true;
        } else if (ctrl.type == static_cast<uint8_t>(CtrlType::kCts)) {
          if (std::string problem = cts_seq_.Accept(ctrl.seq); !problem.empty()) {
            return FailWith(ErrorCode::kDataLoss, problem);
          }
          if (cts_count_ == kCredits) {
            return FailWith(ErrorCode::kDataLoss,
                            fmt::format("more than {} clear-to-send outstanding", kCredits));
          }
          cts_[(cts_head_ + cts_count_) % kCredits] = ctrl;
          ++cts_count_;
        } else {
          return FailWith(ErrorCode::kDataLoss, fmt::format("unknown control message type {}", ctrl.type));
        }
      }
      PostRecvSlot(n);
      break;
    }
    case WrKind::kCtrlSend:
      if (!hello_sent_) hello_sent_ = true;  // the hello is the first control send
      break;
    case WrKind::kWrite: {
      // An RC send queue completes in posting order; anything else is a broken invariant.
      PSGD_CHECK_EQ(writes_.Consume(n), std::string());
      Outgoing& o = outgoing_[n % kCredits];
      PSGD_CHECK(o.op != nullptr);
      o.op->bytes_done += o.op->parts[o.part].bytes;
      o.op->seq_ |= uint64_t{1} << o.part;
      o = Outgoing{};
      break;
    }
  }
  Pump();
}

// ---------------------------------------------------------------------------------------------
// IbTransport

IbTransport::IbTransport(const IbOptions& options) : options_(options) {
  // Before any device work: a value the queue pairs would take silently modulo 32 or 8.
  if (options.ack_timeout < 1 || options.ack_timeout > 31) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: ibverbs ACK timeout {} is out of range: expected an exponent in [1, 31] "
          "(4.096 us * 2^timeout per try; comm.ib_timeout)",
          options.rank, options.ack_timeout);
  }
  if (options.retry_count < 0 || options.retry_count > 7) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: ibverbs retry count {} is out of range: expected [0, 7] (comm.ib_retry_count)",
          options.rank, options.retry_count);
  }
  cuda_memory_ = GpuDirectUsable(&no_cuda_why_);
  memlock_ = ReadMemlockLimit();
  ipc_lock_ = HasIpcLockCapability();
  const std::vector<IbDeviceDesc> devices = ProbeIbDevices();
  const IbSelection selection = SelectIbPort(devices, options.device, options.port);
  port_ = static_cast<uint8_t>(selection.port);

  int count = 0;
  std::unique_ptr<ibv_device*, VerbsDeleter<ibv_free_device_list>> list(ibv_get_device_list(&count));
  ibv_device* device = nullptr;
  for (int i = 0; list && i < count; ++i) {
    if (devices[selection.device].name == ibv_get_device_name(list.get()[i])) device = list.get()[i];
  }
  if (!device) {
    Throw(ErrorCode::kUnavailable, "rank {}: RDMA device {} disappeared", options.rank,
          devices[selection.device].name);
  }
  context_.reset(ibv_open_device(device));
  if (!context_) ThrowVerbs(options.rank, "ibv_open_device", errno);
  pd_.reset(ibv_alloc_pd(context_.get()));
  if (!pd_) ThrowVerbs(options.rank, "ibv_alloc_pd", errno);
  channel_.reset(ibv_create_comp_channel(context_.get()));
  if (!channel_) ThrowVerbs(options.rank, "ibv_create_comp_channel", errno);
  const int connections = static_cast<int>(options.peers.size()) * options.streams;
  cq_.reset(ibv_create_cq(context_.get(), std::max(1, connections) * (kSendDepth + kRecvDepth),
                          nullptr, channel_.get(), 0));
  if (!cq_) ThrowVerbs(options.rank, "ibv_create_cq", errno);

  ibv_port_attr port{};
  if (int err = ibv_query_port(context_.get(), port_, &port)) ThrowVerbs(options.rank, "ibv_query_port", err);
  mtu_ = static_cast<uint8_t>(port.active_mtu);
  ethernet_ = port.link_layer == IBV_LINK_LAYER_ETHERNET;
  std::vector<GidDesc> gids;
  for (int i = 0; i < port.gid_tbl_len; ++i) {
    ibv_gid_entry entry{};
    GidDesc g;
    g.index = i;
    if (ibv_query_gid_ex(context_.get(), port_, i, &entry, 0) == 0) {
      std::memcpy(g.gid.data(), entry.gid.raw, 16);
      g.roce_v2 = entry.gid_type == IBV_GID_TYPE_ROCE_V2;
    } else {
      ibv_gid gid{};
      if (ibv_query_gid(context_.get(), port_, i, &gid) != 0) continue;
      std::memcpy(g.gid.data(), gid.raw, 16);
    }
    gids.push_back(g);
  }
  gid_index_ = SelectGidIndex(gids, options.gid_index, ethernet_);

  IbAddress address;
  address.rank = options.rank;
  address.lid = port.lid;
  address.port = port_;
  address.mtu = mtu_;
  address.link_layer = ethernet_ ? 2 : 1;
  address.gid_index = static_cast<uint8_t>(gid_index_);
  for (const GidDesc& g : gids) {
    if (g.index == gid_index_) address.gid = g.gid;
  }
  size_t index = 0;
  for (int peer : options.peers) {
    for (int stream = 0; stream < options.streams; ++stream) {
      auto c = std::make_unique<IbConnection>(*this, index++, options.rank, peer, stream);
      address.qps.push_back({peer, static_cast<uint16_t>(stream), c->qpn(), c->psn()});
      unconnected_[{peer, stream}] = std::move(c);
    }
  }
  address_ = EncodeIbAddress(address);
  describe_ = fmt::format("ibverbs {} ({}, {} MTU {} bytes, GID index {})", selection.reason,
                          ethernet_ ? "RoCE" : "InfiniBand",
                          ethernet_ ? "" : fmt::format("lid {},", port.lid), MtuBytes(mtu_),
                          gid_index_);
  PSGD_LOG_INFO("rank {}: {}; RLIMIT_MEMLOCK {}", options.rank, describe_, DescribeMemlock(memlock_));
}

IbTransport::~IbTransport() {
  unconnected_.clear();
  PSGD_CHECK(live_.empty());     // connections must be destroyed before their transport
  PSGD_CHECK(regions_.empty());  // and memory regions too
}

MrPtr IbTransport::RegisterHost(void* data, size_t bytes, const char* what) {
  if (!ipc_lock_) CheckMemlock(pinned_ + bytes, memlock_, what);
  MrPtr mr(ibv_reg_mr(pd_.get(), data, bytes, kAccess));
  if (!mr) {
    const int err = errno;
    Throw(err == ENOMEM || err == EAGAIN || err == EPERM ? ErrorCode::kInvalidArgument
                                                          : ErrorCode::kInternal,
          "rank {}: ibv_reg_mr of {} bytes for {} failed: {} (RLIMIT_MEMLOCK is {}, {} bytes "
          "already pinned by this transport)",
          options_.rank, bytes, what, std::strerror(err), DescribeMemlock(memlock_), pinned_);
  }
  pinned_ += bytes;
  return mr;
}

std::unique_ptr<MemoryRegion> IbTransport::RegisterMemory(void* data, size_t bytes,
                                                          MemoryKind kind) {
  if (kind == MemoryKind::kCuda) {
    if (!cuda_memory_) {
      Throw(ErrorCode::kInvalidArgument,
            "rank {}: cannot register {} bytes of CUDA memory at {} with the ibverbs transport: "
            "GPUDirect RDMA is not usable here ({})",
            options_.rank, bytes, data, no_cuda_why_);
    }
    std::string how;
    MrPtr mr(RegisterCudaMemory(pd_.get(), data, bytes, kAccess, &how));
    PSGD_LOG_INFO("rank {}: registered {} bytes of CUDA memory for GPUDirect RDMA ({})",
                  options_.rank, bytes, how);
    return std::make_unique<IbRegion>(*this, data, bytes, kind, std::move(mr));
  }
  MrPtr mr = RegisterHost(data, bytes, "a registered buffer");
  return std::make_unique<IbRegion>(*this, data, bytes, kind, std::move(mr));
}

int IbTransport::PollCq() {
  std::array<ibv_wc, 32> wcs;
  const int n = ibv_poll_cq(cq_.get(), static_cast<int>(wcs.size()), wcs.data());
  if (n < 0) {
    auto error = std::make_exception_ptr(
        Error(ErrorCode::kInternal, fmt::format("rank {}: ibv_poll_cq failed", options_.rank)));
    for (auto& [i, c] : live_) c->Fail(error);
    return 0;
  }
  for (int i = 0; i < n; ++i) {
    const size_t index = wcs[i].wr_id >> 40;
    if (auto it = live_.find(index); it != live_.end()) it->second->OnCompletion(wcs[i]);
  }
  return n;
}

void IbTransport::Sleep(Deadline::Clock::time_point until) {
  const auto now = Deadline::Clock::now();
  if (until <= now) return;
  if (ibv_req_notify_cq(cq_.get(), 0) != 0) return;
  if (PollCq() > 0) return;  // a completion raced the arming
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(until - now).count();
  pollfd fd{channel_->fd, POLLIN, 0};
  if (poll(&fd, 1, static_cast<int>(std::min<int64_t>(ms, 50))) > 0) {
    ibv_cq* cq = nullptr;
    void* context = nullptr;
    if (ibv_get_cq_event(channel_.get(), &cq, &context) == 0) ibv_ack_cq_events(cq, 1);
  }
}

void IbTransport::Close() {
  auto error = std::make_exception_ptr(Error(
      ErrorCode::kAborted, fmt::format("rank {}: transport closed", options_.rank)));
  for (auto& [i, c] : live_) c->Fail(error);
}

void IbTransport::Idle(Deadline::Clock::time_point until) {
  for (auto& [index, c] : live_) c->ProbeIfIdle(Deadline::Clock::now());
  Sleep(until);
}

std::vector<std::unique_ptr<Connection>> IbTransport::Connect(
    const std::vector<std::pair<int, std::string>>& peers, Deadline deadline, int streams) {
  if (streams != options_.streams) {
    Throw(ErrorCode::kInvalidArgument,
          "rank {}: Connect with {} streams, but the ibverbs transport made queue pairs for {}",
          options_.rank, streams, options_.streams);
  }
  std::vector<std::unique_ptr<IbConnection>> connections;
  for (const auto& [peer, bytes] : peers) {
    const IbAddress remote =
        DecodeIbAddress(bytes, fmt::format("the address rank {} published", peer));
    if (remote.rank != peer) {
      Throw(ErrorCode::kDataLoss, "rank {}: the address published for rank {} is rank {}'s",
            options_.rank, peer, remote.rank);
    }
    if ((remote.link_layer == 2) != ethernet_) {
      Throw(ErrorCode::kInvalidArgument,
            "rank {}: rank {} is on {} and this rank on {}: both ends must use the same link layer "
            "(set comm.ib_device)",
            options_.rank, peer, remote.link_layer == 2 ? "RoCE" : "InfiniBand",
            ethernet_ ? "RoCE" : "InfiniBand");
    }
    for (int stream = 0; stream < streams; ++stream) {
      auto it = unconnected_.find({peer, stream});
      if (it == unconnected_.end()) {
        Throw(ErrorCode::kInvalidArgument,
              "rank {}: Connect to rank {} stream {}, but the ibverbs transport was created for "
              "peers {} (IbOptions::peers)",
              options_.rank, peer, stream, fmt::join(options_.peers, ", "));
      }
      const QpInfo* qp = remote.Find(options_.rank, static_cast<uint16_t>(stream));
      if (!qp) {
        Throw(ErrorCode::kDataLoss,
              "rank {}: rank {}'s address has no queue pair for rank {} stream {}: its transport "
              "was created for other peers",
              options_.rank, peer, options_.rank, stream);
      }
      std::unique_ptr<IbConnection> c = std::move(it->second);
      unconnected_.erase(it);
      Attach(c->index(), c.get());
      c->Establish(remote, *qp, options_.world_size);
      connections.push_back(std::move(c));
    }
  }
  // The hellos went out as each connection reached RTS (the peer's queue pair may not be in RTR
  // yet: the RC retries cover the gap).
  int idle = 0;
  while (true) {
    bool all = true;
    for (auto& c : connections) {
      if (c->failed()) std::rethrow_exception(c->failed());
      c->RetryHelloIfDue();
      all = all && c->hello_done();
    }
    if (all) break;
    if (deadline.expired()) {
      std::vector<std::string> missing;
      for (auto& c : connections) {
        if (!c->hello_done()) missing.push_back(fmt::format("rank {} stream {}", c->peer_rank(), c->stream()));
      }
      Throw(ErrorCode::kDeadlineExceeded,
            "rank {}: connecting to peers over ibverbs timed out: no hello from {}", options_.rank,
            fmt::join(missing, ", "));
    }
    if (PollCq() > 0) {
      idle = 0;
    } else if (++idle >= 256) {
      Sleep(std::min(deadline.when(), Deadline::Clock::now() + std::chrono::milliseconds(50)));
    }
  }
  for (auto& c : connections) {
    const Ctrl& h = c->peer_hello();
    if (h.rank != c->peer_rank() || h.stream != c->stream() ||
        h.length != static_cast<uint32_t>(options_.world_size)) {
      Throw(ErrorCode::kDataLoss,
            "rank {}: the ibverbs hello on the queue pair for rank {} stream {} came from rank {} "
            "stream {} with world size {} (ours is {})",
            options_.rank, c->peer_rank(), c->stream(), h.rank, h.stream, h.length,
            options_.world_size);
    }
  }
  std::vector<std::unique_ptr<Connection>> out;
  for (auto& c : connections) out.push_back(std::move(c));
  return out;
}

}  // namespace

std::vector<IbDeviceDesc> ProbeIbDevices() {
  std::vector<IbDeviceDesc> out;
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (!list) return out;
  for (int i = 0; i < count; ++i) {
    IbDeviceDesc desc;
    desc.name = ibv_get_device_name(list[i]);
    if (ibv_context* ctx = ibv_open_device(list[i])) {
      ibv_device_attr attr{};
      if (ibv_query_device(ctx, &attr) == 0) {
        for (int p = 1; p <= attr.phys_port_cnt; ++p) {
          ibv_port_attr port{};
          if (ibv_query_port(ctx, static_cast<uint8_t>(p), &port) != 0) continue;
          desc.ports.push_back({p, port.state == IBV_PORT_ACTIVE, PortStateName(port.state),
                                port.link_layer == IBV_LINK_LAYER_ETHERNET, port.lid});
        }
      }
      ibv_close_device(ctx);
    }
    out.push_back(std::move(desc));
  }
  ibv_free_device_list(list);
  return out;
}

std::unique_ptr<Transport> CreateIbTransport(const IbOptions& options) {
  return std::make_unique<IbTransport>(options);
}

}  // namespace pipesgd::transport::ibverbs
