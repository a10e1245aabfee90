// `pipesgd run -H HOSTS` / `--hostfile FILE`: the ranks of a job on other machines, over ssh.
//
//  1. Placement: ranks fill the hosts slot by slot (launcher/hostfile.h).
//  2. Config: checked here once; its text is shipped to every rank (nothing needs to exist on
//     the remote hosts but the pipesgd binary and the data files the config names).
//  3. Preflight, every host at once: `ssh HOST pipesgd remote-probe`, which shows that the host
//     is reachable without a prompt (BatchMode), that the binary is there (same absolute path as
//     this one, or --remote-binary) and of the same version, where the rank-0 host was reached
//     (its address is the default MASTER_ADDR) and a free port there (the default MASTER_PORT).
//     Every failing host is reported at once, with ssh's own message, and nothing is started.
//  4. Launch: one `ssh HOST pipesgd remote-rank` per rank under the common supervisor
//     (launcher/supervisor.h); the job, its environment and the job token go over the session's
//     stdin (launcher/remote_rank.h), never on a command line. Closing that stdin stops the rank
//     and everything it started.
#pragma once

#include <string>
#include <vector>

#include "launcher/hostfile.h"
#include "launcher/supervisor.h"

#include "transport/launch_env.h"

namespace pipesgd::launcher {

struct SshOptions {
  std::vector<HostSlots> hosts;
  std::string program = "ssh";  // an ssh-compatible client (same options)
  int port = 0;                 // -p; 0: ssh's own choice (config, else 22)
  std::string identity;         // -i
  std::string config_file;      // -F
  std::vector<std::string> options;  // each passed as -o OPTION, ahead of pipesgd's defaults
  double connect_timeout_s = 10;     // ssh -o ConnectTimeout (TCP connect and key exchange)
  std::string remote_binary;         // empty: this binary's absolute path
};

// The argument vector that runs `remote_command` on `host`:
//   ssh -o BatchMode=yes -o ConnectTimeout=T [-F FILE] [-p PORT] [-i KEY] [-o OPT]...
//       -o ServerAliveInterval=5 -o ServerAliveCountMax=3 -T -x -- HOST REMOTE_COMMAND
// BatchMode comes first so nothing can turn prompts back on (ssh keeps the first value of each
// option); the user's -o options come before pipesgd's other defaults, so they win.
std::vector<std::string> SshArgv(const SshOptions& ssh, const std::string& host,
                                 const std::string& remote_command);

// ShellQuote, ShellJoin: transport/launch_env.h (a rank's summary writes its command line too).
using transport::ShellJoin;
using transport::ShellQuote;

// Runs the job over ssh. Returns the exit code as Supervise does. Throws pipesgd::Error before
// anything is started: kInvalidArgument (bad config, -np larger than the slots, bad -x),
// kUnavailable (the preflight failed on some hosts; the message lists each with the reason).
int RunOverSsh(const RunArgs& args, const SshOptions& ssh);

}  // namespace pipesgd::launcher
