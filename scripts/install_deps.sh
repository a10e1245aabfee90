#!/usr/bin/env bash
# Installs every Debian 12 package that pipesgd's build, tests and data need.
# Idempotent: packages already present are skipped, and `apt-get update` runs only when one is
# missing; a dpkg left mid-install by an interrupted apt is finished first (scripts/apt_install.sh).
# Needs root (or sudo).
set -euo pipefail

PACKAGES=(
  # toolchain
  build-essential cmake pkg-config ninja-build
  # libraries (see docs/building.md)
  libprotobuf-dev protobuf-compiler
  libboost-dev
  libopenblas-dev
  # oneDNN: the CPU convolutions and pooling (layers/onednn_*.cc; optional at build time)
  libdnnl-dev
  libcli11-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
  zlib1g-dev
  # libcrypto: HMAC-SHA256 proofs of the job token (transport/auth.h)
  libssl-dev
  # optional transports: UCX (transport/ucx) and ibverbs (transport/ibverbs); ucx_info, ibv_devinfo
  libucx-dev ucx-utils libibverbs-dev rdma-core ibverbs-utils
  libgtest-dev libgmock-dev libbenchmark-dev
  # data: Fashion-MNIST as gzipped IDX under /usr/share/datasets/fashion-mnist/
  dataset-fashion-mnist
  # tests and benchmarks: process tools, network namespaces and shaping, link measurement
  procps iproute2 iperf3
  # cluster tests: key-only sshd in every lab node (scripts/lab sshd) and the ssh client;
  # Slurm (slurmctld, a slurmd per lab node, srun/sbatch, munge) for the launcher tests
  openssh-server openssh-client
  slurmctld slurmd slurm-client munge
  # fuzzing (scripts/fuzz.sh): clang and its libFuzzer runtime
  clang libclang-rt-14-dev
  # LLVM's linker: links the test executables in about half GNU ld's time (CMakeLists.txt)
  lld
  # benchmarks: peer libraries measured side by side (bench/peers/), plots of the results
  libgloo-dev openmpi-bin libopenmpi-dev gnuplot-nox
)

exec "$(dirname "$0")/apt_install.sh" install_deps "${PACKAGES[@]}"
