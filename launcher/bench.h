// `pipesgd bench allreduce`: AllReduce bandwidth in the nccl-tests convention (all_reduce_perf:
// its flags, columns and footer, so its parsers read ours), so numbers compare with what users
// already read:
//   algbw = S / t            (S bytes reduced, t seconds per call)
//   busbw = algbw * 2(n-1)/n (the bytes each rank really moves over its link, per second)
// in GB/s (10^9 bytes). Out-of-place (input copied to a separate output, then reduced in place:
// the copy is timed) and in-place. With --link-gbps R, busbw is also shown as a share of R.
// With --compression X, the sizes and bandwidths are those of the uncompressed float32 data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "configs/pipesgd.pb.h"

namespace pipesgd::launcher {

// Flags as all_reduce_perf's where both have them (-b -e -f -i -g -n -w -c -d -o -a).
struct AllReduceBenchArgs {
  uint64_t min_bytes = 4096;          // -b
  uint64_t max_bytes = 64ull << 20;   // -e
  double factor = 2;                  // -f
  uint64_t step_bytes = 0;            // -i: a fixed increment instead of -f (0 = use -f)
  int iters = 20;                     // -n
  int warmup = 5;                     // -w
  // -c N: N iterations per size whose results are checked (exact sums, or within a codec's
  // bound), counted in #wrong; 0 = no check (#wrong N/A). nccl-tests' default, 1.
  int check = 1;
  int gpus = 1;                       // -g: devices per rank; one rank drives one, so 1
  std::string datatype = "float";     // -d: float (the ring reduces float32)
  std::string op = "sum";             // -o: sum or avg
  // -a: the time reported for a size, over the ranks: 0 rank 0's, 1 the mean, 2 min, 3 max.
  int average = 1;
  // Accepted as all_reduce_perf takes them, at the only values that describe this bench.
  int threads = 1;        // -t
  int agg_iters = 1;      // -m
  int graph = 0;          // -G
  int blocking = 0;       // -z: 0 or 1
  int parallel_init = 0;  // -p: 0 or 1
  double link_gbps = 0;               // --link-gbps: link rate in Gbit/s (0 = not shown)
  std::string json_path;              // --json: the same rows as JSON
  uint64_t chunk_bytes = 1 << 20;     // --chunk-bytes (0 = auto)
  int streams = 1;                    // --streams: connections per neighbour
  std::string transport = "tcp";      // --transport: tcp, ucx, ibverbs or auto
  std::string network_interface;      // --network-interface: as comm.network_interface
  std::string ib_device;              // --ib-device: as comm.ib_device
  int ib_port = 0;                    // --ib-port: as comm.ib_port
  int gid_index = -1;                 // --gid-index: as comm.gid_index
  // --compression: codec on the wire. algbw/busbw stay counted on the float32 size; an extra
  // pass times the same in-place call uncompressed for the speedup column; -c then counts
  // elements off by more than the codec's bound (Communicator::AllReduce).
  std::string compression = "none";
  // --set comm.PATH=VALUE, as `pipesgd run` takes them (every comm field: error feedback,
  // timeouts, ibverbs retries, ...), applied after the flags above, which are shorthands for
  // comm.chunk_bytes, comm.streams, comm.compression, comm.transport, comm.network_interface,
  // comm.ib_device, comm.ib_port and comm.gid_index.
  std::vector<std::string> overrides;
};

// "4K", "64M", "1G", "1048576" -> bytes. Throws Error kInvalidArgument naming the text.
uint64_t ParseBytes(const std::string& text);

// Throws Error kInvalidArgument naming the flag and its value for arguments no rank could run
// (-b > -e, -f <= 1, -g 8, -d half, ...): called before any rank starts. Returns the comm
// settings as a job (job::CollectiveJobConfig of the flags and --set).
config::Job CheckAllReduceBenchArgs(const AllReduceBenchArgs& args);

// Runs one rank (its place from the launcher's environment, transport/launch_env.h); rank 0
// prints the table in all_reduce_perf's layout (its 13 columns first, then ours), ending with
// "# Out of bounds values : N OK|FAILED" and "# Avg bus bandwidth    : X". Returns the number
// of wrong elements (0 when not checked). Throws pipesgd::Error on failure.
int64_t RunAllReduceBench(const AllReduceBenchArgs& args);

// The command line that makes each worker of `pipesgd bench allreduce --np N` run one rank.
std::vector<std::string> AllReduceBenchWorkerCommand(const AllReduceBenchArgs& args);

}  // namespace pipesgd::launcher
