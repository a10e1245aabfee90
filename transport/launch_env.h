// Where a rank sits in its job, read from the environment its launcher gave it, so that the
// same binary runs under `pipesgd run` or torchrun (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, LOCAL_RANK), under Slurm's `srun` (SLURM_PROCID, SLURM_STEP_NUM_TASKS,
// SLURM_LOCALID, SLURM_STEP_NODELIST, SLURM_JOB_ID) and under Open MPI's `mpirun`
// (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, OMPI_MCA_orte_hnp_uri, OMPI_MCA_ess_base_jobid)
// with no wrapper script. docs/launchers.md is the user's side of this.
//
// Precedence, first match wins: RANK/WORLD_SIZE (an explicit choice beats the scheduler's),
// then Open MPI, then Slurm (mpirun inside an allocation sees both), else a single process.
// MASTER_ADDR and MASTER_PORT, when set, win under every launcher.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace pipesgd::transport {

enum class Launcher { kNone, kEnv, kSlurm, kOpenMpi };
const char* ToString(Launcher launcher);  // "none", "RANK/WORLD_SIZE", "Slurm", "Open MPI"

struct LaunchEnv {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  // How master_addr and master_port were found, for the log: "MASTER_ADDR",
  // "the first host of SLURM_STEP_NODELIST=lab[0-3]", ...
  std::string master_from;
};

// A variable's value, or null when unset (std::getenv by default; tests pass a map).
using EnvLookup = std::function<const char*(const char*)>;

// Throws Error(kInvalidArgument) naming the variable, its value and what was expected: a
// number that does not parse or is out of range, RANK without WORLD_SIZE, a node list that is
// not Slurm's hostlist syntax, a multi-node mpirun whose rendezvous host cannot be found.
LaunchEnv ReadLaunchEnv(const EnvLookup& lookup = {});

// The first host of a Slurm hostlist ("lab[0-3],gpu7" -> "lab0"; "n[09-12]" -> "n09").
// Throws Error(kInvalidArgument) naming `variable` for an empty list or unbalanced brackets.
std::string FirstSlurmHost(const std::string& list, const char* variable);

// This rank's host for messages and summary.json: PIPESGD_HOST (the name the launcher's host
// list used), else this machine's hostname, else "this host".
std::string RankHost();

// Quotes `word` for a POSIX shell ('...' with embedded quotes escaped); a word of letters,
// digits and _./:,@%+- only stays as it is.
std::string ShellQuote(const std::string& word);

// `words` as one shell command line: each ShellQuote-d, joined by spaces.
std::string ShellJoin(const std::vector<std::string>& words);

}  // namespace pipesgd::transport
