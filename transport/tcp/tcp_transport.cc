#include "transport/tcp/tcp_transport.h"

#include <map>
#include <type_traits>
#include <set>
#include <vector>

#include "transport/asio.h"

#include "core/base/check.h"
#include "core/base/error.h"
#include "core/base/log.h"
#include "transport/message_io.h"
#include "transport/op_queue.h"
#include "transport/tcp/congestion.h"
#include "transport/wire.pb.h"

namespace pipesgd::transport::tcp {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

class TcpTransport;

struct TcpQueue : OpQueue {
  bool active = false;  // an asio operation for `head` is in flight
};

void Complete(Op* op, std::exception_ptr error) {
  op->error = std::move(error);
  op->done = true;
}

// Storage for the one in-flight asio operation of a direction. Asio allocates each operation's
// state through the handler's associated allocator, and from the heap when the operation is
// started outside io_context::run (as the ring does); with this, steady-state sends and
// receives make no heap allocation.
class HandlerMemory {
 public:
  HandlerMemory() = default;
  HandlerMemory(const HandlerMemory&) = delete;
  HandlerMemory& operator=(const HandlerMemory&) = delete;

  void* Allocate(size_t size) {
    if (!in_use_ && size <= sizeof(storage_)) {
      in_use_ = true;
      return storage_;
    }
    return ::operator new(size);
  }
  void Deallocate(void* p) {
    if (p == storage_) {
      in_use_ = false;
    } else {
      ::operator delete(p);
    }
  }

 private:
  alignas(std::max_align_t) unsigned char storage_[1024];
  bool in_use_ = false;
};

template <typename T>
struct HandlerAllocator {
  using value_type = T;
  explicit HandlerAllocator(HandlerMemory* m) noexcept : memory(m) {}
  template <typename U>
  HandlerAllocator(const HandlerAllocator<U>& other) noexcept : memory(other.memory) {}
  T* allocate(size_t n) { return static_cast<T*>(memory->Allocate(sizeof(T) * n)); }
  void deallocate(T* p, size_t) noexcept { memory->Deallocate(p); }
  template <typename U>
  bool operator==(const HandlerAllocator<U>& other) const noexcept { return memory == other.memory; }

  HandlerMemory* memory;
};

// A completion handler that asio allocates its operation state for from `memory`.
template <typename F>
struct WithHandlerMemory {
  using allocator_type = HandlerAllocator<void>;
  allocator_type get_allocator() const noexcept { return allocator_type(memory); }
  template <typename... Args>
  void operator()(Args&&... args) {
    f(std::forward<Args>(args)...);
  }

  HandlerMemory* memory;
  F f;
};

class TcpConnection final : public Connection {
 public:
  TcpConnection(TcpTransport& owner, tcp::socket socket, int self_rank, int peer_rank);
  ~TcpConnection() override;

  int peer_rank() const override { return peer_rank_; }
  void PostSend(Op& op) override;
  void PostRecv(Op& op) override;
  std::string RestartCongestionControl() override {
    if (failed_ || !socket_.is_open()) return {};
    return transport::RestartCongestionControl(socket_.native_handle());
  }

  // Fails every pending and future op with `error` and closes the socket.
  void Fail(std::exception_ptr error);
  // After Fail: runs the cancelled asio operations' handlers, which still reference this
  // connection and the ops they were moving, so that when it returns neither is referenced.
  void Quiesce();

 private:
  template <bool kSend>
  void Start();
  void Drain(TcpQueue& queue);
  std::exception_ptr IoError(const char* direction, const error_code& ec, const Op& op,
                             size_t bytes) const;

  TcpTransport& owner_;
  tcp::socket socket_;
  int self_rank_;
  int peer_rank_;
  TcpQueue send_;
  TcpQueue recv_;
  HandlerMemory send_memory_;
  HandlerMemory recv_memory_;
  std::exception_ptr failed_;
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const TcpOptions& options);
  ~TcpTransport() override;

  std::string name() const override { return "tcp"; }
  int rank() const override { return options_.rank; }
  std::string LocalAddress() const override { return address_; }
  std::vector<std::unique_ptr<Connection>> Connect(
      const std::vector<std::pair<int, std::string>>& peers, Deadline deadline,
      int streams) override;
  void Poll() override;
  void Close() override;

  asio::io_context& io() { return io_; }
  void Register(TcpConnection* c) { live_.insert(c); }
  void Unregister(TcpConnection* c) { live_.erase(c); }

 protected:
  // TCP's progress is Idle's run_one_until, which returns as soon as one handler has run.
  bool ProgressOnce() override { return false; }
  void Idle(Deadline::Clock::time_point until) override {
    if (io_.stopped()) io_.restart();
    io_.run_one_until(until);
  }

 private:
  TcpOptions options_;
  asio::io_context io_;
  // Keeps run_one_until() blocking (instead of returning at once) when nothing is pending.
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  tcp::acceptor acceptor_;
  std::string address_;
  std::set<TcpConnection*> live_;
};

// ---------------------------------------------------------------------------------------------
// TcpConnection

TcpConnection::TcpConnection(TcpTransport& owner, tcp::socket socket, int self_rank,
                             int peer_rank)
    : owner_(owner), socket_(std::move(socket)), self_rank_(self_rank), peer_rank_(peer_rank) {
  owner_.Register(this);
}

TcpConnection::~TcpConnection() {
  Fail(std::make_exception_ptr(Error(
      ErrorCode::kAborted,
      fmt::format("rank {}: connection to rank {} was closed locally", self_rank_, peer_rank_))));
  Quiesce();
  owner_.Unregister(this);
}

void TcpConnection::Quiesce() {
  while (send_.active || recv_.active) {
    if (owner_.io().stopped()) owner_.io().restart();
    owner_.io().run_one_for(std::chrono::milliseconds(10));
  }
}

std::exception_ptr TcpConnection::IoError(const char* direction, const error_code& ec,
                                          const Op& op, size_t bytes) const {
  std::string cause = ec == asio::error::eof ? fmt::format("rank {} closed the connection", peer_rank_)
                                             : ec.message();
  return std::make_exception_ptr(Error(
      ErrorCode::kUnavailable,
      fmt::format("rank {}: {} rank {} failed after {} of {} bytes: {}", self_rank_, direction,
                  peer_rank_, bytes, op.total_bytes(), cause)));
}

void TcpConnection::Fail(std::exception_ptr error) {
  if (!failed_) {
    failed_ = std::move(error);
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }
  // Ops behind an in-flight asio operation are drained by its (cancelled) handler.
  if (!send_.active) Drain(send_);
  if (!recv_.active) Drain(recv_);
}

void TcpConnection::Drain(TcpQueue& queue) {
  while (queue.head) Complete(queue.Pop(), failed_);
}

void TcpConnection::PostSend(Op& op) {
  op.done = false;
  op.bytes_done = 0;
  op.error = nullptr;
  send_.Push(&op);
  Start<true>();
}

void TcpConnection::PostRecv(Op& op) {
  op.done = false;
  op.bytes_done = 0;
  op.error = nullptr;
  recv_.Push(&op);
  Start<false>();
}

// One in-flight asio operation per direction; its handler completes the head op and starts the
// next, so ops complete in posting order. Send and receive differ only in the asio call.
template <bool kSend>
void TcpConnection::Start() {
  TcpQueue& queue = kSend ? send_ : recv_;
  if (queue.active || !queue.head) return;
  if (failed_) return Drain(queue);
  Op* op = queue.head;
  using Buffer = std::conditional_t<kSend, asio::const_buffer, asio::mutable_buffer>;
  // Unused parts stay zero-length, which asio skips; a fixed array avoids any allocation.
  std::array<Buffer, Op::kMaxParts> buffers{};
  for (int i = 0; i < op->num_parts; ++i) buffers[i] = Buffer(op->parts[i].data, op->parts[i].bytes);
  queue.active = true;
  auto handler = [this, &queue](const error_code& ec, size_t bytes) {
    queue.active = false;
    Op* done = queue.Pop();
    done->bytes_done = bytes;
    if (ec) {
      auto error = failed_ ? failed_ : IoError(kSend ? "send to" : "receive from", ec, *done, bytes);
      Complete(done, error);
      Fail(error);
      return;
    }
    Complete(done, nullptr);
    Start<kSend>();
  };
  using Handler = WithHandlerMemory<decltype(handler)>;
  if constexpr (kSend) {
    asio::async_write(socket_, buffers, Handler{&send_memory_, std::move(handler)});
  } else {
    asio::async_read(socket_, buffers, Handler{&recv_memory_, std::move(handler)});
  }
}

// ---------------------------------------------------------------------------------------------
// TcpTransport

TcpTransport::TcpTransport(const TcpOptions& options)
    : options_(options), work_(asio::make_work_guard(io_)), acceptor_(io_) {
  error_code ec;
  auto address = asio::ip::make_address(options.bind_host, ec);
  if (ec) {
    Throw(ErrorCode::kInvalidArgument, "rank {}: bind address '{}' is not a numeric IP: {}",
          options.rank, options.bind_host, ec.message());
  }
  tcp::endpoint endpoint(address, 0);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    Throw(ErrorCode::kIo, "rank {}: cannot listen on {}: {}", options.rank, options.bind_host,
          ec.message());
  }
  wire::TcpAddress published;
  published.set_host(options.bind_host);
  published.set_port(acceptor_.local_endpoint().port());
  address_ = published.SerializeAsString();
  PSGD_LOG_DEBUG("rank {}: tcp transport listening on {}:{}", options.rank, options.bind_host,
                 published.port());
}

TcpTransport::~TcpTransport() {
  PSGD_CHECK(live_.empty());  // connections must be destroyed before their transport
}

void TcpTransport::Poll() {
  if (io_.stopped()) io_.restart();
  io_.poll();
}

void TcpTransport::Close() {
  auto error = std::make_exception_ptr(Error(
      ErrorCode::kAborted, fmt::format("rank {}: transport closed", options_.rank)));
  const std::vector<TcpConnection*> live(live_.begin(), live_.end());
  for (TcpConnection* c : live) c->Fail(error);
  // Every op fails here, not at a later Wait or at the connection's end: a caller that closes
  // on an error may free its ops next (the PS server's posted receives did, and the connection's
  // destructor then wrote into them).
  for (TcpConnection* c : live) c->Quiesce();
}

// Connection set-up state shared by the asio handlers (which may outlive a failed Connect call).
struct ConnectState {
  int rank = 0;
  int world_size = 0;
  int streams = 1;
  std::map<std::pair<int, int>, tcp::socket> established;  // (rank, stream)
  std::set<int> expect_accept;
  std::map<int, std::string> dial_errors;
  std::exception_ptr fatal;
  bool done = false;
  size_t wanted = 0;
  void Check() { done = fatal || established.size() == wanted; }
};

std::vector<std::unique_ptr<Connection>> TcpTransport::Connect(
    const std::vector<std::pair<int, std::string>>& peers, Deadline deadline, int streams) {
  PSGD_CHECK_GE(streams, 1);
  auto state = std::make_shared<ConnectState>();
  state->rank = options_.rank;
  state->world_size = options_.world_size;
  state->streams = streams;
  state->wanted = peers.size() * static_cast<size_t>(streams);
  std::map<int, tcp::endpoint> dial;
  for (const auto& [peer, address] : peers) {
    PSGD_CHECK_NE(peer, options_.rank);
    if (peer < options_.rank) {
      state->expect_accept.insert(peer);
      continue;
    }
    wire::TcpAddress parsed;
    if (!parsed.ParseFromString(address) || parsed.port() == 0 || parsed.port() > 65535) {
      Throw(ErrorCode::kDataLoss, "rank {}: the address rank {} published is not a TCP address",
            options_.rank, peer);
    }
    error_code ec;
    auto ip = asio::ip::make_address(parsed.host(), ec);
    if (ec) {
      Throw(ErrorCode::kDataLoss, "rank {}: rank {} published host '{}', not a numeric IP",
            options_.rank, peer, parsed.host());
    }
    dial[peer] = tcp::endpoint(ip, static_cast<uint16_t>(parsed.port()));
  }

  // Accept side: the hello names the dialing rank; anything else is logged and dropped.
  std::function<void()> accept_next;
  accept_next = [this, state, &accept_next]() {
    auto socket = std::make_shared<tcp::socket>(io_);
    acceptor_.async_accept(*socket, [this, state, socket, accept_next](const error_code& ec) {
      if (ec || state->done) return;
      accept_next();
      const std::string from = RemoteName(*socket);
      auto hello = std::make_shared<wire::ConnectionHello>();
      AsyncReadMessage(*socket, hello.get(), from, [state, socket, hello, from](std::exception_ptr error) {
        std::string reason;
        if (error) {
          try { std::rethrow_exception(error); } catch (const std::exception& e) { reason = e.what(); }
        } else if (hello->protocol_version() != kProtocolVersion) {
          reason = fmt::format("protocol version {} (ours is {})", hello->protocol_version(), kProtocolVersion);
        } else if (hello->world_size() != state->world_size) {
          reason = fmt::format("rank {} has world size {}, ours is {}", hello->rank(), hello->world_size(), state->world_size);
        } else if (hello->stream() < 0 || hello->stream() >= state->streams) {
          reason = fmt::format("rank {} opens stream {}, we use {} per peer", hello->rank(),
                               hello->stream(), state->streams);
        } else if (!state->expect_accept.count(hello->rank()) ||
                   state->established.count({hello->rank(), hello->stream()})) {
          reason = fmt::format("unexpected rank {} stream {}", hello->rank(), hello->stream());
        }
        if (!reason.empty()) {
          PSGD_LOG_WARN("rank {}: rejected a data connection from {}: {}", state->rank, from, reason);
          error_code ignored2;
          socket->close(ignored2);
          return;
        }
        state->established.emplace(std::pair{hello->rank(), hello->stream()}, std::move(*socket));
        state->Check();
      });
    });
  };
  if (!state->expect_accept.empty()) accept_next();

  // Dial side: retry refused connections until the deadline (the peer may not listen yet).
  std::function<void(int, int, tcp::endpoint)> dial_one;
  dial_one = [this, state, &dial_one](int peer, int stream, tcp::endpoint endpoint) {
    auto socket = std::make_shared<tcp::socket>(io_);
    socket->async_connect(endpoint, [this, state, socket, peer, stream, endpoint, dial_one](const error_code& ec) {
      if (state->done) return;
      if (ec) {
        state->dial_errors[peer] = ec.message();
        auto timer = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(100));
        timer->async_wait([timer, peer, stream, endpoint, dial_one, state](const error_code& tec) {
          if (!tec && !state->done) dial_one(peer, stream, endpoint);
        });
        return;
      }
      error_code ignored;
      socket->set_option(tcp::no_delay(true), ignored);
      wire::ConnectionHello hello;
      hello.set_protocol_version(kProtocolVersion);
      hello.set_rank(state->rank);
      hello.set_world_size(state->world_size);
      hello.set_stream(stream);
      AsyncWriteMessage(*socket, hello, [state, socket, peer, stream](std::exception_ptr error) {
        if (error) {
          state->fatal = error;
        } else {
          state->established.emplace(std::pair{peer, stream}, std::move(*socket));
        }
        state->Check();
      });
    });
  };
  for (const auto& [peer, endpoint] : dial) {
    for (int stream = 0; stream < streams; ++stream) dial_one(peer, stream, endpoint);
  }

  state->Check();
  bool ok = RunUntil(io_, &state->done, deadline);
  state->done = true;  // stops retries and late accepts
  error_code ignored;
  acceptor_.cancel(ignored);
  io_.poll();

  if (state->fatal) std::rethrow_exception(state->fatal);
  if (!ok) {
    std::vector<std::string> missing;
    int first_missing = -1;
    for (const auto& [peer, address] : peers) {
      int up = 0;
      for (int stream = 0; stream < streams; ++stream) up += state->established.count({peer, stream});
      if (up == streams) continue;
      if (first_missing < 0) first_missing = peer;
      if (peer < options_.rank) {
        missing.push_back(fmt::format("rank {} never connected", peer));
      } else {
        auto it = state->dial_errors.find(peer);
        missing.push_back(fmt::format("rank {} at {}:{} not reachable ({})", peer,
                                      dial[peer].address().to_string(), dial[peer].port(),
                                      it == state->dial_errors.end() ? "no answer" : it->second));
      }
    }
    Error error(ErrorCode::kDeadlineExceeded,
                fmt::format("rank {}: connecting to peers timed out: {}", options_.rank,
                            fmt::join(missing, "; ")));
    throw error.set_culprit(first_missing);
  }

  std::vector<std::unique_ptr<Connection>> connections;
  for (const auto& [peer, address] : peers) {
    for (int stream = 0; stream < streams; ++stream) {
      tcp::socket& socket = state->established.at({peer, stream});
      error_code ec;
      socket.set_option(tcp::no_delay(true), ec);
      connections.push_back(
          std::make_unique<TcpConnection>(*this, std::move(socket), options_.rank, peer));
    }
  }
  return connections;
}

}  // namespace

std::unique_ptr<Transport> CreateTcpTransport(const TcpOptions& options) {
  return std::make_unique<TcpTransport>(options);
}

}  // namespace pipesgd::transport::tcp
