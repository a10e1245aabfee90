#include "transport/rendezvous.h"

#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "transport/asio.h"

#include "core/base/error.h"
#include "core/base/log.h"
#include "transport/message_io.h"
#include "transport/wire.pb.h"

namespace pipesgd::transport {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

std::string What(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  }
}

// How long rank 0 keeps telling late arrivals why the job failed, after it has decided so.
constexpr double kFailureGraceS = 3.0;

// Compares two secrets in time that depends only on their lengths, not on where they differ.
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// Rank 0's side: collect one hello per rank, then answer everyone at once. If the job cannot
// start, rank 0 keeps the port open for kFailureGraceS and answers every connection, early or
// late, with the reason, so that no rank is left to wait out its own deadline.
class Server {
 public:
  Server(const RendezvousOptions& options, const std::string& own_address)
      : options_(options), acceptor_(io_), addresses_(options.world_size) {
    addresses_[0] = own_address;
    tcp::endpoint endpoint = ResolveEndpoint(options.master_addr, options.master_port);
    error_code ec;
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      Throw(ErrorCode::kIo,
            "rank 0: cannot listen for the rendezvous on {}:{}: {} (is another job using "
            "MASTER_PORT {}?)",
            options.master_addr, options.master_port, ec.message(), options.master_port);
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
                       options_.world_size, options_.world_size - missing.size()));
      RunUntil(io_, &done_, Deadline::After(kFailureGraceS + 1));
    }
    error_code ignored;
    acceptor_.close(ignored);
    if (failure_) Throw(failure_code_, "rank 0: {}", *failure_);
    std::vector<std::string> result;
    for (auto& a : addresses_) result.push_back(*a);
    return result;
  }

 private:
  struct Client {
    std::shared_ptr<tcp::socket> socket;
    std::string from;
  };

  void Accept() {
    auto socket = std::make_shared<tcp::socket>(io_);
    acceptor_.async_accept(*socket, [this, socket](const error_code& ec) {
      if (ec || done_) return;
      Accept();
      Client client{socket, RemoteName(*socket)};
      accepted_.push_back(client);
      if (failure_) return Send(client, error_reply_, /*counts=*/false);
      auto hello = std::make_shared<wire::RendezvousHello>();
      AsyncReadMessage(*socket, hello.get(), client.from,
                       [this, client, hello](std::exception_ptr error) {
                         OnHello(client, *hello, error);
                       });
    });
  }

  void OnHello(const Client& client, const wire::RendezvousHello& hello,
               const std::exception_ptr& error) {
    if (done_ || failure_) return;
    if (error) {
      // Not a pipesgd rank (a port scanner, a stray client): drop it, keep the job going.
      PSGD_LOG_WARN("rank 0: rendezvous dropped a connection from {}: {}", client.from,
                    What(error));
      error_code ignored;
      client.socket->close(ignored);
      return;
    }
    const int n = options_.world_size;
    const std::string& from = client.from;
    // Authentication comes first: a process without the job's token can neither join nor,
    // by sending a bad hello, fail the job.
    if (!options_.token.empty() && !SameSecret(hello.token(), options_.token)) {
      const std::string why =
          hello.token().empty() ? "it presented no job token" : "it presented a wrong job token";
      PSGD_LOG_WARN("rank 0: rendezvous refused a connection from {} (claiming rank {}): {}; "
                    "the job carries on without it",
                    from, hello.rank(), why);
      wire::RendezvousReply refusal;
      refusal.set_refused(true);
      refusal.set_error(fmt::format(
          "rank 0 at {}:{} refused this process: {} (PIPESGD_JOB_TOKEN must be that of the job; "
          "`pipesgd run` sets it)",
          options_.master_addr, options_.master_port, why));
      // Not one of the job's connections: a later failure of the job is none of its business.
      std::erase_if(accepted_, [&](const Client& c) { return c.socket == client.socket; });
      Send(client, refusal, /*counts=*/false);
      return;
    }
    std::string problem;
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
                            clients_[hello.rank()].from, from);
    }
    if (!problem.empty()) return Fail(ErrorCode::kInvalidArgument, problem);
    addresses_[hello.rank()] = hello.address();
    clients_[hello.rank()] = client;
    if (static_cast<int>(clients_.size()) == n - 1) {
      // Stop listening before anyone hears back: a rank answered early may start its next
      // rendezvous on this port at once, and must reach that round's listener, not this one.
      error_code ignored;
      acceptor_.close(ignored);
      wire::RendezvousReply reply;
      for (auto& a : addresses_) reply.add_addresses(*a);
      pending_writes_ = static_cast<int>(clients_.size());
      for (auto& [rank, c] : clients_) Send(c, reply, /*counts=*/true);
    }
  }

  // The job cannot start: tell every connection so far and, for a grace period, every new one.
  void Fail(ErrorCode code, const std::string& problem) {
    failure_ = problem;
    failure_code_ = code;
    error_reply_.set_error(problem);
    for (auto& client : accepted_) {
      if (client.socket->is_open()) Send(client, error_reply_, /*counts=*/false);
    }
    grace_timer_ = std::make_unique<asio::steady_timer>(
        io_, std::chrono::milliseconds(static_cast<int>(kFailureGraceS * 1000)));
    grace_timer_->async_wait([this](const error_code&) { done_ = true; });
  }

  // Writes `reply`, then closes gracefully: shutdown our side and drain until the peer closes,
  // so the kernel never resets the connection (which could discard the reply unread). `counts`:
  // the reply is one of the answers to the ranks, whose completion ends the rendezvous.
  void Send(const Client& client, const wire::RendezvousReply& reply, bool counts) {
    AsyncWriteMessage(*client.socket, reply, [this, client, counts](std::exception_ptr error) {
      if (error) {
        PSGD_LOG_WARN("rank 0: could not send the rendezvous answer to {}: {}", client.from,
                      What(error));
      } else {
        error_code ignored;
        client.socket->shutdown(tcp::socket::shutdown_send, ignored);
        Drain(client);
      }
      if (counts && !failure_ && --pending_writes_ == 0) done_ = true;
    });
  }

  void Drain(const Client& client) {
    auto scratch = std::make_shared<std::array<char, 512>>();
    client.socket->async_read_some(asio::buffer(*scratch),
                                   [this, client, scratch](const error_code& ec, size_t) {
                                     if (!ec) Drain(client);
                                   });
  }

  RendezvousOptions options_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::vector<std::optional<std::string>> addresses_;
  std::map<int, Client> clients_;  // ranks whose hello was accepted
  std::vector<Client> accepted_;   // every connection, in arrival order
  std::optional<std::string> failure_;
  ErrorCode failure_code_ = ErrorCode::kInvalidArgument;
  wire::RendezvousReply error_reply_;
  std::unique_ptr<asio::steady_timer> grace_timer_;
  bool done_ = false;
  int pending_writes_ = 0;
};

std::vector<std::string> RunClient(const RendezvousOptions& options, const std::string& address,
                                   Deadline deadline) {
  tcp::endpoint master = ResolveEndpoint(options.master_addr, options.master_port);
  const std::string where = fmt::format("rank 0 at {}:{}", options.master_addr, options.master_port);
  asio::io_context io;
  tcp::socket socket(io);
  std::string last_error = "no answer";

  // Connect, retrying while rank 0 is not listening yet.
  while (true) {
    if (deadline.expired()) {
      Throw(ErrorCode::kDeadlineExceeded, "rank {}: rendezvous with {} timed out (last error: {})",
            options.rank, where, last_error);
    }
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
    if (!connect_ec) break;
    last_error = connect_ec.message();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }

  wire::RendezvousHello hello;
  hello.set_protocol_version(kProtocolVersion);
  hello.set_rank(options.rank);
  hello.set_world_size(options.world_size);
  hello.set_address(address);
  hello.set_job(options.job);
  hello.set_token(options.token);
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
  if (!RunUntil(io, &done, deadline)) {
    Throw(ErrorCode::kDeadlineExceeded,
          "rank {}: rendezvous timed out waiting for {} to hear from all ranks", options.rank,
          where);
  }
  if (error) {
    Throw(ErrorCode::kUnavailable,
          "rank {}: rendezvous with {} failed before an answer: {} (did rank 0 fail? see its "
          "output)",
          options.rank, where, What(error));
  }
  if (reply.refused()) {
    Throw(ErrorCode::kInvalidArgument, "rank {}: rendezvous: {}", options.rank, reply.error());
  }
  if (!reply.error().empty()) {
    Throw(ErrorCode::kInvalidArgument, "rank {}: rendezvous rejected the job: {}", options.rank,
          reply.error());
  }
  if (reply.addresses_size() != options.world_size) {
    Throw(ErrorCode::kDataLoss, "rank {}: rendezvous answer lists {} addresses, expected {}",
          options.rank, reply.addresses_size(), options.world_size);
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
  return fmt::format("in {}: rank {} has `{}`, rank {} has `{}`",
                     context.empty() ? "line " + std::to_string(i + 1) : fmt::format("{}", fmt::join(context, ".")),
                     their_rank, trimmed(a, i), our_rank, trimmed(b, i));
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
