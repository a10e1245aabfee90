// The job's failure relay: after the rendezvous its connections stay open for the life of the
// job (rank 0 to every rank, a star), so that every rank names the same failed rank, whatever
// the phase (ring set-up, first collective, steady state, shutdown) and whoever noticed first.
//
// Rank 0 decides: the first rank whose relay connection closes without a goodbye (its process
// died: the kernel closes the socket) is the failed rank. Otherwise the reports decide: each
// blames a rank (Error::culprit(), else the reporter itself); rank 0 holds them kDeathWindowS
// (kStallWindowS when the first is a timeout) and follows the blame from the first report to a
// rank that blames itself, died, or is silent (neither reported nor ended: stopped or hung, the
// case where every rank around it times out at once); a rank that blames itself and is the one
// the first report blames decides at once. Rank 0 sends the verdict to every rank; a rank whose
// connection to rank 0 closes without a goodbye, or whose report rank 0 does not answer within
// kReportWaitS, takes rank 0 as the failed rank. A rank that fails before the rendezvous has given it
// a relay reports through a last rendezvous hello instead (rank 0 then fails the rendezvous for
// everyone, naming it).
//
// One thread per relay (its own io_context); Report and Goodbye may be called from any thread.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/base/error.h"
#include "transport/rendezvous.h"

namespace pipesgd::transport {

class FailureRelay {
 public:
  static constexpr double kDeathWindowS = 0.25;
  static constexpr double kStallWindowS = 1.0;
  // How long Report waits for rank 0's verdict; past it, a silent rank 0 is the failed rank.
  static constexpr double kReportWaitS = 2.5;

  struct Verdict {
    int rank = -1;       // the rank the job failed because of
    std::string reason;  // what it reported, or what rank 0 saw
  };

  // `rendezvous` says where rank 0 is (and the token) for a report made before Attach.
  explicit FailureRelay(RendezvousOptions rendezvous);
  ~FailureRelay();  // closes without a goodbye unless Goodbye() was called
  FailureRelay(const FailureRelay&) = delete;
  FailureRelay& operator=(const FailureRelay&) = delete;

  // Called once by the rendezvous with its open connections (native socket handles): on rank 0
  // fds[r] for r in [1, world size) (fds[0] unused), on other ranks fds[0] to rank 0. Takes
  // ownership and starts the relay's thread.
  void Attach(std::vector<int> fds);
  bool attached() const;
  // The rendezvous answered this rank (with the job or with why it failed): rank 0 knows of
  // this rank, so a failure before Attach needs no report through the rendezvous.
  void NoteRendezvousAnswered();

  // This rank is failing with `error`: tells the job (rank 0 decides) and waits at most `wait_s`
  // for the verdict. Returns it, or a verdict blaming error.culprit() (else this rank) when
  // none came in time. Idempotent: a second call returns the first verdict.
  Verdict Report(const Error& error, double wait_s = kReportWaitS);

  // The job ended normally here: tells rank 0 (or, on rank 0, every rank) that the coming end
  // of the connection is no failure. Does not wait.
  void Goodbye();

  // The verdict, if one has been reached (by this rank or received from rank 0).
  std::optional<Verdict> verdict() const;

  // The final error to report for a rank that failed with `error`: `error` itself when the
  // verdict blames this rank, else "rank R: the job failed because of rank V: <reason> (this
  // rank's own error: ...)" (same code, culprit = V).
  static Error Explain(const Error& error, int rank, const Verdict& verdict);

  // The words Explain names the failed rank with ("the job failed because of rank V: "), and
  // the rank the last of them in `text` names (-1: none): `pipesgd run` reads a failed rank's
  // verdict from its stderr with the same format that wrote it.
  static std::string BecauseOf(int failed_rank);
  static int BlamedRankIn(std::string_view text);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pipesgd::transport
