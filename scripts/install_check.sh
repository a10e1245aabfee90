#!/usr/bin/env bash
# Installs pipesgd into a fresh temporary prefix, checks that only the public headers
# (include/pipesgd/*.h) are installed, builds docs/examples against the INSTALLED
# package (find_package(pipesgd), and once more with pkg-config), runs them and fails on any
# wrong result:
#   allreduce_buffers    4 processes, exact integer sums on the program's own buffers
#   train_least_squares  2 processes, width-2 Pipe-SGD on a caller-defined least-squares model,
#                        max |w - w*| < 1e-3
#   allreduce_buffers    again under `pipesgd run -np 4 -- PROGRAM` and `mpirun -np 4`
#   BUILD_DIR=build scripts/install_check.sh      (default: build; configured and built if absent)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${BUILD_DIR:-build}
jobs=${JOBS:-2}
if [[ ! -f $build/CMakeCache.txt ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
# Only what is installed (a no-op when the build is current).
cmake --build "$build" -j "$jobs" --target pipesgd_api pipesgd_core

work=$(mktemp -d /tmp/pipesgd-install-check.XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" > "$work/install.log"
echo "install_check: installed $(find "$prefix" -type f | wc -l) files into a fresh prefix"
# The installed interface is include/pipesgd/*.h and nothing else (no internal header leaks).
headers=$(cd "$prefix/include" && find . -type f | sort | tr '\n' ' ')
if [[ $headers != "./pipesgd/error.h ./pipesgd/pipesgd.h ./pipesgd/types.h " ]]; then
  echo "install_check: installed headers are '$headers', expected only pipesgd/{error,pipesgd,types}.h" >&2
  exit 1
fi

# The examples see only the prefix: no source tree, no build tree on any search path.
cmake -S docs/examples -B "$work/examples" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" > "$work/examples-configure.log"
cmake --build "$work/examples" -j "$jobs"
if grep -rq -- "$root/\(core\|transport\|include\|$build\)" "$work/examples/build.ninja"; then
  echo "install_check: the examples' build refers to the source or build tree" >&2
  exit 1
fi

# pkg-config: the same program built with nothing but the .pc file.
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
# shellcheck disable=SC2046
${CXX:-c++} -std=c++20 -O1 docs/examples/allreduce_buffers.cc -o "$work/allreduce_buffers_pc" \
  $(pkg-config --cflags --libs pipesgd)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# run_ranks NAME WORLD_SIZE BINARY: one process per rank; fails if any rank fails.
run_ranks() {
  local name=$1 world=$2 bin=$3 port pids=() rc=0
  port=$(free_port)
  for ((r = 0; r < world; r++)); do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=$world \
      PIPESGD_JOB_TOKEN=install-check timeout 120 "$bin" > "$work/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  for ((r = 0; r < world; r++)); do
    if ! wait "${pids[$r]}"; then rc=1; echo "install_check: $name rank $r FAILED:" >&2; fi
    cat "$work/$name.$r.log"
  done
  return $rc
}

run_ranks allreduce_buffers 4 "$work/examples/allreduce_buffers"
run_ranks allreduce_buffers_pkgconfig 4 "$work/allreduce_buffers_pc"
run_ranks train_least_squares 2 "$work/examples/train_least_squares"

# The same program under launchers that set other variables (transport/launch_env.h):
# `pipesgd run -- PROGRAM` and, where Open MPI is installed, mpirun (OMPI_COMM_WORLD_*).
launched() {
  local name=$1
  shift
  if ! timeout 180 "$@" > "$work/$name.log" 2>&1; then
    cat "$work/$name.log"
    echo "install_check: $name FAILED: $*" >&2
    return 1
  fi
  cat "$work/$name.log"
  [[ $(grep -c " 0 wrong" "$work/$name.log") -eq 4 ]] || { echo "install_check: $name: not 4 exact ranks" >&2; return 1; }
}
launched pipesgd_run "$prefix/bin/pipesgd" run -np 4 -- "$work/examples/allreduce_buffers"
if command -v mpirun > /dev/null; then
  launched mpirun mpirun --allow-run-as-root --oversubscribe -np 4 "$work/examples/allreduce_buffers"
else
  echo "install_check: mpirun not installed (Debian openmpi-bin); the Open MPI run is skipped"
fi
echo "install_check: OK (examples built against $prefix, exact results)"
