#!/usr/bin/env bash
# The README's second command (and what CI runs): installs the Debian packages if missing, builds
# pipesgd with its tests, and runs the whole suite with ctest: every tier this machine allows
# (unit, multiproc; the cluster, rdma and gpu tiers skip themselves with a message where they
# cannot run: the rdma tier needs `scripts/rdma_vm --install`).
# Extra arguments go to ctest, e.g.  scripts/test.sh -L unit
# --build-only (first argument): install and build, run nothing (CI builds first, then starts
# the sanitizer build beside this script's test run).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --parallel "$(nproc)"
[[ ${1:-} == --build-only ]] && exit 0
ctest --test-dir build --output-on-failure --parallel "$(nproc)" "$@"
