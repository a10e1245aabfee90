// `pipesgd worker`: one rank of a job, the composition root that wires config, data, model,
// transport, rendezvous, communicator and trainer together and runs the epochs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <memory>

#include "configs/pipesgd.pb.h"
#include "core/base/deadline.h"
#include "core/collective/ring_allreduce.h"
#include "transport/failure_relay.h"
#include "transport/launch_env.h"

namespace pipesgd::job {

// The exit status of a worker that failed because of another rank (the job's failure relay
// blamed that rank): `pipesgd run` reports a rank that failed on its own instead.
inline constexpr int kExitBecauseOfAnotherRank = 3;

// Throws Error(kInvalidArgument) when `dir` holds a finished run (its summary.json) and
// `replace` is false, naming when that run started and how to replace it or go elsewhere.
void CheckOutDirIsFree(const std::string& dir, bool replace);

// --timeline-first-step auto: the window starts at the run's first steady step.
inline constexpr int64_t kTimelineFirstStepAuto = -1;

struct WorkerArgs {
  std::string config_path;
  std::vector<std::string> overrides;  // "path=value", as for --set
  std::string out_dir;                 // rank 0 writes metrics.jsonl and summary.json here
  bool verbose = false;
  bool resume = false;                 // continue from the newest checkpoint in checkpoint.dir
  bool overwrite = false;              // --out may replace a finished run
  // Chrome trace-event JSON of this rank's compute and communication spans (core/base/timeline.h):
  // rank R of N > 1 writes timeline::RankFile(timeline, R, N); empty: no timeline.
  std::string timeline;
  // The window of steps recorded; kTimelineFirstStepAuto: from the run's first steady step
  // (after train.sync_warmup_steps; detail::TimelineFirstStep).
  int64_t timeline_first_step = kTimelineFirstStepAuto;
  int64_t timeline_steps = 20;
};

// Where this rank sits in the job, from its launcher's environment (transport/launch_env.h:
// RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK as torchrun and `pipesgd run` set them,
// Slurm's srun, Open MPI's mpirun). With none of them the job is a single process. Plus
// pipesgd's own: PIPESGD_JOB_TOKEN (the job's secret for the rendezvous; unset:
// unauthenticated) and PIPESGD_HOST (the host's name in the launcher's host list, for
// messages; default: this machine's hostname).
struct JobEnv {
  transport::Launcher launcher = transport::Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // picks the GPU when model.gpu_index is -1
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  std::string job_token;
  std::string host;
  // The job's failure relay (transport/failure_relay.h): the first rendezvous attaches its
  // connections; RunWorker reports a failure through it so that every rank names the same
  // failed rank. Null for a single process.
  std::shared_ptr<transport::FailureRelay> relay;
};

// What every rank of a job must agree on, compared at rendezvous: the program version and the
// effective config, except the data paths and comm.network_interface (they may differ from
// machine to machine).
// The communicator options of job.comm (chunking, streams, codec, error feedback), for every
// mode and for the collectives benchmark.
collective::CommunicatorOptions CommunicatorOptionsFromConfig(const config::Job& job);

std::string JobDescription(const config::Job& job);

// Creates the transport comm.transport names (AUTO: transport::ChooseAutoTransport, logged on
// every rank with its reason), on the network interface comm.network_interface or
// PIPESGD_SOCKET_IFNAME admits (transport/ifname.h; logged on every rank: "rank 2 on lab2:
// transport tcp, interface eth0, address 10.0.0.3"), publishes its
// address, meets the other ranks at the rendezvous (all must pass the same `job` text; the
// resolved transport is appended to it, so ranks that resolved AUTO differently are rejected by
// name; env.job_token authenticates) and connects the ring, all within `deadline`. A deadline error names `timeout_setting`
// (e.g. "comm.start_timeout_s = 60 s"). Throws what transport::CreateTransport,
// RendezvousAllGather and Communicator::Create throw, and kInvalidArgument for an interface
// filter that admits no interface.
// The first half of ConnectRing: the transport, created for `peers` (the ranks it will connect
// to; ibverbs needs them up front) with `streams` connections per peer, and every rank's
// address from the rendezvous. Nothing is connected yet.
struct ConnectedTransport {
  std::unique_ptr<transport::Transport> transport;
  std::vector<std::string> addresses;  // index = rank
  std::string bind_host;               // tcp: the address this rank listens on
  // The address of the interface the job's data travels on (tcp, ucx with a device filter);
  // empty where the transport chooses (rdma, ucx without a filter).
  std::string data_address;
};
// ConnectTransport's first half, without the rendezvous (`addresses` stays empty): for callers
// that exchange the addresses another way (the PyTorch backend, through torch's Store). Logs the
// "rank R on HOST: transport ..." line. Throws what transport::CreateTransport throws, and
// kInvalidArgument for an interface filter that admits no interface.
ConnectedTransport CreateJobTransport(const JobEnv& env, int streams, const config::Comm& comm,
                                      const std::vector<int>& peers);
ConnectedTransport ConnectTransport(const JobEnv& env, const std::string& job, int streams,
                                    const config::Comm& comm, const std::vector<int>& peers,
                                    Deadline deadline, const std::string& timeout_setting);

std::unique_ptr<collective::Communicator> ConnectRing(const JobEnv& env, const std::string& job,
                                                      const collective::CommunicatorOptions& options,
                                                      const config::Comm& comm, Deadline deadline,
                                                      const std::string& timeout_setting);

// A transport connected to `peers` (ranks other than env.rank), one connection each, in the
// order of `peers`; the same set-up, rendezvous and errors as ConnectRing (the parameter-server
// schemes and `pipesgd probe` use it for star and neighbour links).
struct PeerLinks {
  // Declared in this order so that the connections are destroyed before their transport.
  std::unique_ptr<transport::Transport> transport;
  std::vector<std::unique_ptr<transport::Connection>> connections;
  std::string data_address;  // ConnectedTransport's
};
PeerLinks ConnectPeers(const JobEnv& env, const std::string& job, const std::vector<int>& peers,
                       const config::Comm& comm, Deadline deadline,
                       const std::string& timeout_setting);

// Reads and checks the variables. Throws Error kInvalidArgument naming the variable, its value
// and what was expected.
JobEnv ReadJobEnv();

// Runs the rank to completion. Throws pipesgd::Error on any failure (the caller prints it and
// exits non-zero).
void RunWorker(const WorkerArgs& args);

// For `pipesgd run -np N` before it starts a rank: with model.device = CUDA, this machine must
// have the GPU of each of its `local_ranks` ranks (model.gpu_index, else the local rank).
// Throws Error(kInvalidArgument) naming model.device and the devices found. No-op otherwise,
// and in a build without the CUDA backend (config validation refuses CUDA there).
void CheckLocalGpus(const config::Job& job, int local_ranks);

}  // namespace pipesgd::job
