// transport/launch_env.h: the position of a rank read from torchrun's, Slurm's and Open MPI's
// environments (each with the variables those launchers really set; the Open MPI set was
// copied from Debian 12's mpirun 4.1.4), the precedence between them, and the errors.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "core/base/error.h"
#include "transport/launch_env.h"

namespace pipesgd::transport {
namespace {

using Env = std::map<std::string, std::string>;

LaunchEnv Read(const Env& env) {
  return ReadLaunchEnv([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::string ErrorOf(const Env& env) {
  try {
    Read(env);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    return e.what();
  }
  return "(no error)";
}

TEST(LaunchEnv, NothingSetIsASingleProcess) {
  const LaunchEnv env = Read({{"HOME", "/root"}, {"SLURM_JOB_ID", "77"}});
  EXPECT_EQ(env.launcher, Launcher::kNone);
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
}

TEST(LaunchEnv, TorchrunStyle) {
  const LaunchEnv env = Read({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                              {"MASTER_ADDR", "lab0"}, {"MASTER_PORT", "29511"}});
  EXPECT_EQ(env.launcher, Launcher::kEnv);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "lab0");
  EXPECT_EQ(env.master_port, 29511);
  const LaunchEnv defaults = Read({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(defaults.master_addr, "127.0.0.1");
  EXPECT_EQ(defaults.master_port, 29500);
  EXPECT_EQ(defaults.local_rank, 0);
}

// What srun gives task 5 of `srun -N3 -n6` in job 123456 (block distribution).
Env SrunTask() {
  return {{"SLURM_JOB_ID", "123456"},          {"SLURM_PROCID", "5"},
          {"SLURM_LOCALID", "1"},              {"SLURM_NTASKS", "6"},
          {"SLURM_STEP_NUM_TASKS", "6"},       {"SLURM_STEP_ID", "0"},
          {"SLURM_STEP_NODELIST", "lab[1-3]"}, {"SLURM_JOB_NODELIST", "lab[0-3]"},
          {"SLURM_NODEID", "2"}};
}

TEST(LaunchEnv, SlurmTask) {
  const LaunchEnv env = Read(SrunTask());
  EXPECT_EQ(env.launcher, Launcher::kSlurm);
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 6);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "lab1");  // the step's first node, not the job's
  EXPECT_EQ(env.master_port, 15000 + 123456 % 10000);
  EXPECT_NE(env.master_from.find("SLURM_STEP_NODELIST=lab[1-3]"), std::string::npos)
      << env.master_from;
  Env given = SrunTask();
  given["MASTER_ADDR"] = "10.0.0.9";
  given["MASTER_PORT"] = "31000";
  const LaunchEnv overridden = Read(given);
  EXPECT_EQ(overridden.master_addr, "10.0.0.9");
  EXPECT_EQ(overridden.master_port, 31000);
}

TEST(LaunchEnv, AnSbatchScriptItselfIsASingleProcess) {
  // The batch shell has SLURM_PROCID=0 and the job's SLURM_NTASKS but is no step's task.
  const LaunchEnv env = Read({{"SLURM_JOB_ID", "9"}, {"SLURM_PROCID", "0"},
                              {"SLURM_NTASKS", "4"}, {"SLURM_JOB_NODELIST", "lab[0-3]"}});
  EXPECT_EQ(env.launcher, Launcher::kNone);
  EXPECT_EQ(env.world_size, 1);
}

// What Debian 12's `mpirun -np 4 --host a,b,c,d` (Open MPI 4.1.4) gives rank 2.
Env MpirunRank() {
  return {{"OMPI_COMM_WORLD_RANK", "2"},
          {"OMPI_COMM_WORLD_SIZE", "4"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
          {"OMPI_MCA_ess_base_jobid", "2140864513"},
          {"OMPI_MCA_orte_hnp_uri", "2140864512.0;tcp://10.77.0.1,172.17.0.1:34743;"
                                    "tcp6://[fd00::2]:39229"}};
}

TEST(LaunchEnv, OpenMpiAcrossNodes) {
  const LaunchEnv env = Read(MpirunRank());
  EXPECT_EQ(env.launcher, Launcher::kOpenMpi);
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.master_addr, "10.77.0.1");  // mpirun's host, its first IPv4 address
  EXPECT_EQ(env.master_port, 20000 + (2140864513L >> 16) % 10000);
  Env given = MpirunRank();
  given["MASTER_ADDR"] = "lab0";
  EXPECT_EQ(Read(given).master_addr, "lab0");
  // Without the URI and without MASTER_ADDR nothing says where rank 0 is.
  Env bare = MpirunRank();
  bare.erase("OMPI_MCA_orte_hnp_uri");
  EXPECT_NE(ErrorOf(bare).find("-x MASTER_ADDR"), std::string::npos) << ErrorOf(bare);
}

TEST(LaunchEnv, OpenMpiOnOneNodeUsesLoopback) {
  Env one = MpirunRank();
  one["OMPI_COMM_WORLD_LOCAL_SIZE"] = "4";
  one["OMPI_COMM_WORLD_LOCAL_RANK"] = "2";
  const LaunchEnv env = Read(one);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.local_rank, 2);
}

TEST(LaunchEnv, PrecedenceRankThenOpenMpiThenSlurm) {
  Env all = SrunTask();
  for (const auto& [k, v] : MpirunRank()) all[k] = v;
  EXPECT_EQ(Read(all).launcher, Launcher::kOpenMpi);  // mpirun inside an allocation
  all["RANK"] = "1";
  all["WORLD_SIZE"] = "2";
  const LaunchEnv env = Read(all);
  EXPECT_EQ(env.launcher, Launcher::kEnv);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
}

TEST(LaunchEnv, ErrorsNameTheVariableAndTheValue) {
  EXPECT_NE(ErrorOf({{"RANK", "1"}}).find("RANK is set but WORLD_SIZE is not"), std::string::npos);
  EXPECT_NE(ErrorOf({{"WORLD_SIZE", "2"}}).find("WORLD_SIZE is set but RANK is not"),
            std::string::npos);
  EXPECT_NE(ErrorOf({{"RANK", "4"}, {"WORLD_SIZE", "4"}})
                .find("RANK='4': expected an integer in [0, WORLD_SIZE=4)"),
            std::string::npos);
  EXPECT_NE(ErrorOf({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}})
                .find("MASTER_PORT='http': expected a TCP port"),
            std::string::npos);
  Env bad_rank = SrunTask();
  bad_rank["SLURM_PROCID"] = "x1";
  EXPECT_NE(ErrorOf(bad_rank).find("SLURM_PROCID='x1'"), std::string::npos);
  Env bad_list = SrunTask();
  bad_list["SLURM_STEP_NODELIST"] = "lab[1-3";
  EXPECT_NE(ErrorOf(bad_list).find("SLURM_STEP_NODELIST='lab[1-3': a '[' without its ']'"),
            std::string::npos)
      << ErrorOf(bad_list);
  Env bad_local = MpirunRank();
  bad_local["OMPI_COMM_WORLD_LOCAL_RANK"] = "-1";
  EXPECT_NE(ErrorOf(bad_local).find("OMPI_COMM_WORLD_LOCAL_RANK='-1'"), std::string::npos);
}

TEST(LaunchEnv, ASingleTaskNeedsNoRendezvousHost) {
  Env one = {{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "1"}, {"SLURM_STEP_NODELIST", ""}};
  EXPECT_EQ(Read(one).world_size, 1);
  one["SLURM_STEP_NUM_TASKS"] = "2";
  EXPECT_NE(ErrorOf(one).find("MASTER_ADDR, SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are all "
                              "unset or empty"),
            std::string::npos)
      << ErrorOf(one);
}

TEST(LaunchEnv, FirstSlurmHost) {
  EXPECT_EQ(FirstSlurmHost("lab0", "V"), "lab0");
  EXPECT_EQ(FirstSlurmHost("lab[0-3]", "V"), "lab0");
  EXPECT_EQ(FirstSlurmHost("n[09-12,20]", "V"), "n09");  // zero padding kept
  EXPECT_EQ(FirstSlurmHost("gpu[3,5-6],cpu[1-2]", "V"), "gpu3");
  EXPECT_EQ(FirstSlurmHost("rack[2-3]-n[01-04]", "V"), "rack2-n01");
  EXPECT_EQ(FirstSlurmHost("a.example.org,b.example.org", "V"), "a.example.org");
  EXPECT_THROW(FirstSlurmHost("", "V"), Error);
  EXPECT_THROW(FirstSlurmHost(",lab0", "V"), Error);
  EXPECT_THROW(FirstSlurmHost("lab]0", "V"), Error);
  EXPECT_THROW(FirstSlurmHost("lab[x-y]", "V"), Error);
}

}  // namespace
}  // namespace pipesgd::transport
