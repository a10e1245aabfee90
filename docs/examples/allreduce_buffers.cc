// AllReduce of a program's own buffers with pipesgd. Run one process per rank:
//   MASTER_PORT=29512 WORLD_SIZE=4 RANK=r ./allreduce_buffers   (r = 0..3)
// Rank r holds grad[i] = (r + 1) * (i % 1000) (4 MiB, uncompressed) and
// small[i] = r + i % 7 (fp16 on the wire). Both are integer-valued with sums far below 2^24
// (and below 2048 for `small`, which fp16 holds exactly), so the results must be EXACT:
//   grad[i]  = W(W+1)/2 * (i % 1000),   small[i] = W(W-1)/2 + W * (i % 7).
// Exit status 0 only if every element on this rank is right.
#include <cstdio>
#include <exception>
#include <vector>

#include <pipesgd/pipesgd.h>

int main() {
  try {
    // Rank, world size and rendezvous from pipesgd run, torchrun, srun or mpirun.
    pipesgd::ConnectOptions options = pipesgd::ConnectOptionsFromEnv();
    options.chunk_bytes = 256 << 10;            // 256 KiB chunks
    options.codec = pipesgd::CodecKind::kFp16;  // used only by calls with compress = true
    pipesgd::Communicator comm = pipesgd::Connect(options);
    const long w = comm.world_size(), r = comm.rank();

    std::vector<float> grad(1 << 20);
    for (size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>((r + 1) * (i % 1000));
    comm.AllReduce(grad, pipesgd::ReduceOp::kSum, 60, /*compress=*/false);

    std::vector<float> small(100000);
    for (size_t i = 0; i < small.size(); ++i) small[i] = static_cast<float>(r + i % 7);
    comm.AllReduce(small, pipesgd::ReduceOp::kSum, 60, /*compress=*/true);
    const pipesgd::WireStats wire = comm.last_wire_stats();

    long bad = 0;
    for (size_t i = 0; i < grad.size(); ++i) {
      const float want = static_cast<float>(w * (w + 1) / 2 * static_cast<long>(i % 1000));
      if (grad[i] != want && bad++ < 5) std::fprintf(stderr, "rank %ld: grad[%zu] = %g, want %g\n", r, i, grad[i], want);
    }
    for (size_t i = 0; i < small.size(); ++i) {
      const float want = static_cast<float>(w * (w - 1) / 2 + w * static_cast<long>(i % 7));
      if (small[i] != want && bad++ < 10) std::fprintf(stderr, "rank %ld: small[%zu] = %g, want %g\n", r, i, small[i], want);
    }
    std::printf("rank %ld/%ld (pipesgd %s): %zu + %zu elements, %ld wrong; fp16 call compressed=%d ratio %.2f\n",
                r, w, pipesgd::Version(), grad.size(), small.size(), bad, wire.compressed ? 1 : 0,
                wire.compression_ratio);
    if (w > 1 && !wire.compressed) {
      std::fprintf(stderr, "rank %ld: the fp16 call was not compressed\n", r);
      return 1;
    }
    return bad == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_buffers: %s\n", e.what());
    return 2;
  }
}
