// Gloo's AllReduce (gloo::allreduce, the ring PyTorch's gloo backend uses) over TCP, timed like
// `pipesgd bench allreduce` (size count type redop time algbw busbw: the fields
// bench/compare_allreduce.sh reads), so the two can sit side by side.
// One process per rank; rendezvous through a gloo FileStore in a directory all ranks share.
//   RANK=r WORLD_SIZE=n GLOO_STORE_DIR=/tmp/x BIND_HOST=10.77.0.1
//     gloo_allreduce MIN_BYTES MAX_BYTES FACTOR ITERS WARMUP [LINK_GBPS]
// Not part of pipesgd: a peer for bench/compare_allreduce.sh (Debian libgloo-dev).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s MIN_BYTES MAX_BYTES FACTOR ITERS WARMUP [LINK_GBPS]\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(std::getenv("RANK"));
  const int world = std::atoi(std::getenv("WORLD_SIZE"));
  const char* store_dir = std::getenv("GLOO_STORE_DIR");
  const char* bind = std::getenv("BIND_HOST");
  const double min_bytes = std::atof(argv[1]), max_bytes = std::atof(argv[2]);
  const double factor = std::atof(argv[3]);
  const int iters = std::atoi(argv[4]), warmup = std::atoi(argv[5]);
  const double link_gbps = argc > 6 ? std::atof(argv[6]) : 0;

  gloo::transport::tcp::attr attr;
  attr.hostname = bind ? bind : "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(store_dir);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, world);
  context->setTimeout(std::chrono::seconds(120));
  context->connectFullMesh(store, device);

  auto reduce = [&](float* data, size_t count) {
    gloo::AllreduceOptions opts(context);
    opts.setOutput(data, count);
    opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
        &gloo::sum<float>));
    gloo::allreduce(opts);
  };
  const double bus = world > 1 ? 2.0 * (world - 1) / world : 0;
  if (rank == 0) {
    std::printf("# gloo allreduce (gloo::allreduce, tcp): %d ranks, %d iterations after %d warm-up\n",
                world, iters, warmup);
    std::printf("# %10s %12s %6s %6s %9s %7s %7s %s\n", "size(B)", "count", "type", "redop",
                "time(us)", "algbw", "busbw", link_gbps > 0 ? "%link" : "");
  }
  std::vector<float> data;
  for (double size = min_bytes; size <= max_bytes * 1.0000001; size *= factor) {
    const size_t count = static_cast<size_t>(size) / sizeof(float);
    data.assign(count, static_cast<float>(rank));
    for (int i = 0; i < warmup; ++i) reduce(data.data(), count);
    float sync = 0;
    reduce(&sync, 1);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) reduce(data.data(), count);
    float seconds = std::chrono::duration<float>(std::chrono::steady_clock::now() - t0).count() / iters;
    reduce(&seconds, 1);  // mean over ranks, as pipesgd reports
    const double time_us = seconds / world * 1e6;
    const double algbw = count * sizeof(float) / (time_us * 1e-6) / 1e9;
    if (rank == 0) {
      std::printf("  %10zu %12zu %6s %6s %9.1f %7.3f %7.3f", count * sizeof(float), count, "float",
                  "sum", time_us, algbw, algbw * bus);
      if (link_gbps > 0) std::printf(" %5.1f", 100.0 * algbw * bus * 8 / link_gbps);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  return 0;
}
