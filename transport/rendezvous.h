// Rendezvous: how the ranks of a job find each other, torchrun-style. Rank 0 listens at
// MASTER_ADDR:MASTER_PORT; every other rank dials it (retrying until the start-up deadline, so
// processes may start in any order), sends a wire::RendezvousHello with its rank, world size
// and transport address, and gets back every rank's address (wire::RendezvousReply).
//
// With a job token (RendezvousOptions::token) rank 0 first turns away any connection that does
// not present it, without failing the job. Among authenticated ranks, rank 0 rejects, and fails
// the whole job with an error naming the culprit: a rank outside
// [1, world_size), a rank that joins twice, a different world size, a different protocol
// version, a different job description (RendezvousOptions::job). Connections that are not pipesgd peers (bad magic, oversized or unparsable frames)
// are logged and dropped without disturbing the job. On timeout rank 0 names the ranks that
// never arrived.
// Rank 0 stops listening as soon as every rank has arrived (before answering), so rendezvous
// may follow one another on the same port.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/base/deadline.h"

namespace pipesgd::transport {

struct RendezvousOptions {
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
};

// The first line where `theirs` differs from `ours`, with its enclosing "section {" lines, as
// "<context>: rank A has `...`, rank B has `...`". For error messages.
std::string DescribeJobDifference(const std::string& theirs, int their_rank,
                                  const std::string& ours, int our_rank);

// Every rank calls this once with its own `address`; returns all ranks' addresses (index =
// rank), identical on every rank. Blocks until all ranks have arrived or the deadline passes.
// Throws Error: kDeadlineExceeded (rank 0: naming the missing ranks; others: naming the master),
// kInvalidArgument (the job is misconfigured, e.g. a duplicate rank or a world size mismatch;
// the message comes from rank 0 and names the rank; also when rank 0 refused this process
// because its job token is missing or differs), kIo (rank 0 cannot listen on the port),
// kUnavailable (rank 0 went away mid-rendezvous).
std::vector<std::string> RendezvousAllGather(const RendezvousOptions& options,
                                             const std::string& address, Deadline deadline);

}  // namespace pipesgd::transport
