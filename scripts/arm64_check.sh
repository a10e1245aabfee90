#!/usr/bin/env bash
# arm64 (aarch64) check on an amd64 Debian 12 host: installs the cross toolchain, the arm64
# multiarch -dev packages and qemu-user (scripts/arm64_deps.sh, under /tmp/pipesgd-apt.lock),
# cross-builds the minimal build (TCP + CPU; cmake/aarch64-linux-gnu.cmake) in build-arm64,
# runs its tests under qemu-user, then installs it into a temporary prefix, cross-builds
# docs/examples against that prefix and runs a 2-rank loopback AllReduce (allreduce_buffers,
# exact sums) under qemu-user.
#   scripts/arm64_check.sh            everything: every unit-labelled test + the api tests
#   scripts/arm64_check.sh --light    the CI subset (build-arm64-light, -O1): the installed
#                                     libraries, the layers included, api_test (AllReduce exact
#                                     sums, fp16 on the wire, width-2 training of a callback
#                                     model) and the 2-rank AllReduce (docs/library.md); no
#                                     other test binaries are built
#   --build-only (with either)        install the packages and cross-build, run nothing
set -euo pipefail
cd "$(dirname "$0")/.."
mode=full
build_only=0
for arg in "$@"; do
  case $arg in
    --light) mode=light ;;
    --build-only) build_only=1 ;;  # CI cross-builds beside another suite, then runs the rest
    *) echo "arm64_check: unknown argument '$arg' (expected --light or --build-only)" >&2; exit 2 ;;
  esac
done
jobs=${JOBS:-2}
start=$SECONDS

scripts/arm64_deps.sh
echo "arm64_check: packages ready after $((SECONDS - start)) s"

# --light (CI) builds its own tree at -O1 (about a third less compile time), and only what
# `cmake --install` installs plus api_test. It is also CI's check of the minimal configuration
# (TCP + CPU, no UCX, verbs, CUDA or launcher; scripts/minimal_build.sh builds it natively):
# every library of it, the layers included, compiles and links, here for arm64.
if [[ $mode == full ]]; then
  build=build-arm64 opt="-O3 -DNDEBUG"
else
  build=build-arm64-light opt="-O1 -DNDEBUG"
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="$opt" \
  -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DPIPESGD_WITH_UCX=OFF -DPIPESGD_WITH_IBVERBS=OFF -DPIPESGD_WITH_ONEDNN=OFF -DPIPESGD_CUDA=OFF \
  -DPIPESGD_BUILD_LAYERS=ON -DPIPESGD_BUILD_LAUNCHER=OFF -DPIPESGD_BUILD_TESTS=ON > /dev/null
if [[ $mode == full ]]; then
  cmake --build "$build" -j "$jobs"
else
  # Every installed library (pipesgd_core links the layers), and api_test.
  cmake --build "$build" -j "$jobs" --target pipesgd_api pipesgd_core pipesgd_data api_test
fi
echo "arm64_check: cross build done after $((SECONDS - start)) s"
[[ $build_only -eq 1 ]] && exit 0

# Tests under qemu-user (ctest runs them through CMAKE_CROSSCOMPILING_EMULATOR).
if [[ $mode == full ]]; then
  ctest --test-dir "$build" -j "$jobs" --output-on-failure -L unit
  ctest --test-dir "$build" -j "$jobs" --output-on-failure -R '^Api'
else
  ctest --test-dir "$build" -j "$jobs" --output-on-failure -R '^Api'
fi
echo "arm64_check: tests under qemu done after $((SECONDS - start)) s"

# The installed arm64 package, an example built against it, and a 2-rank loopback AllReduce.
work=$(mktemp -d /tmp/pipesgd-arm64.XXXXXX)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > /dev/null
cmake -S docs/examples -B "$work/examples" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_TOOLCHAIN_FILE="$PWD/cmake/aarch64-linux-gnu.cmake" \
  -DCMAKE_PREFIX_PATH="$work/prefix" > /dev/null
cmake --build "$work/examples" -j "$jobs" --target allreduce_buffers
bin=$work/examples/allreduce_buffers
if ! file -L "$bin" | grep -q 'ARM aarch64'; then
  echo "arm64_check: $bin is not an aarch64 binary: $(file -L "$bin")" >&2
  exit 1
fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
pids=()
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=2 \
    timeout 300 qemu-aarch64 "$bin" > "$work/rank$r.log" 2>&1 &
  pids+=($!)
done
rc=0
for r in 0 1; do
  wait "${pids[$r]}" || { rc=1; echo "arm64_check: AllReduce rank $r FAILED" >&2; }
  cat "$work/rank$r.log"
done
[[ $rc -eq 0 ]] || exit 1
echo "arm64_check: OK ($mode) after $((SECONDS - start)) s"
