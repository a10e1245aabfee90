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

  // What one rank reported (rank 0's view).
  struct Report {
    int blamed = -1;
    std::string reason;
    bool timed_out = false;
  };

  explicit Impl(RendezvousOptions r)
      : rdv(std::move(r)), timer(io), reports(static_cast<size_t>(std::max(rdv.world_size, 1))),
        dead(reports.size(), false), done(reports.size(), false) {}

  RendezvousOptions rdv;
  asio::io_context io;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::thread thread;
  std::vector<std::unique_ptr<Peer>> peers;  // rank 0: every other rank; others: rank 0
  asio::steady_timer timer;
  // Rank 0, io thread only: each rank's report, death and normal end, and the first reporter.
  std::vector<std::optional<Report>> reports;
  std::vector<bool> dead, done;
  int first_reporter = -1;
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
      if (lead() && peer.rank < static_cast<int>(done.size())) done[peer.rank] = true;
      return;
    }
    if (lead()) {
      OnReport(peer.rank, {notice.failed_rank(), notice.reason(), notice.timed_out()});
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
      dead[peer.rank] = true;
      // A death is the strongest evidence: decided at once.
      Decide({peer.rank,
              fmt::format("rank {} exited without reporting an error: its connection to rank 0 "
                          "closed without a goodbye (killed, crashed, or its host went away)",
                          peer.rank)});
    } else {
      SetVerdict({0, "rank 0 is gone: its connection to this rank closed without a goodbye "
                     "(killed, crashed, or its host went away)"});
    }
  }

  bool Valid(int rank) const { return rank >= 0 && rank < static_cast<int>(reports.size()); }

  // Rank 0 only. A report that blames itself decides at once if it is the first report or the
  // rank the first report blames (it says why); otherwise the reports are held for a window
  // (kDeathWindowS, or kStallWindowS when the first report is a timeout: every rank of a ring
  // around a stalled rank times out at about the same moment) and then resolved.
  void OnReport(int reporter, Report report) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (verdict) return;
    }
    if (!Valid(reporter)) return;
    if (!Valid(report.blamed)) report.blamed = reporter;
    reports[reporter] = report;
    const bool self_blamed = report.blamed == reporter;
    if (first_reporter < 0) {
      first_reporter = reporter;
      if (self_blamed) {
        // Still held briefly: a death, if there is one, is the better answer.
        StartTimer(kDeathWindowS);
        return;
      }
      StartTimer(report.timed_out ? kStallWindowS : kDeathWindowS);
      return;
    }
    if (self_blamed && reports[first_reporter]->blamed == reporter) {
      return Decide({reporter, report.reason});
    }
  }

  void StartTimer(double seconds) {
    timer.expires_after(std::chrono::milliseconds(static_cast<int>(seconds * 1000)));
    timer.async_wait([this](const boost::system::error_code& ec) {
      if (!ec) Decide(Resolve());
    });
  }

  // Follows the blame from the first report: rank A blames B, B blames C, ... and stops at a
  // rank that blames itself, died, or is silent (neither reported nor ended: it is stopped or
  // hung, so every wait around it timed out). A cycle falls back to the first report.
  Verdict Resolve() const {
    const Report& first = *reports[first_reporter];
    std::vector<bool> seen(reports.size(), false);
    int cur = first_reporter;
    while (true) {
      seen[cur] = true;
      const Report& r = *reports[cur];
      if (r.blamed == cur) return {cur, r.reason};
      const int next = r.blamed;
      if (dead[next]) {
        return {next, fmt::format("rank {} is gone (its connection to rank 0 closed); rank {} "
                                  "reports: {}",
                                  next, first_reporter, first.reason)};
      }
      if (!reports[next] && !done[next]) {
        return {next, fmt::format("rank {} stopped responding: it has neither reported an error "
                                  "nor exited (stopped or hung?); rank {} reports: {}",
                                  next, first_reporter, first.reason)};
      }
      if (seen[next] || !reports[next]) return {first.blamed, first.reason};
      cur = next;
    }
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
  const bool timed_out = error.code() == ErrorCode::kDeadlineExceeded;
  asio::post(m.io, [&m, own, self, timed_out] {
    if (m.lead()) return m.OnReport(self, {own.rank, own.reason, timed_out});
    wire::RelayNotice notice;
    notice.set_failed_rank(own.rank);
    notice.set_reason(own.reason);
    notice.set_reporter(self);
    notice.set_timed_out(timed_out);
    for (auto& p : m.peers) m.Write(*p, notice);
  });
  std::unique_lock<std::mutex> lock(m.mu);
  m.cv.wait_for(lock, std::chrono::duration<double>(wait_s), [&] { return m.verdict.has_value(); });
  if (m.verdict) {
    m.reported = *m.verdict;
  } else if (!m.lead()) {
    // Rank 0's relay thread answers within its window unless rank 0's whole process is stopped
    // or hung (its connection is open: a death would have been seen).
    m.reported = Verdict{0, fmt::format("rank 0 did not answer this rank's failure report within "
                                        "{:.1f} s while its connection stayed open: its process "
                                        "is stopped or hung",
                                        wait_s)};
  } else {
    m.reported = own;
  }
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

namespace {
constexpr std::string_view kBecauseOf = "the job failed because of rank ";
}  // namespace

std::string FailureRelay::BecauseOf(int failed_rank) {
  return fmt::format("{}{}: ", kBecauseOf, failed_rank);
}

int FailureRelay::BlamedRankIn(std::string_view text) {
  // The last line that has the words; in it, their first place (a relayed reason may quote
  // them again).
  size_t at = text.rfind(kBecauseOf);
  if (at == std::string_view::npos) return -1;
  const size_t line = text.rfind('\n', at);
  at = text.find(kBecauseOf, line == std::string_view::npos ? 0 : line + 1);
  int rank = 0;
  size_t i = at + kBecauseOf.size();
  const size_t digits = i;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9' && rank < 1000000) {
    rank = rank * 10 + (text[i++] - '0');
  }
  return i > digits && i < text.size() && text[i] == ':' ? rank : -1;
}

Error FailureRelay::Explain(const Error& error, int rank, const Verdict& verdict) {
  if (verdict.rank == rank || verdict.rank < 0) return error;
  const std::string text =
      verdict.reason == error.what()
          ? fmt::format("rank {}: {}{}", rank, BecauseOf(verdict.rank), error.what())
          : fmt::format("rank {}: {}{} (this rank's own error: {})", rank,
                        BecauseOf(verdict.rank), verdict.reason, error.what());
  Error explained(error.code(), text);
  return explained.set_culprit(verdict.rank);
}

}  // namespace pipesgd::transport
