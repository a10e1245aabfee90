// `pipesgd probe` and `pipesgd model` (docs/timing_models.md).
//
// probe: one rank per node (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, or `probe -np N` for
// local ranks). Each rank measures the link to its right ring neighbour (ping-pong latency of
// 8-byte messages, one-way bandwidth of 8 MiB messages, the per-message cost of a stream of
// 16 KiB messages) and, on its own CPU, the compute time of one step of the configured model
// (forward + backward on batch_size samples), one optimizer update, the float32 reduction and
// each codec's encode + decode. Rank 0 prints every rank's numbers and writes them as JSON
// (--json), with the values the model takes: the slowest link, the slowest compute.
//
// model: the timing models of core/train/timing_model.h, from the command line or from
// probe's JSON; prints each scheme's predicted time per iteration and the best choice of
// scheme, width, compression and chunk size.
#pragma once

#include <string>
#include <vector>

namespace pipesgd::launcher {

struct ProbeArgs {
  std::string config_path;
  std::vector<std::string> overrides;
  std::string json_path;  // rank 0 writes the results here (empty: print only)
  int pings = 200;        // ping-pong round trips timed (after 20 untimed)
  int compute_steps = 20; // forward + backward steps timed (after 3 untimed)
};

// Runs one rank of the probe. Throws pipesgd::Error.
void RunProbe(const ProbeArgs& args);
// The worker command line of `pipesgd probe -np N`.
std::vector<std::string> ProbeWorkerCommand(const ProbeArgs& args);

struct ModelArgs {
  std::string probe_json;     // take the inputs from this file (the flags below override)
  int workers = 0;            // W (0: from the probe, else 4)
  double model_bytes = 0;     // M
  double latency_s = -1;      // alpha
  double bandwidth_Bps = 0;   // B (or link_rate_bps / 8)
  double link_rate_bps = 0;   // e.g. 1e9 for 1gbit (sets B = rate / 8 when B is not given)
  double compute_s = -1;      // C
  double update_s = -1;       // U
  double pipelined_update_s = -1;  // U_K (width >= 2)
  double reduce_s_per_byte = -1;
  double chunk_overhead_s = -1;
  double contention = -1;  // gamma in [0, 1]
  double chunk_bytes = 0;     // evaluate this chunk size only (0: search 4 KiB .. 16 MiB)
  std::string json_path;      // write the predictions as JSON
  // The outer loop's rows (train.local_steps H): one per H, blocking and overlapped.
  std::vector<int> local_steps = {4, 16, 64};
  int batch_size = 0;  // per worker, for samples per second (0: the probe's, if it has one)
};

// Prints the predictions; returns them as JSON text too (written to json_path if set).
// Throws Error kInvalidArgument for missing or out-of-range inputs, naming them.
void RunModel(const ModelArgs& args);

}  // namespace pipesgd::launcher
