#include "core/train/sdpipe_service.h"

#include <chrono>
#include <cmath>
#include <thread>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/sdpipe.pb.h"  // generated from core/train/sdpipe.proto
#include "transport/asio.h"
#include "transport/auth.h"
#include "transport/message_io.h"

namespace pipesgd::train {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

constexpr const char* kService = "group scheduler";

void FillReply(const GroupDecision& d, double window_s, sdpipe::GroupReply* reply) {
  for (int m : d.members) reply->add_members(m);
  reply->set_round(d.round);
  reply->set_kind(static_cast<int>(d.kind));
  reply->set_epoch_end(d.epoch_end);
  reply->set_epoch(d.epoch);
  reply->set_stop(d.stop);
  reply->set_evaluate(d.evaluate);
  reply->set_updates(d.updates);
  reply->set_window_s(window_s);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Service

struct GroupSchedulerService::Impl {
  struct Conn {
    explicit Conn(asio::io_context& io) : socket(io) {}
    tcp::socket socket;
    std::string name;  // "ip:port", then "rank R (ip:port)"
    int rank = -1;     // set by the first authenticated request
    int stage = 0;
    int64_t last_step = 0;
    bool waiting = false;   // a request is in a round and has no answer yet
    bool finished = false;  // got the last round's answer: closing is expected
    bool last_request = false;  // the waiting request is the rank's last (GroupRequest.last)
    bool closed = false;
    sdpipe::GroupRequest request;
  };

  Impl(const GroupSchedulerOptions& o, int num_stages, std::string t)
      : options(o), token(std::move(t)), start(std::chrono::steady_clock::now()) {
    for (int s = 0; s < num_stages; ++s) stages.emplace_back(o);
    by_rank.assign(num_stages, std::vector<std::shared_ptr<Conn>>(o.world_size));
    decisions.resize(num_stages);
  }

  double Now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  void Accept() {
    auto conn = std::make_shared<Conn>(io);
    acceptor.async_accept(conn->socket, [this, conn](const boost::system::error_code& ec) {
      if (ec) return;  // closed: the service is stopping
      conn->name = transport::RemoteName(conn->socket);
      boost::system::error_code ignored;
      conn->socket.set_option(tcp::no_delay(true), ignored);
      Accept();
      // The token is proven before any request is read: a stranger learns nothing and cannot
      // take a rank or fail the job.
      transport::AsyncAuthenticateClient(
          conn->socket, token, kService, "the group scheduler", conn->name,
          [this, conn](const transport::AuthOutcome& outcome) {
            if (outcome.error || !outcome.refused.empty()) {
              PSGD_LOG_WARN("group scheduler: refused a connection from {}: {}", conn->name,
                            outcome.error ? transport::ExceptionText(outcome.error) : outcome.refused);
              Close(conn);
              return;
            }
            conns.push_back(conn);
            Read(conn);
          });
    });
  }

  void Read(const std::shared_ptr<Conn>& conn) {
    transport::AsyncReadMessage(
        conn->socket, &conn->request, conn->name, [this, conn](std::exception_ptr read_error) {
          if (!read_error) {
            OnRequest(conn);
            return;
          }
          Close(conn);
          std::string what;
          try {
            std::rethrow_exception(read_error);
          } catch (const Error& e) {
            what = e.what();
            if (e.code() == ErrorCode::kDataLoss) {
              // Not a pipesgd peer (bad magic, oversized or unparsable frame).
              PSGD_LOG_WARN("group scheduler: dropped a connection from {}: {}", conn->name, what);
              if (conn->rank < 0) return;
            }
          }
          if (conn->rank < 0 || conn->finished) return;  // a stranger, or a rank that is done
          Fail(fmt::format("rank {} disconnected from the group scheduler ({}) before the job's "
                           "last round: it died, was killed or lost its network; {}",
                           conn->rank, what,
                           conn->waiting ? "it was waiting for its group"
                                         : "the others cannot form their groups without it"));
        });
  }

  void Close(const std::shared_ptr<Conn>& conn) {
    if (conn->closed) return;
    conn->closed = true;
    boost::system::error_code ignored;
    conn->socket.close(ignored);
  }

  void Send(const std::shared_ptr<Conn>& conn, const sdpipe::GroupReply& reply, bool then_close) {
    if (conn->closed) return;
    transport::AsyncWriteMessage(conn->socket, reply, [this, conn, then_close](std::exception_ptr) {
      // A failed write shows up as a closed connection on the next read.
      if (then_close) Close(conn);
    });
  }

  void Fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!error.empty()) return;
      error = why;
    }
    PSGD_LOG_ERROR("group scheduler: {}", why);
    sdpipe::GroupReply reply;
    reply.set_error(why);
    for (auto& conn : conns) {
      if (conn->waiting) {
        conn->waiting = false;
        Send(conn, reply, true);
      }
    }
    timer.cancel();
  }

  void OnRequest(const std::shared_ptr<Conn>& conn) {
    const sdpipe::GroupRequest& req = conn->request;
    const int n = options.world_size;
    if (conn->rank < 0) {
      // First request (the connection is authenticated): bind it to its rank.
      std::string bad;
      if (req.protocol_version() != transport::kProtocolVersion) {
        bad = fmt::format("protocol version {} (ours is {})", req.protocol_version(),
                          transport::kProtocolVersion);
      } else if (req.world_size() != n) {
        bad = fmt::format("world size {} (the job has {})", req.world_size(), n);
      } else if (req.rank() < 0 || req.rank() >= n) {
        bad = fmt::format("rank {} (expected a rank in [0, {}))", req.rank(), n);
      } else if (req.stage() < 0 || req.stage() >= static_cast<int>(stages.size())) {
        bad = fmt::format("stage {} (expected a stage in [0, {}))", req.stage(), stages.size());
      } else if (by_rank[req.stage()][req.rank()]) {
        bad = fmt::format("rank {} of stage {} connected a second time (from {}; first from {})",
                          req.rank(), req.stage(), conn->name,
                          by_rank[req.stage()][req.rank()]->name);
      }
      if (!bad.empty()) {
        sdpipe::GroupReply reply;
        Fail(fmt::format("a group request from {} has {}", conn->name, bad));
        reply.set_error(error_copy());
        Send(conn, reply, true);
        return;
      }
      // A connection belongs to one (stage, rank): with pipeline stages, the replicas of each
      // stage are ranks 0..N-1 of that stage's scheduler, each on its own connection.
      conn->rank = req.rank();
      conn->stage = req.stage();
      conn->name = stages.size() > 1
                       ? fmt::format("rank {} of stage {} ({})", req.rank(), req.stage(), conn->name)
                       : fmt::format("rank {} ({})", req.rank(), conn->name);
      by_rank[req.stage()][req.rank()] = conn;
    }
    if (!error_copy().empty()) {
      sdpipe::GroupReply reply;
      reply.set_error(error_copy());
      Send(conn, reply, true);
      return;
    }
    std::string bad;
    if (req.rank() != conn->rank) {
      bad = fmt::format("rank {} on the connection of rank {}", req.rank(), conn->rank);
    } else if (req.stage() != conn->stage) {
      bad = fmt::format("stage {} on the connection of stage {}", req.stage(), conn->stage);
    } else if (req.step() <= conn->last_step) {
      bad = fmt::format("step {} after step {} (steps must advance)", req.step(), conn->last_step);
    }
    if (bad.empty() && req.leaving()) {
      // Not an arrival: the rank took no step. In a round it could be held for a barrier that
      // waits for ranks that have left too.
      conn->last_step = req.step();
      conn->finished = true;
      GroupDecision alone;
      alone.members = {conn->rank};
      alone.stop = true;
      alone.updates = stages[req.stage()].updates();
      sdpipe::GroupReply reply;
      FillReply(alone, stages[req.stage()].window_s(), &reply);
      Read(conn);
      Send(conn, reply, false);
      return;
    }
    if (bad.empty()) {
      try {
        stages[req.stage()].Arrive(conn->rank, Now());
      } catch (const Error& e) {
        bad = e.what();
      }
    }
    if (!bad.empty()) {
      Fail(fmt::format("rank {} broke the scheduling protocol: {}", conn->rank, bad));
      sdpipe::GroupReply reply;
      reply.set_error(error_copy());
      Send(conn, reply, true);
      return;
    }
    conn->last_step = req.step();
    conn->last_request = req.last();
    conn->waiting = true;
    Read(conn);
    DecideAll();
  }

  std::string error_copy() const {
    std::lock_guard<std::mutex> lock(mu);
    return error;
  }

  void DecideAll() {
    double wake = INFINITY;
    for (size_t s = 0; s < stages.size(); ++s) {
      GroupScheduler& sched = stages[s];
      while (auto d = sched.Decide(Now())) {
        {
          std::lock_guard<std::mutex> lock(mu);
          decisions[s].push_back(*d);
        }
        sdpipe::GroupReply reply;
        FillReply(*d, sched.window_s(), &reply);
        for (int m : d->members) {
          auto& conn = by_rank[s][m];
          conn->waiting = false;
          conn->finished = d->stop || conn->last_request;
          Send(conn, reply, false);
        }
      }
      wake = std::min(wake, sched.wake_time());
    }
    timer.cancel();
    if (std::isfinite(wake)) {
      const double delay = std::max(0.0, wake - Now());
      timer.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(delay)));
      timer.async_wait([this](const boost::system::error_code& ec) {
        if (!ec && error_copy().empty()) DecideAll();
      });
    }
  }

  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer timer{io};
  GroupSchedulerOptions options;
  std::string token;
  std::chrono::steady_clock::time_point start;
  std::vector<GroupScheduler> stages;
  std::vector<std::vector<std::shared_ptr<Conn>>> by_rank;  // [stage][rank]
  std::vector<std::shared_ptr<Conn>> conns;
  mutable std::mutex mu;  // decisions and error: read by other threads
  std::vector<std::vector<GroupDecision>> decisions;
  std::string error;
};

GroupSchedulerService::GroupSchedulerService(const GroupSchedulerOptions& options, int stages,
                                             const std::string& bind_host,
                                             const std::string& token) {
  if (stages < 1) {
    Throw(ErrorCode::kInvalidArgument, "group scheduler: {} stages: expected >= 1", stages);
  }
  impl_ = std::make_unique<Impl>(options, stages, token);
  boost::system::error_code ec;
  auto ip = asio::ip::make_address(bind_host, ec);
  if (ec) {
    Throw(ErrorCode::kInvalidArgument, "group scheduler: bind host '{}' is not a numeric IP",
          bind_host);
  }
  tcp::endpoint endpoint(ip, 0);
  impl_->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl_->acceptor.bind(endpoint, ec);
  if (!ec) impl_->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    Throw(ErrorCode::kIo, "group scheduler: cannot listen on {}: {}", bind_host, ec.message());
  }
  port_ = impl_->acceptor.local_endpoint().port();
  impl_->Accept();
  thread_ = std::thread([this] {
    try {
      impl_->io.run();
    } catch (const std::exception& e) {
      impl_->Fail(fmt::format("the group scheduler stopped: {}", e.what()));
    }
  });
}

GroupSchedulerService::~GroupSchedulerService() {
  impl_->io.stop();
  thread_.join();
}

std::vector<GroupDecision> GroupSchedulerService::decisions(int stage) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->decisions.at(stage);
}

std::string GroupSchedulerService::error() const { return impl_->error_copy(); }

// ---------------------------------------------------------------------------------------------
// Client

struct GroupSchedulerClient::Impl {
  asio::io_context io;
  tcp::socket socket{io};
  std::string where;
  int rank = 0;
  int world_size = 1;
  std::string token;
  bool failed = false;
  std::string failure;
};

GroupSchedulerClient::GroupSchedulerClient(const std::string& host, uint16_t port, int rank,
                                           int world_size, const std::string& token,
                                           Deadline deadline)
    : impl_(std::make_unique<Impl>()) {
  impl_->rank = rank;
  impl_->world_size = world_size;
  impl_->token = token;
  impl_->where = fmt::format("the group scheduler at {}:{}", host, port);
  const tcp::endpoint endpoint = transport::ResolveEndpoint(host, port);
  boost::system::error_code ec;
  while (true) {
    impl_->socket.connect(endpoint, ec);
    if (!ec) break;
    boost::system::error_code ignored;
    impl_->socket.close(ignored);
    if (deadline.expired()) {
      Throw(ErrorCode::kDeadlineExceeded, "rank {}: cannot connect to {}: {}", rank,
            impl_->where, ec.message());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  impl_->socket.set_option(tcp::no_delay(true), ec);
  transport::AuthenticateToServer(impl_->io, impl_->socket, token, kService, rank, impl_->where,
                                  deadline);
}

GroupSchedulerClient::~GroupSchedulerClient() = default;

GroupDecision GroupSchedulerClient::Request(int stage, int64_t step, Deadline deadline,
                                            bool last, bool leaving) {
  Impl& c = *impl_;
  if (c.failed) Throw(ErrorCode::kAborted, "rank {}: {}", c.rank, c.failure);
  sdpipe::GroupRequest request;
  request.set_protocol_version(transport::kProtocolVersion);
  request.set_rank(c.rank);
  request.set_world_size(c.world_size);
  request.set_stage(stage);
  request.set_step(step);
  request.set_last(last || leaving);
  request.set_leaving(leaving);
  const double budget_s = deadline.remaining_s();
  sdpipe::GroupReply reply;
  std::exception_ptr write_error, read_error;
  bool written = false, read = false;
  transport::AsyncWriteMessage(c.socket, request, [&](std::exception_ptr e) {
    write_error = e;
    written = true;
  });
  transport::AsyncReadMessage(c.socket, &reply, c.where, [&](std::exception_ptr e) {
    read_error = e;
    read = true;
  });
  const bool ok = transport::RunUntil(c.io, &read, deadline);
  if (!ok) {
    c.failed = true;
    c.failure = fmt::format("waited {:.1f} s for its group (step {}) from {}", budget_s, step,
                            c.where);
    boost::system::error_code ignored;
    c.socket.close(ignored);
    c.io.poll();
    Throw(ErrorCode::kDeadlineExceeded,
          "rank {}: no group from {} for step {} within {:.1f} s (is a rank stuck?)", c.rank,
          c.where, step, budget_s);
  }
  if (read_error) {
    c.failed = true;
    try {
      std::rethrow_exception(read_error);
    } catch (const Error& e) {
      c.failure = fmt::format("lost {}: {}", c.where, e.what());
    }
    Throw(ErrorCode::kUnavailable, "rank {}: {} (did rank 0 fail?)", c.rank, c.failure);
  }
  (void)written;
  (void)write_error;  // a failed write surfaces as the read's error
  if (!reply.error().empty()) {
    c.failed = true;
    c.failure = fmt::format("{}: {}", c.where, reply.error());
    Throw(ErrorCode::kAborted,
          "rank {}: the job failed: {}", c.rank, c.failure);
  }
  GroupDecision d;
  d.members.assign(reply.members().begin(), reply.members().end());
  d.round = reply.round();
  d.kind = static_cast<RoundKind>(reply.kind());
  d.epoch_end = reply.epoch_end();
  d.epoch = reply.epoch();
  d.stop = reply.stop();
  d.evaluate = reply.evaluate();
  d.updates = reply.updates();
  // Wire input: the members must be a sorted set of valid ranks containing this one.
  bool valid = !d.members.empty() && reply.kind() >= 0 && reply.kind() <= 2;
  bool self = false;
  for (size_t i = 0; i < d.members.size() && valid; ++i) {
    valid = d.members[i] >= 0 && d.members[i] < c.world_size &&
            (i == 0 || d.members[i] > d.members[i - 1]);
    self = self || d.members[i] == c.rank;
  }
  if (!valid || !self) {
    c.failed = true;
    c.failure = fmt::format("{} answered step {} with the group [{}] (kind {}): expected a sorted "
                            "set of ranks in [0, {}) that contains rank {}",
                            c.where, step, fmt::join(d.members, ", "), reply.kind(),
                            c.world_size, c.rank);
    Throw(ErrorCode::kDataLoss, "rank {}: {}", c.rank, c.failure);
  }
  return d;
}

}  // namespace pipesgd::train
