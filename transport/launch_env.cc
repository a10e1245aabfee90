#include "transport/launch_env.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include <fmt/format.h>

#include "core/base/error.h"

namespace pipesgd::transport {
namespace {

constexpr long kMaxWorld = 65536;

long ParseInt(const char* name, const char* value, long lo, long hi, const std::string& expected) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || v < lo || v > hi) {
    Throw(ErrorCode::kInvalidArgument, "environment variable {}='{}': expected {}", name, value,
          expected);
  }
  return v;
}

// Reads rank, world size and local rank from three variables; the first must be set.
struct Lookup {
  const EnvLookup& get;
  const char* operator()(const char* name) const {
    const char* v = get(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  }
};

void ReadPosition(const Lookup& get, const char* rank_var, const char* world_var,
                  const char* local_var, LaunchEnv* env) {
  const char* rank = get(rank_var);
  const char* world = get(world_var);
  if (world == nullptr) {
    Throw(ErrorCode::kInvalidArgument,
          "environment: {} is set but {} is not; set both {} and {} (or neither, for a "
          "single process)",
          rank_var, world_var, rank_var, world_var);
  }
  env->world_size = static_cast<int>(
      ParseInt(world_var, world, 1, kMaxWorld, fmt::format("an integer in [1, {}]", kMaxWorld)));
  env->rank = static_cast<int>(ParseInt(rank_var, rank, 0, env->world_size - 1,
                                        fmt::format("an integer in [0, {}={})", world_var,
                                                    env->world_size)));
  if (const char* local = get(local_var); local != nullptr) {
    env->local_rank = static_cast<int>(ParseInt(local_var, local, 0, 1023, "an integer in [0, 1023]"));
  }
}

// "jobid.vpid;tcp://10.0.0.1,10.0.1.1:port;tcp6://[..]:port": mpirun's first IPv4 address.
std::string HnpAddress(const std::string& uri) {
  const size_t tcp = uri.find(";tcp://");
  if (tcp == std::string::npos) return "";
  const size_t begin = tcp + 7;
  const size_t end = uri.find_first_of(",:;", begin);
  return uri.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

}  // namespace

const char* ToString(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone:
      return "none";
    case Launcher::kEnv:
      return "RANK/WORLD_SIZE";
    case Launcher::kSlurm:
      return "Slurm";
    case Launcher::kOpenMpi:
      return "Open MPI";
  }
  return "?";
}

std::string FirstSlurmHost(const std::string& list, const char* variable) {
  // Slurm's hostlist: items split by top-level commas, each a prefix with bracketed ranges
  // ("lab[0-3,7]", "rack[1-2]-n[01-04]"). The first host takes the first value of every range.
  std::string host;
  size_t i = 0;
  const auto bad = [&](const char* why) {
    Throw(ErrorCode::kInvalidArgument,
          "environment variable {}='{}': {}; expected a Slurm hostlist such as lab[0-3],gpu7",
          variable, list, why);
  };
  while (i < list.size() && list[i] != ',') {
    if (list[i] == ']') bad("a ']' without its '['");
    if (list[i] != '[') {
      host += list[i++];
      continue;
    }
    const size_t close = list.find(']', i);
    if (close == std::string::npos) bad("a '[' without its ']'");
    const std::string ranges = list.substr(i + 1, close - i - 1);
    const std::string first = ranges.substr(0, ranges.find_first_of(",-"));
    if (first.empty() || first.find_first_not_of("0123456789") != std::string::npos) {
      bad("a range that does not start with a number");
    }
    host += first;
    i = close + 1;
  }
  if (host.empty()) bad("no host");
  return host;
}

LaunchEnv ReadLaunchEnv(const EnvLookup& lookup) {
  const EnvLookup plain = [](const char* name) -> const char* { return std::getenv(name); };
  const Lookup get{lookup ? lookup : plain};
  LaunchEnv env;
  if (get("RANK") != nullptr || get("WORLD_SIZE") != nullptr) {
    if (get("RANK") == nullptr) {
      Throw(ErrorCode::kInvalidArgument,
            "environment: WORLD_SIZE is set but RANK is not; set both RANK and WORLD_SIZE (or "
            "neither, for a single process)");
    }
    env.launcher = Launcher::kEnv;
    ReadPosition(get, "RANK", "WORLD_SIZE", "LOCAL_RANK", &env);
    env.master_from = "the default (MASTER_ADDR unset)";
  } else if (get("OMPI_COMM_WORLD_RANK") != nullptr) {
    env.launcher = Launcher::kOpenMpi;
    ReadPosition(get, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", &env);
    const char* local_size = get("OMPI_COMM_WORLD_LOCAL_SIZE");
    const bool one_node = local_size != nullptr && std::to_string(env.world_size) == local_size;
    const char* uri = get("OMPI_MCA_orte_hnp_uri");
    const std::string hnp = uri != nullptr ? HnpAddress(uri) : "";
    if (one_node) {
      env.master_from = "loopback (every rank on this node)";
    } else if (!hnp.empty()) {
      // Open MPI does not say where rank 0 runs; mpirun's host is where it usually does
      // (`mpirun --host a,b,c,d` started on a). Rank 0 elsewhere fails to listen there, and says so.
      env.master_addr = hnp;
      env.master_from = "mpirun's host (OMPI_MCA_orte_hnp_uri); if rank 0 runs elsewhere, "
                        "pass -x MASTER_ADDR=<rank 0's host>";
    } else if (get("MASTER_ADDR") == nullptr && env.world_size > 1) {
      Throw(ErrorCode::kInvalidArgument,
            "environment: Open MPI rank {} of {} on several nodes, but neither MASTER_ADDR nor "
            "OMPI_MCA_orte_hnp_uri says where rank 0 runs; pass -x MASTER_ADDR=<rank 0's host> "
            "to mpirun",
            env.rank, env.world_size);
    }
    if (const char* job = get("OMPI_MCA_ess_base_jobid"); job != nullptr) {
      // The job family (high 16 bits) is shared by every rank of one mpirun.
      const long id = ParseInt("OMPI_MCA_ess_base_jobid", job, 0, 0xffffffffL, "a job id");
      env.master_port = static_cast<uint16_t>(20000 + ((id >> 16) % 10000));
    }
  } else if (get("SLURM_PROCID") != nullptr && get("SLURM_STEP_NUM_TASKS") != nullptr) {
    // SLURM_STEP_NUM_TASKS: set by srun for a step's tasks, not in an sbatch script itself,
    // whose lone shell is a single process even with SLURM_PROCID=0 and SLURM_NTASKS=4.
    env.launcher = Launcher::kSlurm;
    ReadPosition(get, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", &env);
    const char* var = "SLURM_STEP_NODELIST";
    if (get(var) == nullptr) var = "SLURM_JOB_NODELIST";
    if (const char* nodes = get(var); nodes != nullptr) {
      // Block and cyclic distributions both put rank 0 on the step's first node.
      env.master_addr = FirstSlurmHost(nodes, var);
      env.master_from = fmt::format("the first host of {}={}", var, nodes);
    } else if (get("MASTER_ADDR") == nullptr && env.world_size > 1) {
      Throw(ErrorCode::kInvalidArgument,
            "environment: Slurm rank {} of {}, but MASTER_ADDR, SLURM_STEP_NODELIST and "
            "SLURM_JOB_NODELIST are all unset or empty",
            env.rank, env.world_size);
    }
    if (const char* job = get("SLURM_JOB_ID"); job != nullptr) {
      // As PyTorch Lightning's Slurm default: one port per job, the same on every node.
      const long id = ParseInt("SLURM_JOB_ID", job, 0, 0x7fffffffL, "a job id");
      env.master_port = static_cast<uint16_t>(15000 + id % 10000);
    }
  } else {
    return env;  // a single process
  }
  if (const char* addr = get("MASTER_ADDR"); addr != nullptr) {
    env.master_addr = addr;
    env.master_from = "MASTER_ADDR";
  }
  if (const char* port = get("MASTER_PORT"); port != nullptr) {
    env.master_port =
        static_cast<uint16_t>(ParseInt("MASTER_PORT", port, 1, 65535, "a TCP port in [1, 65535]"));
  }
  return env;
}

std::string RankHost() {
  if (const char* host = std::getenv("PIPESGD_HOST"); host != nullptr && *host) return host;
  char name[256] = {};
  return gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0' ? name : "this host";
}

std::string ShellQuote(const std::string& word) {
  // Words the shell takes as they are stay readable (a command line in summary.json).
  if (!word.empty() && word.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                              "0123456789_./:,@%+-") == std::string::npos) {
    return word;
  }
  std::string out = "'";
  for (char c : word) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string ShellJoin(const std::vector<std::string>& words) {
  std::string line;
  for (const auto& w : words) line += (line.empty() ? "" : " ") + ShellQuote(w);
  return line;
}

}  // namespace pipesgd::transport
