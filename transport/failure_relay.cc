#include "transport/failure_relay.h"

#include <unistd.h>

#include <chrono>
#include <functional>
#include <future>

#include "transport/asio.h"

#include "core/base/check.h"
#include "core/base/log.h"
#include "transport/message_io.h"
#include "transport/wire.pb.h"

namespace pipesgd::transport {

namespace asio = boost::asio;
using asio::ip::tcp;

struct FailureRelay::Impl {
  struct Peer {
    int rank = -1;
    std::unique_ptr<tcp::socket> socket;
    bool ended = false;  // said goodbye, or its connection ended
    wire::RelayNotice in;
  };

  explicit Impl(RendezvousOptions r) : rdv(std::move(r)), timer(io) {}

  RendezvousOptions rdv;
  asio::io_context io;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::thread thread;
  std::vector<std::unique_ptr<Peer>> peers;  // rank 0: every other rank; others: rank 0
  asio::steady_timer timer;
  std::optional<Verdict> pending;  // rank 0: a report waiting kDeathWindowS for a death
  int writes_in_flight = 0;        // io thread only
  bool closing = false;            // io thread only: our own end, not a failure

  mutable std::mutex mu;
  std::condition_variable cv;
  std::optional<Verdict> verdict;  // guarded by mu
  bool attached = false;           // guarded by mu
  bool said_goodbye = false;       // guarded by mu
  bool answered = false;           // guarded by mu: the rendezvous answered this rank
  std::optional<Verdict> reported;  // guarded by mu: what Report returned

  bool lead() const { return rdv.rank == 0; }

  void Write(Peer& peer, const wire::RelayNotice& notice) {
    if (peer.ended || !peer.socket->is_open()) return;
    ++writes_in_flight;
    AsyncWriteMessage(*peer.socket, notice, [this](std::exception_ptr) { --writes_in_flight; });
  }

  void Read(Peer& peer) {
    AsyncReadMessage(*peer.socket, &peer.in, fmt::format("rank {}", peer.rank),
                     [this, &peer](std::exception_ptr error) {
                       if (error) return OnEnd(peer);
                       OnNotice(peer, peer.in);
                       if (!peer.ended) Read(peer);
                     });
  }

  void OnNotice(Peer& peer, const wire::RelayNotice& notice) {
    if (notice.goodbye()) {
      peer.ended = true;
      return;
    }
    if (lead()) {
      Consider({notice.failed_rank(), notice.reason()}, peer.rank, /*death=*/false);
    } else {
      SetVerdict({notice.failed_rank(), notice.reason()});
    }
  }

  void OnEnd(Peer& peer) {
    if (peer.ended || closing) return;
    peer.ended = true;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (said_goodbye) return;
    }
    if (lead()) {
      Consider({peer.rank,
                fmt::format("rank {} exited without reporting an error: its connection to rank 0 "
                            "closed without a goodbye (killed, crashed, or its host went away)",
                            peer.rank)},
               peer.rank, /*death=*/true);
    } else {
      SetVerdict({0, "rank 0 is gone: its connection to this rank closed without a goodbye "
                     "(killed, crashed, or its host went away)"});
    }
  }

  // Rank 0 only. A death decides at once; a report waits kDeathWindowS for a death, and is
  // replaced by the blamed rank's own report if that comes meanwhile (it says why).
  void Consider(Verdict v, int reporter, bool death) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (verdict) return;
    }
    if (death) return Decide(std::move(v));
    if (pending && reporter == pending->rank && v.rank == reporter) return Decide(std::move(v));
    if (pending) return;
    pending = std::move(v);
    timer.expires_after(std::chrono::milliseconds(static_cast<int>(kDeathWindowS * 1000)));
    timer.async_wait([this](const boost::system::error_code& ec) {
      if (!ec && pending) Decide(*pending);
    });
  }

  void Decide(Verdict v) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (verdict) return;
      verdict = v;
    }
    cv.notify_all();
    wire::RelayNotice notice;
    notice.set_failed_rank(v.rank);
    notice.set_reason(v.reason);
    notice.set_reporter(0);
    for (auto& p : peers) Write(*p, notice);
  }

  void SetVerdict(Verdict v) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (verdict) return;
      verdict = std::move(v);
    }
    cv.notify_all();
  }
};

FailureRelay::FailureRelay(RendezvousOptions rendezvous)
    : impl_(std::make_unique<Impl>(std::move(rendezvous))) {
  impl_->rdv.relay = nullptr;
}

FailureRelay::~FailureRelay() {
  Impl& m = *impl_;
  if (!m.thread.joinable()) return;
  // Let goodbyes and verdicts already posted go out (bounded), then end our side.
  std::promise<void> flushed;
  auto flushed_future = flushed.get_future();
  asio::post(m.io, [&m, &flushed] {
    auto deadline = std::make_shared<Deadline>(Deadline::After(0.5));
    auto check = std::make_shared<std::function<void()>>();
    auto timer = std::make_shared<asio::steady_timer>(m.io);
    *check = [&m, &flushed, deadline, check, timer] {
      if (m.writes_in_flight == 0 || deadline->expired()) {
        m.closing = true;
        m.timer.cancel();
        for (auto& p : m.peers) {
          boost::system::error_code ignored;
          p->socket->close(ignored);
        }
        flushed.set_value();
        *check = nullptr;  // break the cycle
        return;
      }
      timer->expires_after(std::chrono::milliseconds(5));
      timer->async_wait([check](const boost::system::error_code&) {
        if (*check) (*check)();
      });
    };
    (*check)();
  });
  flushed_future.wait_for(std::chrono::seconds(2));
  m.work.reset();
  m.io.stop();
  m.thread.join();
}

void FailureRelay::Attach(std::vector<int> fds) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    PSGD_CHECK(!m.attached);
    m.attached = true;
  }
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i] < 0) continue;
    auto peer = std::make_unique<Impl::Peer>();
    peer->rank = m.lead() ? static_cast<int>(i) : 0;
    peer->socket = std::make_unique<tcp::socket>(m.io);
    boost::system::error_code ec;
    peer->socket->assign(tcp::v4(), fds[i], ec);
    if (ec) {
      ::close(fds[i]);
      PSGD_LOG_WARN("rank {}: the failure relay could not take the connection to rank {}: {}",
                    m.rdv.rank, peer->rank, ec.message());
      continue;
    }
    m.peers.push_back(std::move(peer));
  }
  m.work.emplace(m.io.get_executor());
  for (auto& p : m.peers) asio::post(m.io, [&m, peer = p.get()] { m.Read(*peer); });
  m.thread = std::thread([&m] { m.io.run(); });
}

void FailureRelay::NoteRendezvousAnswered() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->answered = true;
}

bool FailureRelay::attached() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->attached;
}

FailureRelay::Verdict FailureRelay::Report(const Error& error, double wait_s) {
  Impl& m = *impl_;
  const int self = m.rdv.rank;
  const Verdict own{error.culprit() >= 0 ? error.culprit() : self, error.what()};
  bool attached = false, answered = false;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.reported) return *m.reported;
    attached = m.attached;
    answered = m.answered;
  }
  if (!attached) {
    // No relay yet: the rendezvous is where rank 0 is listening, if it still is. A failure
    // blamed on another rank came from rank 0 or is about it, and one the rendezvous answered
    // is known there: rank 0 knows, or is gone.
    if (own.rank == self && !answered) {
      ReportFailureToRendezvous(m.rdv, error.what(), Deadline::After(wait_s));
    }
    std::lock_guard<std::mutex> lock(m.mu);
    m.reported = own;
    return own;
  }
  asio::post(m.io, [&m, own, self] {
    if (m.lead()) return m.Consider(own, self, /*death=*/false);
    wire::RelayNotice notice;
    notice.set_failed_rank(own.rank);
    notice.set_reason(own.reason);
    notice.set_reporter(self);
    for (auto& p : m.peers) m.Write(*p, notice);
  });
  std::unique_lock<std::mutex> lock(m.mu);
  m.cv.wait_for(lock, std::chrono::duration<double>(wait_s), [&] { return m.verdict.has_value(); });
  m.reported = m.verdict ? *m.verdict : own;
  return *m.reported;
}

void FailureRelay::Goodbye() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (!m.attached || m.said_goodbye) return;
    m.said_goodbye = true;
  }
  asio::post(m.io, [&m] {
    wire::RelayNotice notice;
    notice.set_goodbye(true);
    notice.set_reporter(m.rdv.rank);
    for (auto& p : m.peers) m.Write(*p, notice);
  });
}

std::optional<FailureRelay::Verdict> FailureRelay::verdict() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->verdict;
}

Error FailureRelay::Explain(const Error& error, int rank, const Verdict& verdict) {
  if (verdict.rank == rank || verdict.rank < 0) return error;
  const std::string text =
      verdict.reason == error.what()
          ? fmt::format("rank {}: the job failed because of rank {}: {}", rank, verdict.rank,
                        error.what())
          : fmt::format("rank {}: the job failed because of rank {}: {} (this rank's own "
                        "error: {})",
                        rank, verdict.rank, verdict.reason, error.what());
  Error explained(error.code(), text);
  return explained.set_culprit(verdict.rank);
}

}  // namespace pipesgd::transport
