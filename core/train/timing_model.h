// Timing models of data-parallel SGD: the time of one iteration of each scheme, from the
// network's latency and bandwidth, the cluster size, the model size and the compute time
// (the four inputs of Pipe-SGD's models: Li et al., NeurIPS 2018, abstract and Sec. 3), plus
// the costs this implementation adds: a per-chunk overhead, the reduction and the codec.
//
// The paper's own equations could not be retrieved (../shared/docs/papers.md, section 1.5,
// marks them not found); these are the alpha-beta reconstructions of that section, refined for
// this implementation's chunked ring. docs/timing_models.md derives every term.
//
// Units: seconds, bytes, bytes per second. Links are full duplex, B in each direction.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace pipesgd::train {

struct TimingInputs {
  int workers = 4;                 // W >= 1: ranks that compute gradients
  double model_bytes = 0;          // M: float32 gradient bytes (4 x parameters)
  double latency_s = 0;            // alpha: one-way latency of a small message
  double bandwidth_Bps = 1;        // B: bytes per second per direction of a link, > 0
  double compute_s = 0;            // C: forward + backward of one worker's batch
  double update_s = 0;             // U: one optimizer step over M bytes of parameters
  // U_K: the same at width >= 2, with the staleness compensation's extra work (keeping the local
  // gradient, the prediction of the next step's point); <= 0: not known, U.
  double pipelined_update_s = 0;
  double reduce_s_per_byte = 0;    // rho: adding two float32 vectors, per byte of one of them
  double chunk_overhead_s = 0;     // o: software cost of one chunk message (header, wake-up)
  // gamma in [0, 1]: how much of the shorter of the link and CPU terms does NOT hide behind the
  // longer. 0: a NIC moves the bytes while the core reduces (the terms overlap fully); 1: the
  // same cores copy the bytes (loopback, a kernel TCP stack on a busy node), so they add.
  double contention = 0;
  // How much slower the compute (f_c) and the AllReduce (f_a) run while the other runs at the
  // same time on every rank, >= 1 (1: not at all, as where a NIC and spare cores do the
  // communication). `pipesgd probe` times both at once; they set width 2's overlap.
  double overlap_compute_factor = 1;
  double overlap_allreduce_factor = 1;
  // The CPU bound: where a rank's cores are all busy (ranks sharing cores, a node under a CPU
  // quota, a kernel TCP stack copying every byte) a step takes at least the CPU time it needs
  // over the CPU the rank gets, whatever the overlap. 0 for both shares: not known, no bound.
  //   compute_cpu_share: cores' worth of CPU time per second of C while every rank computes
  //   cpu_share:         the same while compute and the AllReduce run at once (the rank's CPU)
  //   the AllReduce's CPU time (every thread, user + kernel): per byte sent and per message,
  //   beyond the reduction and the codec (rho, kappa), which the ring terms already count.
  double compute_cpu_share = 0;
  double cpu_share = 0;
  double transport_cpu_s_per_byte = 0;
  double transport_cpu_s_per_message = 0;
  // The same per byte in messages of a whole model (the PS schemes); 0: not known, the above.
  double big_message_cpu_s_per_byte = 0;
  // The ranks share one host and talk over loopback (`pipesgd probe`: every rank's connections
  // on a loopback address): no link between them, the kernel copies the bytes on their cores. The
  // PS schemes' server then moves its bytes at the CPU it gets, not at B: B is fitted to the
  // ring, where every rank copies at once, and put the synchronous server's W gradients in and
  // W models out at 4.0-7.5 ms where they took 2.6-3.5 ms (4 ranks on 2 cores). Only with the
  // shares (the CPU bound's inputs); the ring's terms are fitted either way.
  bool loopback = false;
  // The PS schemes' steps as `pipesgd probe` timed them, less C: the job's PsServer and PsWorker
  // on the probe's ranks, rank 0 serving ps_probe_workers workers (the probe's W - 1), the
  // slowest worker's synchronous and asynchronous step; and the CPUs they kept busy (every
  // rank's CPU time per second over them, summed). 0 workers: not measured, the formulas below
  // hold. The job has W workers and a server: PsSyncTime scales what the step takes beyond C by
  // W / ps_probe_workers pushes and, on one host, by how much more the job's W + 1 processes
  // would ask of its CPUs (PsScale). The formulas put 4 workers and a server on 2 cores at +16%
  // (sync) and +27% (async) of their measured steps: the server's CPU share there is between
  // a rank's and a core.
  double ps_sync_beyond_compute_s = 0;
  double ps_async_beyond_compute_s = 0;
  int ps_probe_workers = 0;
  double ps_sync_busy_cpus = 0;
  double ps_async_busy_cpus = 0;
  double host_cpus = 0;  // the CPUs the ranks' host gives them all (affinity, quota); 0: not known
  // sigma: what a synchronous step takes beyond C + U + T_AR (or the CPU bound): ranks that
  // reach the AllReduce at different times (a shared core's time slices, a preempted rank), the
  // hand-off to the communication thread, the step's bookkeeping. Width 2 hides it behind the
  // AllReduce in flight. `pipesgd probe` times real width-1 steps (FitSyncOverhead). It may be
  // negative: where the AllReduce is long, ranks that finish computing first start it early
  // and a late rank's lag hides in it (1 Gbit/s lab, no codec: -0.3 ms).
  double sync_overhead_s = 0;
  // sigma_2: the same for width 2, which the overlap formula below does not see either: the
  // compute thread's wait for the aggregate two steps back, the two threads' wake-ups and
  // hand-offs on a shared core, the update's pass over the parameters while the next AllReduce
  // runs. `pipesgd probe` times real width-2 steps (FitPipeOverhead).
  double pipe_overhead_s = 0;
  // Both depend on how long the AllReduce takes (1 Gbit/s lab, width 1: -0.3 ms at T_AR 11.8 ms,
  // +0.4 ms at 3.0 ms, +0.8 to +1.2 ms at 1.6 ms). The two above are measured where the
  // AllReduce takes overhead_allreduce_s (no codec); the fast_ ones where it takes
  // fast_allreduce_s (the codec with the fastest AllReduce). OverheadAt interpolates between
  // them; without both times, the first pair holds everywhere.
  double overhead_allreduce_s = 0;
  double fast_allreduce_s = 0;
  double fast_sync_overhead_s = 0;
  double fast_pipe_overhead_s = 0;
  // A step's chunk messages cost more than the AllReduce alone shows (the communication thread's
  // wake-ups after a compute phase, caches the compute evicted; under a CPU quota, the CPU they
  // take): on the 1 Gbit/s lab q4 steps at 4 chunks per ring block ran 1.0-1.2 ms slower than
  // at 1, where the AllReduce alone was 0.1 ms faster. The sigmas above hold at
  // overhead_chunks_per_block chunks per block; a row at m chunks adds (m - that) times these,
  // per chunk per block, width 1 and width >= 2 (`pipesgd probe` times the fast codec's steps at
  // two chunk sizes). >= 0; 0: not measured.
  double overhead_chunks_per_block = 0;
  double sync_overhead_per_chunk_s = 0;
  double pipe_overhead_per_chunk_s = 0;
};

// A gradient codec as the model sees it.
struct CodecCost {
  std::string name = "none";
  double ratio = 1;         // r: float32 bytes / wire bytes, >= 1
  // kappa: what the codec adds to the ring's CPU term, per float32 byte of the model (wall time,
  // taken as C is). `pipesgd probe` fits it to the job's AllReduce with the codec (FitCodec); by
  // hand, one encode + one decode.
  double s_per_byte = 0;
  // kappa_cpu: the CPU time the codec adds per float32 byte, for the CPU bound (FitCodec, from the
  // same AllReduces' CPU time). Not known: kappa at the compute share s_c, as rho.
  std::optional<double> cpu_s_per_byte = std::nullopt;
  // o_c: what the codec adds to each chunk message's cost o, and o_c's CPU (FitCodec; 0 by
  // hand). A coded chunk lands in a staging arena and is decoded from there, where a float32
  // one lands in place: on 4 ranks on loopback q8's AllReduce equals float32's at 16 KiB chunks
  // and is 1.7x faster at 256 KiB.
  double s_per_chunk = 0;
  double cpu_s_per_chunk = 0;
};

// Ring AllReduce of M bytes over W ranks in chunks of at most `chunk_bytes` (raw float32 bytes)
// (Patarasuk & Yuan 2009; papers.md 1.4-1.5):
//   m = ceil(M / (W S)) chunks per block, s = M / (W m) bytes per chunk,
//   T_AR = 2(W-1) alpha
//        + max(L, P) + gamma min(L, P)                         with
//            L = 2(W-1) M / (W r B)                            the link, busy all along
//            P = 2(W-1) [ (M/W)(rho + kappa) + m (o + o_c) ]   the communication thread's CPU
//        + 2(W-1) s (rho + kappa)                              per step, one chunk not overlapped
// W = 1: 0.
double RingAllReduceTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes);

// RingAllReduceTime's terms, what `pipesgd model` shows beside each ring prediction.
struct RingTerms {
  double chunks_per_block = 0;  // m
  double latency_s = 0;         // 2(W-1) alpha
  double link_s = 0;            // L
  double cpu_s = 0;             // P
  double tail_s = 0;            // (1 - gamma) 2(W-1) s (rho + kappa): the fill that counts
  double total_s = 0;           // RingAllReduceTime
};
RingTerms RingAllReduceTerms(const TimingInputs& in, const CodecCost& codec, double chunk_bytes);

// CPU time of one ring AllReduce on one rank: the reduction and the codec (rho and kappa are
// wall times at the compute share s_c, as C: s_c of them is CPU; 1 where s_c is not known; the
// codec's kappa_cpu where known), and the transport's share per byte sent and per chunk message:
//   2(W-1) [ (M/W)(rho s_c + kappa_cpu) + (M/W)/r cpu_byte + m (cpu_msg + o_c,cpu) ]
// (kappa_cpu not known: kappa s_c)
double RingAllReduceCpuTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes);

// U at pipeline width `width`: U_K for width >= 2 where known, else U.
double UpdateTime(const TimingInputs& in, int width);

// The CPU bound of a ring step at pipeline width `width`: what the rank computes, updates and
// spends on the AllReduce, at the CPU it gets (0 where the shares are not known):
//   ((C + U) s_c + RingAllReduceCpuTime) / max(s, s_c)       U_K for width >= 2
double CpuBoundTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes,
                    int width);

// The transport's CPU per byte sent and per message, from the CPU time of two timed AllReduces
// of the model without a codec, with many chunks (small) and few (large), less what the
// reduction takes (in.reduce_s_per_byte): two equations, two unknowns; a negative one is
// dropped and the other fitted to both. Both 0 with one worker.
struct TransportCpu {
  double s_per_byte = 0;
  double s_per_message = 0;
};
struct TimedCpu {
  double chunk_bytes = 0;
  double cpu_s = 0;  // CPU time of one AllReduce, every thread of the rank
};
TransportCpu FitTransportCpu(const TimingInputs& in, TimedCpu small, TimedCpu large);

// A codec's costs from the job's own AllReduce of the model with it, timed at two chunk sizes
// (its wall time on the slowest rank, its CPU time), with B, o, gamma and the transport's CPU
// already fitted without a codec: kappa and o_c such that RingAllReduceTime gives both times,
// kappa_cpu and o_c,cpu such that RingAllReduceCpuTime gives both CPU times. Encode and decode
// timed alone miss what the codec does in the ring (a decode and an encode per reduce-scatter
// step, a decode per all-gather step, messages r times smaller, the staging): on 4 ranks on
// loopback they had q8's AllReduce at 256 KiB chunks 15% slower than it ran and sign1's 31%
// faster. The costs are beside the float32 path's and may be negative: the decode adds in the
// same pass (Codec::DecodeAdd), which can cost less than rho. Bounds: kappa in [-rho, 1 us/B],
// o_c in [-o, 10 ms] (o_c at a bound: kappa fits the size with fewer chunks); kappa_cpu at
// least -rho's CPU, o_c,cpu at least -cpu_msg (one at its bound: the other fitted to both
// sizes). Timed at one size, or at sizes with the same number of chunks per block: o_c is 0 and
// kappa the mean. With one worker, or nothing timed, all are 0.
struct TimedCodec {
  double chunk_bytes = 0;
  double seconds = 0;  // wall time of one AllReduce
  double cpu_s = 0;    // CPU time of one AllReduce, every thread of the rank
};
CodecCost FitCodec(const TimingInputs& in, const std::string& name, double ratio,
                   const std::vector<TimedCodec>& timed);

// sigma (width 1) or sigma_2 (width >= 2) where the AllReduce takes t_ar_s: between the two
// measured points (overhead_allreduce_s and fast_allreduce_s), linear in 1 / T_AR; beyond them,
// the nearer one's; one point (either time <= 0, or both equal): its value. On the 1 Gbit/s lab
// linear in 1 / T_AR put the width-1 step at T_AR 3.0 ms within 0.1 ms of its measured sigma
// from the points at 1.6 and 11.8 ms; linear in T_AR, 0.4 ms off.
double OverheadAt(const TimingInputs& in, int width, double t_ar_s);

// m = ceil(M / (W S)): the chunks per ring block at `chunk_bytes` chunks.
double ChunksPerBlock(const TimingInputs& in, double chunk_bytes);

// What a step at `chunk_bytes` chunks adds beyond the sigmas' chunk count:
// (m - overhead_chunks_per_block) x the width's per-chunk cost, m = ceil(M / (W S)); 0 where
// the count is not known.
double ChunkOverhead(const TimingInputs& in, int width, double chunk_bytes);

// The per-chunk cost from one codec's steps timed at two chunk counts, each step's sigma (the
// step less the model's base, FitSyncOverhead or FitPipeOverhead) at m_few and m_many chunks per
// block: the slope, at least 0 (what chunking gains is in T_AR already; a lower sigma with more
// chunks is noise); 0 for equal counts.
double FitChunkOverhead(double m_few, double sigma_few, double m_many, double sigma_many);

// Synchronous ring SGD (pipeline width 1): C + U + T_AR, or the CPU bound if longer, + sigma at
// that T_AR; never below max(C + U, T_AR).
double RingSyncTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes);

// sigma from a measured synchronous step with `codec` at `chunk_bytes` chunks and its AllReduce
// measured alone (measured_allreduce_s): the step less max(C + U + that AllReduce, the CPU
// bound). The measured AllReduce, not the model's, so that sigma holds only what the step adds
// (at 100 Mbit/s the model's T_AR at 64 KiB chunks was 8% below the timed one, and sigma took
// that in: 5.5 ms, added to sign1's 4.4 ms AllReduce).
double FitSyncOverhead(const TimingInputs& in, const CodecCost& codec, double chunk_bytes,
                       double measured_allreduce_s, double measured_step_s);

// Pipe-SGD of width K: K = 1 is RingSyncTime; K >= 2: compute (a = C + U_K) and communication
// (b = T_AR) run at once, each slowed by the other's factor while both run, the one left after
// the other ends at full speed (a wider pipeline cannot beat that):
//   a f_c <= b f_a:  a f_c + b - a f_c / f_a       (the AllReduce ends last)
//   otherwise:       b f_a + a - b f_a / f_c
// Factors of 1 give max(a, b) (full overlap); factors of 2 give a + b (one core, shared fairly).
// The CPU bound if longer; then + sigma_2 at that T_AR (one worker: none, it waits for no
// AllReduce); never below max(a, b).
double PipeTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes, int width);

// sigma_2 from a measured width-2 step, as FitSyncOverhead: the step less PipeTime's overlap
// (or CPU bound) with b = the measured AllReduce.
double FitPipeOverhead(const TimingInputs& in, const CodecCost& codec, double chunk_bytes,
                       double measured_allreduce_s, double measured_step_s);

// Synchronous parameter server, one dedicated server, W workers (papers.md 1.5, first row):
//   T = C + 2 alpha + 2 W M / (r B)              W gradients in, W models out, one server link
//     + W M rho + U                              the server sums and updates
//     + 2 M kappa + W M kappa                    codec: worker encodes/decodes, server decodes
// On loopback (TimingInputs::loopback, with the shares) the server's link term is its CPU for
// those bytes instead, W X / max(s, s_c), X as in PsAsyncCpuBoundTime.
// Where the probe timed the PS steps (TimingInputs::ps_probe_workers > 0) the float32 step is
// that instead: C + (the probed step - C) x PsScale.
double PsSyncTime(const TimingInputs& in, const CodecCost& codec);

// From the probe's n = ps_probe_workers workers to W: the server's pushes per step, W / n; on
// one host (loopback, host_cpus = K known) also the CPU each process gets, where the probe's
// n + 1 processes kept D = busy_cpus of the K busy and the job's W + 1 would ask D (W+1)/(n+1):
// x max(1, D (W+1) / ((n+1) K)) / max(1, D / K). On 2 cores, 4 workers: the probe's 4
// processes kept 1.47-1.84 busy, the job's 5 would ask 1.84-2.30, x 1.0-1.15; 3 workers: 1.36
// and 1.46 busy, x 1 (taking every process as always busy gave x 1.33 there and predicted 3
// workers 31-40% slow).
double PsScale(const TimingInputs& in, double busy_cpus);

// Asynchronous parameter server: each worker's cycle, or the server's link or CPU when W
// workers share it, whichever is slower (papers.md 1.5, second row, for full-duplex links):
//   T = max( C + 2 alpha + 2 M / (r B) + M rho + U + 2 M kappa,
//            W M / (r B),
//            W (M rho + U + M kappa) )
//   or the CPU bound (PsAsyncCpuBoundTime) if longer. On loopback (with the shares) a push's
//   bytes cost the worker X / max(s, s_c) in place of 2 M / (r B), and the server's bytes are
//   CPU, which the bound holds: no link term.
// Measured by the probe: C + (the probed asynchronous step - C) x PsScale, as PsSyncTime.
double PsAsyncTime(const TimingInputs& in, const CodecCost& codec);

// The asynchronous server's CPU bound, as CpuBoundTime for the ring (0 where the shares are not
// known): each push moves one gradient in and one model out (2 M / r bytes, 2 messages), and per
// worker cycle the server takes W pushes. A worker's cycle holds its own push's turn at the
// server; the server serves W pushes per cycle; at the CPU a rank gets:
//   max( (C + 2 M kappa) s_c + X + S / W,  S ) / max(s, s_c)
//   S = W ((M rho + U + M kappa) s_c + X),   X = (M / r) cpu_big + 2 cpu_msg
// cpu_big: per byte sent (and one received) in whole-model messages, or cpu_byte if not known.
// The server is one more process than the W ranks the shares were measured on: where it shares
// their cores, its share is lower than s.
// 0 where the probe timed the steps (they hold the bound).
double PsAsyncCpuBoundTime(const TimingInputs& in, const CodecCost& codec);

// One row of `pipesgd model`.
struct SchemePrediction {
  std::string scheme;   // "ps_sync", "ps_async", "ring_sync", "pipe_k2"
  std::string codec;    // codec name
  double chunk_bytes = 0;  // 0 for the PS schemes
  double iteration_s = 0;
  double compute_s = 0;    // C + U (C + U_K for pipe_k2)
  double comm_s = 0;       // T_AR (ring schemes); PS: what the server round adds to C + U
  double cpu_bound_s = 0;  // CpuBoundTime (ring schemes; 0 where not known)
  RingTerms ring;          // the ring schemes' T_AR, term by term
};

// The ring schemes with every codec at its best chunk size among `chunk_sizes` (bytes), the PS
// schemes with codec "none" only (they send float32), and the overall best. Chunk candidates
// must be non-empty.
struct ModelReport {
  std::vector<SchemePrediction> rows;
  SchemePrediction best;
  int best_width = 2;
};
ModelReport PredictAll(const TimingInputs& in, const std::vector<CodecCost>& codecs,
                       const std::vector<double>& chunk_sizes);

// The outer loop (train.local_steps H, docs/outer_loop.md): a round is H inner steps without
// communication, then the pseudo-gradient's AllReduce and the outer step. A round is modelled
// as one step of the ring schemes above whose compute is the round's:
//   C_H = H C + (H - 1) U      the H inner steps' compute and updates but the last
//   U_H = U_K                  the last update with the outer step's passes over the model
//                              (the pseudo-gradient, the outer optimizer, the new start): as
//                              many as width 2's compensation makes
// blocking (outer_overlap 0): RingSyncTime of that step, the round's AllReduce on its critical
// path; overlapped (outer_overlap 1): PipeTime at width 2, the AllReduce behind the next round's
// H steps. Both with the sigmas and the CPU bound as measured for one step, so a round adds one
// step's sigma, not H. Per inner step: the round / H. H = 1 blocking is RingSyncTime exactly (no
// outer step: the ring trainer). A time model only: what H costs in accuracy is measured
// (docs/outer_loop.md).
TimingInputs OuterRoundInputs(const TimingInputs& in, int local_steps);
double OuterStepTime(const TimingInputs& in, const CodecCost& codec, double chunk_bytes,
                     int local_steps, bool overlap);

// The outer loop's rows for each H in `local_steps` (each >= 1), blocking and overlapped (H >= 2),
// each codec at its best chunk among `chunk_sizes`: scheme "outer_hH" or "outer_hH_ov",
// iteration_s per inner step, compute_s and comm_s per inner step (C_H + U_H and T_AR over H),
// the ring terms of the round's AllReduce. None with one worker (nothing to average).
std::vector<SchemePrediction> PredictOuter(const TimingInputs& in,
                                           const std::vector<CodecCost>& codecs,
                                           const std::vector<double>& chunk_sizes,
                                           const std::vector<int>& local_steps);

// The per-chunk overhead o at which RingAllReduceTime(in, no codec, chunk_bytes) equals
// `measured_s` (in.chunk_overhead_s is ignored): what a ring AllReduce timed with many chunks
// says a chunk costs, all of it counted (a wake-up, a header, a reduction call), which a stream
// of messages on one idle link does not show. 0 if the model is already at or above
// `measured_s` with o = 0; at most 10 ms. Found by bisection (RingAllReduceTime grows with o).
double FitChunkOverhead(const TimingInputs& in, double chunk_bytes, double measured_s);

// The bandwidth B at which RingAllReduceTime(in, no codec, chunk_bytes) equals `measured_s`
// (in.bandwidth_Bps is ignored): the ring's own effective link rate, from an AllReduce timed
// with few chunks. 0 if no B in [1 kB/s, 1 TB/s] reaches it (the time is latency or CPU, not the
// link). Bisection in log space (RingAllReduceTime falls as B grows).
double FitBandwidth(const TimingInputs& in, double chunk_bytes, double measured_s);

// The contention gamma in [0, 1] at which RingAllReduceTime(in, no codec, chunk_bytes) equals
// `measured_s` (in.contention is ignored), clamped to 0 and 1. Bisection (the time grows with
// gamma).
double FitContention(const TimingInputs& in, double chunk_bytes, double measured_s);

// B, o and gamma together from three timed AllReduces of the model, with few chunks (large),
// many (small) and some (mid): B from the first, o from the second, gamma from the third, each
// at the others' latest values, for a few rounds (each depends a little on the others). Where B
// cannot be fitted (the large time lies below what the latency and the reduction alone take,
// or above what 1 kB/s would give), in.bandwidth_Bps stays and bandwidth_fitted is false.
struct RingFit {
  double bandwidth_Bps = 0;
  double chunk_overhead_s = 0;
  double contention = 0;
  bool bandwidth_fitted = false;
};
struct TimedAllReduce {
  double chunk_bytes = 0;
  double seconds = 0;
};
RingFit FitRing(const TimingInputs& in, TimedAllReduce small, TimedAllReduce mid,
                TimedAllReduce large);

// The chunk size among `chunk_sizes` that minimizes RingAllReduceTime.
double BestChunkBytes(const TimingInputs& in, const CodecCost& codec,
                      const std::vector<double>& chunk_sizes);

// Powers of two from 4 KiB to 16 MiB.
std::vector<double> DefaultChunkSizes();

}  // namespace pipesgd::train
