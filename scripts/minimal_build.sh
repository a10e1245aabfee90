#!/usr/bin/env bash
# The minimal build: TCP + CPU only (no CUDA, UCX, ibverbs, no launcher), configured in
# build-minimal, and its whole test suite. Needs a C++20 compiler, CMake, Boost.Asio (headers),
# protobuf, spdlog/fmt, zlib, OpenBLAS (the CPU layers) and GoogleTest (tests only).
#   scripts/minimal_build.sh [-j N]
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-2}
[[ ${1:-} == -j ]] && jobs=$2
cmake -S . -B build-minimal -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPIPESGD_WITH_UCX=OFF -DPIPESGD_WITH_IBVERBS=OFF -DPIPESGD_CUDA=OFF \
  -DPIPESGD_BUILD_LAYERS=ON -DPIPESGD_BUILD_LAUNCHER=OFF -DPIPESGD_BUILD_TESTS=ON
cmake --build build-minimal -j "$jobs"
# Nothing optional slipped in: the transport library must not define UCX/ibverbs/CUDA.
if grep -q 'PIPESGD_HAVE_\(UCX\|IBVERBS\|CUDA\)' build-minimal/compile_commands.json; then
  echo "minimal_build: an optional part (UCX, ibverbs or CUDA) is compiled in" >&2
  exit 1
fi
ctest --test-dir build-minimal -j "$jobs" --output-on-failure
