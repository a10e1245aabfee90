// Open MPI's MPI_Allreduce (in place, float sum), timed like `pipesgd bench allreduce` and
// printed as size count type redop time algbw busbw (the fields bench/compare_allreduce.sh
// reads). Started by mpirun, one rank per lab node:
//   mpirun ... mpi_allreduce MIN_BYTES MAX_BYTES FACTOR ITERS WARMUP [LINK_GBPS]
// Not part of pipesgd: a peer for bench/compare_allreduce.sh (Debian openmpi-bin, libopenmpi-dev).
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (argc < 6) {
    if (rank == 0) std::fprintf(stderr, "usage: %s MIN MAX FACTOR ITERS WARMUP [LINK_GBPS]\n", argv[0]);
    MPI_Finalize();
    return 2;
  }
  const double min_bytes = std::atof(argv[1]), max_bytes = std::atof(argv[2]);
  const double factor = std::atof(argv[3]);
  const int iters = std::atoi(argv[4]), warmup = std::atoi(argv[5]);
  const double link_gbps = argc > 6 ? std::atof(argv[6]) : 0;
  const double bus = world > 1 ? 2.0 * (world - 1) / world : 0;
  if (rank == 0) {
    std::printf("# open mpi MPI_Allreduce (in place): %d ranks, %d iterations after %d warm-up\n",
                world, iters, warmup);
    std::printf("# %10s %12s %6s %6s %9s %7s %7s %s\n", "size(B)", "count", "type", "redop",
                "time(us)", "algbw", "busbw", link_gbps > 0 ? "%link" : "");
  }
  std::vector<float> data;
  for (double size = min_bytes; size <= max_bytes * 1.0000001; size *= factor) {
    const int count = static_cast<int>(static_cast<size_t>(size) / sizeof(float));
    data.assign(count, static_cast<float>(rank));
    for (int i = 0; i < warmup; ++i) {
      MPI_Allreduce(MPI_IN_PLACE, data.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < iters; ++i) {
      MPI_Allreduce(MPI_IN_PLACE, data.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    double seconds = (MPI_Wtime() - t0) / iters;
    MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    const double time_us = seconds / world * 1e6;  // mean over ranks, as pipesgd reports
    const double algbw = count * sizeof(float) / (time_us * 1e-6) / 1e9;
    if (rank == 0) {
      std::printf("  %10zu %12d %6s %6s %9.1f %7.3f %7.3f", count * sizeof(float), count, "float",
                  "sum", time_us, algbw, algbw * bus);
      if (link_gbps > 0) std::printf(" %5.1f", 100.0 * algbw * bus * 8 / link_gbps);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  MPI_Finalize();
  return 0;
}
