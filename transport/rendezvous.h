// Rendezvous: how the ranks of a job find each other, torchrun-style. Rank 0 listens at
// MASTER_ADDR:MASTER_PORT; every other rank dials it (retrying until the start-up deadline, so
// processes may start in any order), proves the job token (transport/auth.h: the token never
// travels, and nothing of the job is sent before rank 0 has proved it too), sends a
// wire::RendezvousHello with its rank, world size and transport address, and gets back every
// rank's address (wire::RendezvousReply).
//
// With a job token (RendezvousOptions::token) rank 0 turns away any connection that cannot
// prove it, without failing the job. Among authenticated ranks, rank 0 rejects, and fails the
// whole job with an error naming the culprit, sent to every rank: a rank outside
// [1, world_size), a rank that joins twice, a different world size, a different protocol
// version, a different job description (RendezvousOptions::job), a rank that reports it failed
// before joining (ReportFailureToRendezvous), a rank whose connection closes before the answer,
// a job that spans hosts while some rank's data address is loopback (named with the fix). On
// its deadline rank 0 names the ranks that never arrived, and tells every waiting rank, which
// waits up to kReasonWaitS past its own deadline for that reason. Connections that are not
// pipesgd peers (bad magic, oversized or unparsable frames) are logged and dropped without
// disturbing the job.
// Rank 0 stops listening as soon as every rank has arrived (before answering), so rendezvous
// may follow one another on the same port. A MASTER_ADDR that resolves to loopback on rank 0's
// host while not written as loopback (Debian's `127.0.1.1 hostname` line) is listened for on
// every interface, so remote ranks reach it and the loopback check can explain what is wrong.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/base/deadline.h"

namespace pipesgd::transport {

// True if `ip` is a loopback address (127.0.0.0/8, ::1, ::ffff:127.0.0.0/104); false for a name
// or a malformed one.
bool IsLoopbackIp(const std::string& ip);

class FailureRelay;

// How long a rank waits past its own deadline for rank 0's reason (rank 0 may have started a
// little later, and fails on its own deadline naming the missing ranks).
inline constexpr double kReasonWaitS = 1.0;

struct RendezvousOptions {
  RendezvousOptions() = default;
  // The fields every caller sets; data_host and relay are optional extras.
  RendezvousOptions(std::string master_addr_, uint16_t master_port_, int rank_, int world_size_,
                    std::string job_, std::string token_)
      : master_addr(std::move(master_addr_)),
        master_port(master_port_),
        rank(rank_),
        world_size(world_size_),
        job(std::move(job_)),
        token(std::move(token_)) {}

  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  int rank = 0;
  int world_size = 1;
  // Must be identical on every rank (opaque text, compared byte for byte, e.g. the effective
  // config); a rank whose description differs is rejected with the first differing line of each.
  std::string job;
  // The job's secret (PIPESGD_JOB_TOKEN). On rank 0: when non-empty, a hello that does not carry
  // the same token is refused and logged (a warning naming where it came from) and the
  // rendezvous goes on without it; it cannot fail or join the job. Empty: any hello is heard
  // (a job started by hand). On other ranks: sent in the hello.
  std::string token;
  // The IP address this rank's transport uses (for the loopback check); empty: not checked.
  std::string data_host;
  // If set and not yet attached: on success the rendezvous connections become this job's
  // failure relay (transport/failure_relay.h) instead of closing.
  FailureRelay* relay = nullptr;
};

// "rank 0 at lab0:29500 (10.0.0.1)": the rendezvous address with what it resolves to here.
std::string DescribeMaster(const std::string& master_addr, uint16_t port);

// The first line where `theirs` differs from `ours`, with its enclosing "section {" lines, as
// "<context>: rank A has `...`, rank B has `...`". For error messages.
std::string DescribeJobDifference(const std::string& theirs, int their_rank,
                                  const std::string& ours, int our_rank);
// The same with any two names for the sides ("the checkpoint", "this job").
std::string DescribeJobDifference(const std::string& theirs, const std::string& their_label,
                                  const std::string& ours, const std::string& our_label);

// Every rank calls this once with its own `address`; returns all ranks' addresses (index =
// rank), identical on every rank. Blocks until all ranks have arrived or the deadline passes.
// Throws Error: kDeadlineExceeded (rank 0: naming the missing ranks; others: naming the master),
// kInvalidArgument (the job is misconfigured, e.g. a duplicate rank or a world size mismatch;
// the message comes from rank 0 and names the rank; also when rank 0 refused this process
// because its job token is missing or differs), kIo (rank 0 cannot listen on the port),
// kUnavailable (rank 0 went away mid-rendezvous).
std::vector<std::string> RendezvousAllGather(const RendezvousOptions& options,
                                             const std::string& address, Deadline deadline);

// A rank that fails before it could join tells rank 0 why (authenticated like a hello); rank 0
// fails the rendezvous for every rank, naming it. Best effort within `deadline` (rank 0 may be
// gone or not listening yet); never throws. Does nothing on rank 0 or for a world of one.
void ReportFailureToRendezvous(const RendezvousOptions& options, const std::string& failure,
                               Deadline deadline);

// Why a job cannot run over loopback, or empty: `ranks_data_host[r]` is rank r's data address,
// `remote[r]` whether rank r connected to rank 0 from another host (rank 0: false). A job with
// a remote rank and a rank whose data address is loopback cannot connect its ring.
// `master_addr`/`master_resolved` explain rank 0's case.
std::string LoopbackProblem(const std::vector<std::string>& ranks_data_host,
                            const std::vector<std::string>& ranks_from,
                            const std::vector<bool>& remote, const std::string& master_addr,
                            const std::string& master_resolved);

}  // namespace pipesgd::transport
