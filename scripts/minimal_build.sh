#!/usr/bin/env bash
# The minimal build: TCP + CPU only (no CUDA, UCX, ibverbs, oneDNN, no launcher), configured in
# build-minimal, and its whole test suite. Needs a C++20 compiler, CMake, Boost.Asio (headers),
# protobuf, spdlog/fmt, zlib, OpenBLAS (the CPU layers) and GoogleTest (tests only).
#   scripts/minimal_build.sh [-j N]        Release (-O3), every library and test, whole suite
#   scripts/minimal_build.sh --ci [-j N]   what CI runs (its 40-minute budget): -O1, every installed
#                                          library, the unit-labelled tests and api_test (exact
#                                          AllReduce sums over loopback TCP, width-2 training of a
#                                          callback model); the multi-process tests that the full
#                                          build (scripts/test.sh) already runs are not rebuilt.
#   scripts/minimal_build.sh --build-only  (with or without --ci) build, run nothing (CI builds
#                                          it beside another suite, then runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-2}
mode=full
build_only=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --ci) mode=ci; shift ;;
    --build-only) build_only=1; shift ;;
    -j) jobs=$2; shift 2 ;;
    *) echo "minimal_build: unknown argument '$1' (expected --ci, --build-only or -j N)" >&2; exit 2 ;;
  esac
done
start=$SECONDS
# -O1 in CI: about a third less compile time; what this check proves (it builds and links without
# the optional parts, and the tests pass) does not depend on the optimisation level.
opt="-O3 -DNDEBUG"
[[ $mode == ci ]] && opt="-O1 -DNDEBUG"
cmake -S . -B build-minimal -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="$opt" \
  -DPIPESGD_WITH_UCX=OFF -DPIPESGD_WITH_IBVERBS=OFF -DPIPESGD_WITH_ONEDNN=OFF -DPIPESGD_CUDA=OFF \
  -DPIPESGD_BUILD_LAYERS=ON -DPIPESGD_BUILD_LAUNCHER=OFF -DPIPESGD_BUILD_TESTS=ON > /dev/null
if [[ $mode == full ]]; then
  cmake --build build-minimal -j "$jobs"
else
  # The unit tier's executables, read from tests/CMakeLists.txt so a new unit test is not missed
  # (those that need the launcher are not targets here).
  mapfile -t unit < <(grep -oP 'pipesgd_test\(\K\w+(?= unit)' tests/CMakeLists.txt)
  mapfile -t known < <(ninja -C build-minimal -t targets all | grep -oP '^[\w]+(?=: )' | sort -u)
  targets=(pipesgd_api pipesgd_core api_test)
  for t in "${unit[@]}"; do
    printf '%s\n' "${known[@]}" | grep -qx "$t" && targets+=("$t")
  done
  cmake --build build-minimal -j "$jobs" --target "${targets[@]}"
fi
echo "minimal_build: built after $((SECONDS - start)) s"
# Nothing optional slipped in: the transport library must not define UCX/ibverbs/CUDA.
if grep -q 'PIPESGD_HAVE_\(UCX\|IBVERBS\|CUDA\)' build-minimal/compile_commands.json; then
  echo "minimal_build: an optional part (UCX, ibverbs or CUDA) is compiled in" >&2
  exit 1
fi
[[ $build_only -eq 1 ]] && exit 0
export OPENBLAS_NUM_THREADS=1
if [[ $mode == full ]]; then
  ctest --test-dir build-minimal -j "$jobs" --output-on-failure
else
  ctest --test-dir build-minimal -j "$jobs" --output-on-failure -L unit
  ctest --test-dir build-minimal -j "$jobs" --output-on-failure -R '^Api'
fi
echo "minimal_build: OK ($mode) after $((SECONDS - start)) s"
