#include "pipesgd/pipesgd.h"

#include <cmath>
#include <cstdlib>
#include <utility>

#include "transport/launch_env.h"
#include "transport/message_io.h"
#include "transport/rendezvous.h"

namespace pipesgd {

const char* Version() { return PIPESGD_VERSION_STRING; }

ConnectOptions ConnectOptionsFromEnv() {
  const transport::LaunchEnv env = transport::ReadLaunchEnv();
  ConnectOptions o;
  o.rank = env.rank;
  o.world_size = env.world_size;
  o.master_addr = env.master_addr;
  o.master_port = env.master_port;
  if (const char* token = std::getenv("PIPESGD_JOB_TOKEN"); token != nullptr) o.token = token;
  const bool loopback = o.master_addr == "localhost" || o.master_addr.starts_with("127.");
  o.bind_host = loopback ? "127.0.0.1" : "";
  return o;
}

std::unique_ptr<Communicator> Connect(const ConnectOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    Throw(ErrorCode::kInvalidArgument, "rank {} and world size {}: expected 0 <= rank < world size",
          o.rank, o.world_size);
  }
  if (o.chunk_bytes % 4 != 0) {
    Throw(ErrorCode::kInvalidArgument, "chunk_bytes {}: expected a multiple of 4 (or 0 = auto)",
          o.chunk_bytes);
  }
  if (o.streams < 1) {
    Throw(ErrorCode::kInvalidArgument, "streams {}: expected >= 1", o.streams);
  }
  if (!std::isfinite(o.timeout_s) || o.timeout_s <= 0) {
    Throw(ErrorCode::kInvalidArgument, "timeout_s {}: expected a positive number of seconds",
          o.timeout_s);
  }
  const Deadline deadline = Deadline::After(o.timeout_s);
  transport::TransportOptions t;
  t.kind = o.transport;
  t.rank = o.rank;
  t.world_size = o.world_size;
  t.bind_host = o.bind_host.empty() ? transport::LocalIpToward(o.master_addr, o.master_port)
                                    : o.bind_host;
  t.peers = Communicator::RingPeers(o.rank, o.world_size);
  t.streams = o.streams;
  auto tr = transport::CreateTransport(t);
  transport::RendezvousOptions rdv;
  rdv.master_addr = o.master_addr;
  rdv.master_port = o.master_port;
  rdv.rank = o.rank;
  rdv.world_size = o.world_size;
  rdv.job = o.job;
  rdv.token = o.token;
  auto addresses = transport::RendezvousAllGather(rdv, tr->LocalAddress(), deadline);
  collective::CommunicatorOptions c;
  c.chunk_bytes = o.chunk_bytes;
  c.streams = o.streams;
  c.codec.kind = o.codec;
  c.error_feedback = o.error_feedback;
  c.compression_min_bytes = o.compression_min_bytes;
  return Communicator::Create(std::move(tr), o.world_size, addresses, c, deadline);
}

void AllReduce(Communicator& comm, std::span<float> data, ReduceOp op, double timeout_s,
               bool compress) {
  collective::AllReduceOptions call;
  call.compress = compress;
  comm.AllReduce(data, op, Deadline::After(timeout_s), nullptr, call);
}

std::vector<float> Train(Communicator& comm, train::Objective& objective,
                         train::Optimizer& optimizer, std::span<float> params, int64_t steps,
                         int pipeline_width, double timeout_s) {
  train::TrainerOptions options;
  options.pipeline_width = pipeline_width;
  options.timeout_s = timeout_s;
  train::Trainer trainer(comm, objective, optimizer, params, options);
  for (int64_t t = 0; t < steps; ++t) trainer.Step();
  trainer.Drain(true);
  std::vector<float> losses;
  losses.reserve(steps);
  for (int64_t t = 0; t < steps; ++t) losses.push_back(trainer.StepLoss(t));
  return losses;
}

}  // namespace pipesgd
