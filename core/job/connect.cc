// A rank's place and its connections, for every mode (core/job/worker.h): the job's
// environment, the transport chosen and made, the rendezvous, the ring or the peer links.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/base/error.h"
#include "core/base/log.h"
#include "core/job/config.h"
#include "core/job/fault.h"
#include "core/job/worker.h"
#include "core/job/worker_detail.h"
#include "transport/factory.h"
#include "transport/ifname.h"
#include "transport/launch_env.h"
#include "transport/message_io.h"
#include "transport/rendezvous.h"

namespace pipesgd::job {

std::string JobDescription(const config::Job& job) {
  config::Job copy = job;
  // FormatConfig puts back the schema defaults, the same on every rank.
  copy.mutable_data()->clear_train_images();
  copy.mutable_data()->clear_train_labels();
  copy.mutable_data()->clear_test_images();
  copy.mutable_data()->clear_test_labels();
  // Machine-local: interface and RDMA device names may differ from host to host.
  copy.mutable_comm()->clear_network_interface();
  copy.mutable_comm()->clear_ib_device();
  copy.mutable_comm()->clear_ib_port();
  copy.mutable_comm()->clear_gid_index();
  return "pipesgd " PIPESGD_VERSION "\n" + FormatConfig(copy);
}

transport::TransportKind ResolveTransport(const config::Comm& comm, int rank) {
  switch (comm.transport()) {
    case config::TCP:
      return transport::TransportKind::kTcp;
    case config::UCX:
      return transport::TransportKind::kUcx;
    case config::IBVERBS:
      return transport::TransportKind::kIbverbs;
    case config::AUTO: {
      const transport::AutoChoice choice = transport::ChooseAutoTransport();
      PSGD_LOG_INFO("rank {}: comm.transport = AUTO chose {}: {}", rank,
                    transport::TransportKindName(choice.kind), choice.reason);
      return choice.kind;
    }
  }
  Throw(ErrorCode::kInvalidArgument, "comm.transport = {}: unknown", static_cast<int>(comm.transport()));
}

Error detail::WithTimeoutSetting(const Error& e, const std::string& timeout_setting) {
  Error out(e.code(), fmt::format("{} ({})", e.what(), timeout_setting));
  return out.set_culprit(e.culprit());
}

ConnectedTransport CreateJobTransport(const JobEnv& env, int streams, const config::Comm& comm,
                                      const std::vector<int>& peers) {
  transport::TransportOptions topt;
  topt.kind = ResolveTransport(comm, env.rank);
  topt.rank = env.rank;
  topt.world_size = env.world_size;
  const std::string_view kind_name = transport::TransportKindName(topt.kind);

  // The interface filter: the config field, else the environment variable.
  std::optional<transport::IfnameFilter> filter;
  std::string source;
  if (!comm.network_interface().empty()) {
    source = "comm.network_interface";
    filter = transport::ParseIfnameFilter(comm.network_interface(), source);
  } else if (const char* v = std::getenv("PIPESGD_SOCKET_IFNAME"); v && *v) {
    source = "PIPESGD_SOCKET_IFNAME";
    filter = transport::ParseIfnameFilter(v, source);
  }
  std::string iface_name = env.world_size == 1 ? "lo" : "";
  std::string iface_address = env.world_size == 1 ? "127.0.0.1" : "";
  const bool tcp = topt.kind == transport::TransportKind::kTcp;
  const bool ucx_devices = topt.kind == transport::TransportKind::kUcx && filter &&
                           !std::getenv("UCX_NET_DEVICES");
  if (env.world_size > 1 && (tcp || ucx_devices)) {
    const transport::InterfaceChoice choice =
        transport::ChooseLocalInterface(filter, source, env.master_addr, env.master_port);
    iface_name = choice.iface.name;
    iface_address = choice.iface.ip;
    // Why this interface: -v (the "rank R on HOST" line below names it on every console).
    if (tcp) {
      topt.bind_host = choice.iface.ip;
      PSGD_LOG_DEBUG("rank {}: tcp on {} {} ({})", env.rank, choice.iface.name, choice.iface.ip,
                     choice.reason);
    } else {
      topt.ucx_net_devices = choice.iface.name;
      PSGD_LOG_DEBUG("rank {}: ucx NET_DEVICES={} ({}; set UCX_NET_DEVICES to override)",
                     env.rank, choice.iface.name, choice.reason);
    }
  }
  // One line per rank naming host, transport and interface (the ssh launcher's tests read it).
  PSGD_LOG_INFO("rank {} on {}: transport {}{}{}", env.rank, env.host, kind_name,
                iface_name.empty()
                    ? ""
                    : fmt::format(", interface {}, address {}", iface_name, iface_address),
                source.empty() ? "" : fmt::format(" ({} = {})", source, filter->ToString()));
  topt.peers = peers;
  topt.streams = streams;
  topt.ib_device = comm.ib_device();
  topt.ib_port = comm.ib_port();
  topt.gid_index = comm.gid_index();
  topt.ib_ack_timeout = comm.ib_timeout();
  topt.ib_retry_count = comm.ib_retry_count();
  return {transport::CreateTransport(topt), {}, topt.bind_host, iface_address};
}

ConnectedTransport ConnectTransport(const JobEnv& env, const std::string& job, int streams,
                                    const config::Comm& comm, const std::vector<int>& peers,
                                    Deadline deadline, const std::string& timeout_setting) {
  ConnectedTransport made = CreateJobTransport(env, streams, comm, peers);
  // The resolved transport is part of the job: ranks whose `auto` resolved differently (one host
  // with RDMA, one without) are rejected at rendezvous by name.
  transport::RendezvousOptions rdv{env.master_addr, env.master_port, env.rank, env.world_size,
                                   fmt::format("{}resolved transport: {}\n", job,
                                               made.transport->name()),
                                   env.job_token};
  rdv.data_host = made.data_address;
  rdv.relay = env.relay.get();
  MaybeInjectFault(env.rank, "rendezvous");
  try {
    made.addresses = transport::RendezvousAllGather(rdv, made.transport->LocalAddress(), deadline);
    return made;
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kDeadlineExceeded) throw;
    throw detail::WithTimeoutSetting(e, timeout_setting);
  }
}

std::unique_ptr<collective::Communicator> ConnectRing(const JobEnv& env, const std::string& job,
                                                      const collective::CommunicatorOptions& options,
                                                      const config::Comm& comm, Deadline deadline,
                                                      const std::string& timeout_setting) {
  ConnectedTransport t =
      ConnectTransport(env, job, options.streams, comm,
                       collective::Communicator::RingPeers(env.rank, env.world_size), deadline,
                       timeout_setting);
  MaybeInjectFault(env.rank, "ring_setup");
  try {
    return collective::Communicator::Create(std::move(t.transport), env.world_size, t.addresses,
                                            options, deadline);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kDeadlineExceeded) throw;
    throw detail::WithTimeoutSetting(e, timeout_setting);
  }
}

PeerLinks ConnectPeers(const JobEnv& env, const std::string& job, const std::vector<int>& peers,
                       const config::Comm& comm, Deadline deadline,
                       const std::string& timeout_setting) {
  PeerLinks links;
  auto [transport, addresses, bind_host, data_address] =
      ConnectTransport(env, job, 1, comm, peers, deadline, timeout_setting);
  std::vector<std::pair<int, std::string>> targets;
  for (int p : peers) targets.emplace_back(p, addresses.at(p));
  try {
    links.connections = transport->Connect(targets, deadline, 1);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kDeadlineExceeded) throw;
    throw detail::WithTimeoutSetting(e, timeout_setting);
  }
  links.transport = std::move(transport);
  links.data_address = data_address;
  return links;
}

JobEnv ReadJobEnv() {
  JobEnv env;
  if (const char* token = std::getenv("PIPESGD_JOB_TOKEN"); token) env.job_token = token;
  env.host = transport::RankHost();
  const transport::LaunchEnv launch = transport::ReadLaunchEnv();
  if (launch.launcher == transport::Launcher::kNone) return env;  // a single process
  env.launcher = launch.launcher;
  env.rank = launch.rank;
  env.world_size = launch.world_size;
  env.local_rank = launch.local_rank;
  env.master_addr = launch.master_addr;
  env.master_port = launch.master_port;
  if (launch.launcher != transport::Launcher::kEnv && env.rank == 0) {
    PSGD_LOG_INFO("rank {} of {} from {}'s environment; rendezvous {}:{} ({})",
                  env.rank, env.world_size, transport::ToString(launch.launcher),
                  env.master_addr, env.master_port, launch.master_from);
  }
  if (env.world_size > 1) {
    env.relay = std::make_shared<transport::FailureRelay>(transport::RendezvousOptions{
        env.master_addr, env.master_port, env.rank, env.world_size, "", env.job_token});
  }
  return env;
}

collective::CommunicatorOptions CommunicatorOptionsFromConfig(const config::Job& job) {
  static_assert(static_cast<int>(CodecKind::kTrunc16) == config::Comm::trunc16 &&
                static_cast<int>(CodecKind::kFp16) == config::Comm::fp16 &&
                static_cast<int>(CodecKind::kQ8) == config::Comm::q8 &&
                static_cast<int>(CodecKind::kQ4) == config::Comm::q4 &&
                static_cast<int>(CodecKind::kSign1) == config::Comm::sign1 &&
                static_cast<int>(CodecKind::kNone) == config::Comm::none);
  const auto& comm_cfg = job.comm();
  collective::CommunicatorOptions o;
  o.chunk_bytes = static_cast<uint64_t>(comm_cfg.chunk_bytes());
  o.streams = std::max(1, comm_cfg.streams());  // 0 (auto): 1 unless a RING job tunes it
  o.codec.kind = static_cast<CodecKind>(comm_cfg.compression());
  o.codec.round_to_nearest_even = comm_cfg.round_to_nearest_even();
  o.codec.stochastic_rounding = comm_cfg.stochastic_rounding();
  o.codec.seed = job.train().seed();
  o.compression_min_bytes = static_cast<uint64_t>(comm_cfg.min_bytes());
  o.error_feedback = comm_cfg.error_feedback();
  return o;
}

}  // namespace pipesgd::job
