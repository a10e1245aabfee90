// What `pipesgd run` runs on the other end of an ssh session (hidden subcommands; not meant to
// be started by hand).
//
// `pipesgd remote-probe`: the preflight. Prints "key value" lines on stdout: probe (format
// version), version (of pipesgd), ssh_connection ($SSH_CONNECTION: client address and port,
// server address and port), interface NAME ADDRESS (one per IPv4 address), free_port (a TCP
// port free on this host, below the kernel's ephemeral range so that no outgoing connection
// takes it before rank 0 listens).
//
// `pipesgd remote-rank`: one rank. Reads the job as one JSON line on stdin (RemoteJob), writes
// the shipped config to a private temporary directory, starts `pipesgd worker` there in a
// process group of its own with the job's environment, and then watches stdin: when it closes
// (the launcher stopped the job, or the ssh session died with the launcher) or a SIGTERM,
// SIGINT or SIGHUP arrives, it stops the worker's whole process group (SIGTERM, SIGKILL after
// a grace period). Secrets (the job token) travel only on stdin, never on a command line.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace pipesgd::launcher {

// The job as the launcher sends it to one remote rank.
struct RemoteJob {
  int rank = 0;
  std::string host;  // as in the host list
  std::map<std::string, std::string> env;           // set for the worker
  std::map<std::string, std::string> env_defaults;  // set where the remote has no value
  std::string config_name;  // file name for the shipped copy (the original's base name)
  std::string config_text;
  std::vector<std::string> worker_args;  // after `worker CONFIG`
  // Non-empty: run this instead of `pipesgd worker CONFIG` (argv; no config is shipped).
  std::vector<std::string> program;
  std::string cwd;  // the launcher's directory: used when it exists on the remote host
  double kill_grace_s = 3;  // SIGTERM to SIGKILL when stopping the worker
};

// One line of JSON (no newline inside), ending in '\n'.
std::string EncodeRemoteJob(const RemoteJob& job);

// Parses EncodeRemoteJob's output. Throws Error kDataLoss naming what is wrong.
RemoteJob DecodeRemoteJob(const std::string& line);

// `pipesgd remote-probe`. Returns the exit code.
int RunRemoteProbe();

// `pipesgd remote-rank`. Returns the exit code: the worker's status (128+N if it died of signal
// N). Throws Error if the job cannot be read or the worker cannot start.
int RunRemoteRank();

}  // namespace pipesgd::launcher
