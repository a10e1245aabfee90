#include "transport/rendezvous.h"

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "transport/asio.h"

#include "core/base/error.h"
#include "core/base/log.h"
#include "transport/auth.h"
#include "transport/failure_relay.h"
#include "transport/ifname.h"
#include "transport/message_io.h"
#include "transport/wire.pb.h"

namespace pipesgd::transport {

bool IsLoopbackIp(const std::string& ip) {
  boost::system::error_code ec;
  const auto address = boost::asio::ip::make_address(ip, ec);
  if (ec) return false;
  // An IPv4 peer on an IPv6 socket (::ffff:127.0.0.1) is as local as 127.0.0.1.
  if (address.is_v6() && address.to_v6().is_v4_mapped()) {
    return boost::asio::ip::make_address_v4(boost::asio::ip::v4_mapped, address.to_v6())
        .is_loopback();
  }
  return address.is_loopback();
}

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

constexpr const char* kService = "rendezvous";

// How long rank 0 keeps telling late arrivals why the job failed, after it has decided so (a
// deadline failure keeps only long enough to flush the answers: every rank has its own
// deadline then).
constexpr double kFailureGraceS = 1.0;
constexpr double kDeadlineFlushS = 0.2;

// True if `host` is written as loopback: then binding it is what the user asked for.
bool WrittenAsLoopback(const std::string& host) {
  return host == "localhost" || IsLoopbackIp(host);
}

std::string IpOf(const tcp::socket& socket) {
  boost::system::error_code ec;
  const auto endpoint = socket.remote_endpoint(ec);
  return ec ? std::string() : endpoint.address().to_string();
}

// Rank 0's side: collect one hello per rank, then answer everyone at once. If the job cannot
// start, rank 0 keeps the port open for kFailureGraceS and answers every connection, early or
// late, with the reason, so that no rank is left to wait out its own deadline.
class Server {
 public:
  Server(const RendezvousOptions& options, const std::string& own_address)
      : options_(options),
        acceptor_(io_),
        addresses_(options.world_size),
        data_hosts_(options.world_size),
        from_(options.world_size),
        remote_(options.world_size, false) {
    addresses_[0] = own_address;
    data_hosts_[0] = options.data_host;
    from_[0] = "rank 0's host";
    self_ = fmt::format("rank 0 at {}", DescribeMaster(options.master_addr, options.master_port));
    tcp::endpoint endpoint = ResolveEndpoint(options.master_addr, options.master_port);
    resolved_ = endpoint.address().to_string();
    if (endpoint.address().is_loopback() && !WrittenAsLoopback(options.master_addr)) {
      // The name resolves to loopback here only (Debian's 127.0.1.1 line): the other hosts
      // resolve it to our real address, so listen there too, and let the loopback check say
      // what else is wrong.
      PSGD_LOG_INFO("rank 0: MASTER_ADDR={} resolves to {} (loopback) on this host; listening "
                    "for the rendezvous on every interface, port {}",
                    options.master_addr, resolved_, options.master_port);
      endpoint = tcp::endpoint(asio::ip::address_v4::any(), options.master_port);
    }
    // A rank connecting from one of these is on rank 0's host (the loopback check).
    for (const NetInterface& i : ListNetInterfaces()) local_ips_.push_back(i.ip);
    error_code ec;
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      Throw(ErrorCode::kIo,
            "rank 0: cannot listen for the rendezvous on {}:{} ({}): {} (is another job using "
            "MASTER_PORT {}?)",
            options.master_addr, options.master_port, endpoint.address().to_string(),
            ec.message(), options.master_port);
    }
  }

  std::vector<std::string> Run(Deadline deadline) {
    Accept();
    if (!RunUntil(io_, &done_, deadline)) {
      std::vector<int> missing;
      for (int r = 1; r < options_.world_size; ++r) {
        if (!addresses_[r]) missing.push_back(r);
      }
      Fail(ErrorCode::kDeadlineExceeded,
           fmt::format("rendezvous on {}:{} timed out: rank(s) {} never arrived (world size {}, "
                       "{} arrived)",
                       options_.master_addr, options_.master_port, fmt::join(missing, ", "),
                       options_.world_size, options_.world_size - missing.size()),
           // One missing rank is the failed one; several point at the job's set-up instead.
           missing.size() == 1 ? missing.front() : -1, kDeadlineFlushS);
      RunUntil(io_, &done_, Deadline::After(kFailureGraceS + 1));
    }
    error_code ignored;
    acceptor_.close(ignored);
    if (failure_) {
      Error error(failure_code_, fmt::format("rank 0: {}", *failure_));
      throw error.set_culprit(failed_rank_);
    }
    std::vector<std::string> result;
    for (auto& a : addresses_) result.push_back(*a);
    if (options_.relay && !options_.relay->attached()) {
      std::vector<int> fds(options_.world_size, -1);
      for (auto& [rank, c] : clients_) fds[rank] = c->socket->release(ignored);
      options_.relay->Attach(std::move(fds));
    }
    return result;
  }

 private:
  struct Client {
    std::shared_ptr<tcp::socket> socket;
    std::string from;
    std::string ip;
    bool watched = false;  // a read is pending on it (Watch): it is its own drain
    bool reading = false;  // its hello is being read
  };
  using ClientPtr = std::shared_ptr<Client>;

  void Accept() {
    auto socket = std::make_shared<tcp::socket>(io_);
    acceptor_.async_accept(*socket, [this, socket](const error_code& ec) {
      if (ec || done_) return;
      Accept();
      auto client = std::make_shared<Client>();
      client->socket = socket;
      client->from = RemoteName(*socket);
      client->ip = IpOf(*socket);
      // Authentication comes first: a process without the job's token learns nothing of the
      // job and can neither join nor, by sending a bad hello, fail it.
      AsyncAuthenticateClient(*socket, options_.token, kService, self_, client->from,
                              [this, client](const AuthOutcome& outcome) {
                                OnAuthenticated(client, outcome);
                              });
    });
  }

  void OnAuthenticated(const ClientPtr& client, const AuthOutcome& outcome) {
    if (done_) return;
    if (outcome.error) {
      // Not a pipesgd rank (a port scanner, a stray client), or one of another job: drop it,
      // keep the job going.
      PSGD_LOG_WARN("rank 0: rendezvous dropped a connection from {}{}: {}", client->from,
                    outcome.claimed_rank >= 0
                        ? fmt::format(" (claiming rank {})", outcome.claimed_rank)
                        : std::string(),
                    ExceptionText(outcome.error));
      error_code ignored;
      client->socket->close(ignored);
      return;
    }
    if (!outcome.refused.empty()) {
      PSGD_LOG_WARN("rank 0: rendezvous refused a connection from {} (claiming rank {}): {}; "
                    "the job carries on without it",
                    client->from, outcome.claimed_rank, outcome.refused);
      Drain(client);
      return;
    }
    accepted_.push_back(client);
    if (failure_) return Send(client, error_reply_, /*counts=*/false);
    auto hello = std::make_shared<wire::RendezvousHello>();
    client->reading = true;
    AsyncReadMessage(*client->socket, hello.get(), client->from,
                     [this, client, hello](std::exception_ptr error) {
                       OnHello(client, *hello, error);
                     });
  }

  void OnHello(const ClientPtr& client, const wire::RendezvousHello& hello,
               const std::exception_ptr& error) {
    client->reading = false;
    if (done_) return;
    if (failure_) {  // the failure has been sent to this connection already
      if (!error) Drain(client);
      return;
    }
    if (error) {
      PSGD_LOG_WARN("rank 0: rendezvous dropped a connection from {}: {}", client->from,
                    ExceptionText(error));
      std::erase(accepted_, client);
      error_code ignored;
      client->socket->close(ignored);
      return;
    }
    const int n = options_.world_size;
    const std::string& from = client->from;
    if (!hello.failure().empty() && hello.rank() >= 1 && hello.rank() < n) {
      return Fail(ErrorCode::kAborted,
                  fmt::format("rank {} (from {}) failed before it could join: {}", hello.rank(),
                              from, hello.failure()),
                  hello.rank());
    }
    std::string problem;
    int culprit = -1;
    if (hello.protocol_version() != kProtocolVersion) {
      problem = fmt::format("rank {} (from {}) speaks protocol version {}, rank 0 speaks {}",
                            hello.rank(), from, hello.protocol_version(), kProtocolVersion);
    } else if (hello.world_size() != n) {
      problem = fmt::format("rank {} (from {}) was started with WORLD_SIZE={}, rank 0 with {}",
                            hello.rank(), from, hello.world_size(), n);
    } else if (hello.rank() < 1 || hello.rank() >= n) {
      problem = fmt::format("a process (from {}) claims RANK={}, outside [0, {}) for world size {}{}",
                            from, hello.rank(), n, n, hello.rank() == 0 ? " (rank 0 is this process)" : "");
    } else if (hello.job() != options_.job) {
      problem = fmt::format("rank {} (from {}) was started with a different job than rank 0: {}",
                            hello.rank(), from,
                            DescribeJobDifference(hello.job(), hello.rank(), options_.job, 0));
    } else if (addresses_[hello.rank()]) {
      problem = fmt::format("rank {} joined twice (from {} and from {})", hello.rank(),
                            clients_[hello.rank()]->from, from);
    }
    if (!problem.empty()) return Fail(ErrorCode::kInvalidArgument, problem, culprit);
    const int rank = hello.rank();
    addresses_[rank] = hello.address();
    data_hosts_[rank] = hello.data_host();
    from_[rank] = from;
    remote_[rank] = !client->ip.empty() && !IsLoopbackIp(client->ip) &&
                    std::find(local_ips_.begin(), local_ips_.end(), client->ip) == local_ips_.end();
    clients_[rank] = client;
    Watch(client, rank);
    if (std::string trap = LoopbackProblem(data_hosts_, from_, remote_, options_.master_addr,
                                           resolved_);
        !trap.empty()) {
      int culprit_rank = 0;
      for (int r = 0; r < n; ++r) {
        if (IsLoopbackIp(data_hosts_[r])) {
          culprit_rank = r;
          break;
        }
      }
      return Fail(ErrorCode::kInvalidArgument, trap, culprit_rank);
    }
    if (static_cast<int>(clients_.size()) == n - 1) {
      // Stop listening before anyone hears back: a rank answered early may start its next
      // rendezvous on this port at once, and must reach that round's listener, not this one.
      error_code ignored;
      acceptor_.close(ignored);
      answered_ = true;
      // The connections become the failure relay: nothing may be read from them here any more
      // (a read could take the first bytes of a relay message).
      for (auto& [r, c] : clients_) c->socket->cancel(ignored);
      wire::RendezvousReply reply;
      for (auto& a : addresses_) reply.add_addresses(*a);
      pending_writes_ = static_cast<int>(clients_.size());
      for (auto& [r, c] : clients_) Send(c, reply, /*counts=*/true);
    }
  }

  // Until the answer goes out, a rank that arrived must stay: the end of its connection (its
  // process exited or was killed) fails the rendezvous at once, naming it.
  void Watch(const ClientPtr& client, int rank) {
    client->watched = true;
    auto scratch = std::make_shared<std::array<char, 64>>();
    client->socket->async_read_some(
        asio::buffer(*scratch), [this, client, rank, scratch](const error_code& ec, size_t) {
          if (answered_ || done_) return;
          if (!ec) return Watch(client, rank);  // nothing is expected; ignore it
          if (failure_) return;  // the end of a connection we have told why
          Fail(ErrorCode::kUnavailable,
               fmt::format("rank {} (from {}) left the rendezvous before every rank had "
                           "arrived: its connection closed ({}), so its process exited or was "
                           "killed",
                           rank, client->from, ec.message()),
               rank);
        });
  }

  // The job cannot start: tell every connection so far and, for a grace period, every new one.
  void Fail(ErrorCode code, const std::string& problem, int culprit,
            double grace_s = kFailureGraceS) {
    failure_ = problem;
    failure_code_ = code;
    failed_rank_ = culprit;
    error_reply_.set_error(problem);
    if (culprit >= 0) error_reply_.set_failed_rank(culprit);
    for (auto& client : accepted_) {
      if (client->socket->is_open()) Send(client, error_reply_, /*counts=*/false);
    }
    grace_timer_ = std::make_unique<asio::steady_timer>(
        io_, std::chrono::milliseconds(static_cast<int>(grace_s * 1000)));
    grace_timer_->async_wait([this](const error_code&) { done_ = true; });
  }

  // Writes `reply`. A failure then closes gracefully: shutdown our side and drain until the peer
  // closes, so the kernel never resets the connection (which could discard the reply unread).
  // `counts`: the reply is one of the answers to the ranks, whose completion ends the
  // rendezvous; the connection stays open for the failure relay.
  void Send(const ClientPtr& client, const wire::RendezvousReply& reply, bool counts) {
    AsyncWriteMessage(*client->socket, reply, [this, client, counts](std::exception_ptr error) {
      if (error) {
        PSGD_LOG_WARN("rank 0: could not send the rendezvous answer to {}: {}", client->from,
                      ExceptionText(error));
      } else if (!counts) {
        error_code ignored;
        client->socket->shutdown(tcp::socket::shutdown_send, ignored);
        if (!client->watched && !client->reading) Drain(client);
      }
      if (counts && !failure_ && --pending_writes_ == 0) done_ = true;
    });
  }

  void Drain(const ClientPtr& client) {
    auto scratch = std::make_shared<std::array<char, 512>>();
    client->socket->async_read_some(asio::buffer(*scratch),
                                    [this, client, scratch](const error_code& ec, size_t) {
                                      if (!ec) Drain(client);
                                    });
  }

  RendezvousOptions options_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::string self_;      // "rank 0 at host:port (ip)"
  std::string resolved_;  // what MASTER_ADDR resolves to here
  std::vector<std::string> local_ips_;
  std::vector<std::optional<std::string>> addresses_;
  std::vector<std::string> data_hosts_;
  std::vector<std::string> from_;
  std::vector<bool> remote_;
  std::map<int, ClientPtr> clients_;  // ranks whose hello was accepted
  std::vector<ClientPtr> accepted_;   // every authenticated connection, in arrival order
  std::optional<std::string> failure_;
  ErrorCode failure_code_ = ErrorCode::kInvalidArgument;
  int failed_rank_ = -1;
  wire::RendezvousReply error_reply_;
  std::unique_ptr<asio::steady_timer> grace_timer_;
  bool done_ = false;
  bool answered_ = false;
  int pending_writes_ = 0;
};

// Connects to rank 0, retrying while it is not listening yet; false at the deadline.
bool ConnectToMaster(asio::io_context& io, tcp::socket& socket, const tcp::endpoint& master,
                     Deadline deadline, std::string* last_error) {
  while (true) {
    if (deadline.expired()) return false;
    bool done = false;
    error_code connect_ec;
    socket = tcp::socket(io);
    socket.async_connect(master, [&](const error_code& ec) {
      connect_ec = ec;
      done = true;
    });
    if (!RunUntil(io, &done, deadline)) {
      error_code ignored;
      socket.close(ignored);
      io.poll();
      continue;
    }
    if (!connect_ec) return true;
    *last_error = connect_ec.message();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::vector<std::string> RunClient(const RendezvousOptions& options, const std::string& address,
                                   Deadline deadline) {
  tcp::endpoint master = ResolveEndpoint(options.master_addr, options.master_port);
  const std::string where =
      fmt::format("rank 0 at {}", DescribeMaster(options.master_addr, options.master_port));
  asio::io_context io;
  tcp::socket socket(io);
  std::string last_error = "no answer";
  if (!ConnectToMaster(io, socket, master, deadline, &last_error)) {
    Error error(ErrorCode::kDeadlineExceeded,
                fmt::format("rank {}: rendezvous with {} timed out: rank 0 never accepted a "
                            "connection (last error: {})",
                            options.rank, where, last_error));
    throw error.set_culprit(0);
  }
  AuthenticateToServer(io, socket, options.token, kService, options.rank, where, deadline);

  wire::RendezvousHello hello;
  hello.set_protocol_version(kProtocolVersion);
  hello.set_rank(options.rank);
  hello.set_world_size(options.world_size);
  hello.set_address(address);
  hello.set_job(options.job);
  hello.set_data_host(options.data_host);
  wire::RendezvousReply reply;
  std::exception_ptr error;
  bool done = false;
  // The reply is read whether or not the hello could be written: rank 0 may already have
  // answered (a failed job) and closed its side before our hello went out.
  AsyncWriteMessage(socket, hello, [](std::exception_ptr) {});
  AsyncReadMessage(socket, &reply, where, [&](std::exception_ptr e) {
    error = e;
    done = true;
  });
  // Past our deadline rank 0 is about to reach its own and tell us who is missing.
  if (!RunUntil(io, &done, deadline) && !RunUntil(io, &done, Deadline::After(kReasonWaitS))) {
    Throw(ErrorCode::kDeadlineExceeded,
          "rank {}: rendezvous timed out waiting for {} to hear from all ranks, and rank 0 gave "
          "no reason within {} s more",
          options.rank, where, kReasonWaitS);
  }
  if (options.relay && !error) options.relay->NoteRendezvousAnswered();
  if (error) {
    Error e(ErrorCode::kUnavailable,
            fmt::format("rank {}: rendezvous with {} failed before an answer: {} (did rank 0 "
                        "fail? see its output)",
                        options.rank, where, ExceptionText(error)));
    throw e.set_culprit(0);
  }
  if (!reply.error().empty()) {
    Error e(reply.has_failed_rank() ? ErrorCode::kAborted : ErrorCode::kInvalidArgument,
            fmt::format("rank {}: rendezvous rejected the job: {}", options.rank, reply.error()));
    throw e.set_culprit(reply.has_failed_rank() ? reply.failed_rank() : -1);
  }
  if (reply.addresses_size() != options.world_size) {
    Throw(ErrorCode::kDataLoss, "rank {}: rendezvous answer lists {} addresses, expected {}",
          options.rank, reply.addresses_size(), options.world_size);
  }
  if (options.relay && !options.relay->attached()) {
    error_code ignored;
    options.relay->Attach({socket.release(ignored)});
  }
  return {reply.addresses().begin(), reply.addresses().end()};
}

std::vector<std::string> SplitLines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start <= text.size()) {
    size_t nl = text.find('\n', start);
    if (nl == std::string::npos) nl = text.size();
    lines.push_back(text.substr(start, nl - start));
    start = nl + 1;
  }
  return lines;
}

size_t Indent(const std::string& line) { return line.find_first_not_of(' '); }

}  // namespace

std::string DescribeJobDifference(const std::string& theirs, int their_rank,
                                  const std::string& ours, int our_rank) {
  return DescribeJobDifference(theirs, fmt::format("rank {}", their_rank), ours,
                               fmt::format("rank {}", our_rank));
}

std::string DescribeJobDifference(const std::string& theirs, const std::string& their_label,
                                  const std::string& ours, const std::string& our_label) {
  const auto a = SplitLines(theirs);
  const auto b = SplitLines(ours);
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  auto trimmed = [](const std::vector<std::string>& lines, size_t at) -> std::string {
    if (at >= lines.size()) return "(nothing)";
    auto start = lines[at].find_first_not_of(' ');
    return start == std::string::npos ? "" : lines[at].substr(start);
  };
  // Enclosing sections: walk back for lines that open a block at a smaller indentation.
  std::vector<std::string> context;
  const std::vector<std::string>& lines = i < b.size() ? b : a;
  size_t depth = i < lines.size() ? Indent(lines[i]) : 0;
  for (size_t j = std::min(i, lines.size()); j-- > 0 && depth != std::string::npos && depth > 0;) {
    const std::string& line = lines[j];
    size_t indent = Indent(line);
    if (indent != std::string::npos && indent < depth && !line.empty() && line.back() == '{') {
      context.insert(context.begin(), line.substr(indent, line.size() - indent - 2));
      depth = indent;
    }
  }
  return fmt::format("in {}: {} has `{}`, {} has `{}`",
                     context.empty() ? "line " + std::to_string(i + 1) : fmt::format("{}", fmt::join(context, ".")),
                     their_label, trimmed(a, i), our_label, trimmed(b, i));
}

std::string DescribeMaster(const std::string& master_addr, uint16_t port) {
  std::string resolved;
  try {
    resolved = ResolveEndpoint(master_addr, port).address().to_string();
  } catch (const Error&) {
    resolved = "does not resolve";
  }
  if (resolved == master_addr) return fmt::format("{}:{}", master_addr, port);
  return fmt::format("{}:{} ({})", master_addr, port, resolved);
}

std::string LoopbackProblem(const std::vector<std::string>& ranks_data_host,
                            const std::vector<std::string>& ranks_from,
                            const std::vector<bool>& remote, const std::string& master_addr,
                            const std::string& master_resolved) {
  int remote_rank = -1;
  for (size_t r = 0; r < remote.size() && remote_rank < 0; ++r) {
    if (remote[r]) remote_rank = static_cast<int>(r);
  }
  if (remote_rank < 0) return {};
  for (size_t r = 0; r < ranks_data_host.size(); ++r) {
    if (!IsLoopbackIp(ranks_data_host[r])) continue;
    std::string why =
        r == 0 ? fmt::format("MASTER_ADDR={} resolves to {} on rank 0's host{}, so rank 0 chose "
                             "the loopback interface",
                             master_addr, master_resolved,
                             IsLoopbackIp(master_resolved) && !WrittenAsLoopback(master_addr)
                                 ? " (an /etc/hosts line such as Debian's `127.0.1.1 hostname`)"
                                 : "")
               : fmt::format("rank {} (from {}) chose the loopback interface", r, ranks_from[r]);
    return fmt::format(
        "rank {} would use loopback address {} for its data connections, but the job spans "
        "hosts (rank {} connected from {}): {}. Set comm.network_interface (or "
        "PIPESGD_SOCKET_IFNAME) to the interface of the network the hosts share, or MASTER_ADDR "
        "to rank 0's address on it",
        r, ranks_data_host[r], remote_rank, ranks_from[remote_rank], why);
  }
  return {};
}

void ReportFailureToRendezvous(const RendezvousOptions& options, const std::string& failure,
                               Deadline deadline) {
  if (options.rank == 0 || options.world_size <= 1) return;
  try {
    tcp::endpoint master = ResolveEndpoint(options.master_addr, options.master_port);
    const std::string where =
        fmt::format("rank 0 at {}", DescribeMaster(options.master_addr, options.master_port));
    asio::io_context io;
    tcp::socket socket(io);
    std::string last_error;
    if (!ConnectToMaster(io, socket, master, deadline, &last_error)) return;
    AuthenticateToServer(io, socket, options.token, kService, options.rank, where, deadline);
    wire::RendezvousHello hello;
    hello.set_protocol_version(kProtocolVersion);
    hello.set_rank(options.rank);
    hello.set_world_size(options.world_size);
    hello.set_failure(failure.substr(0, 4096));
    wire::RendezvousReply reply;
    bool done = false;
    AsyncWriteMessage(socket, hello, [](std::exception_ptr) {});
    AsyncReadMessage(socket, &reply, where, [&](std::exception_ptr) { done = true; });
    RunUntil(io, &done, deadline);  // rank 0's answer means it has heard us
  } catch (const std::exception& e) {
    PSGD_LOG_WARN("rank {}: could not tell rank 0 why this rank stops: {}", options.rank,
                  e.what());
  }
}

std::vector<std::string> RendezvousAllGather(const RendezvousOptions& options,
                                             const std::string& address, Deadline deadline) {
  if (options.world_size == 1) return {address};
  if (options.rank == 0) {
    Server server(options, address);
    return server.Run(deadline);
  }
  return RunClient(options, address, deadline);
}

}  // namespace pipesgd::transport
