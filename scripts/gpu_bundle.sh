#!/usr/bin/env bash
# Packs a CUDA build's binaries, the GPU tests and every library they load (but glibc's) into one
# tarball, for a GPU machine that has the NVIDIA driver and a CUDA 13 cuBLAS but not this
# project's build dependencies (protobuf, Boost, UCX, OpenBLAS, ...). Run it on the build
# machine, copy the tarball and the repository, then run scripts/gpu_bundle_run.sh there.
#
# Usage: scripts/gpu_bundle.sh [BUILD_DIR] [OUT.tar.xz]   (default build, gpu_bundle.tar.xz)
# The build must have the CUDA backend (pipesgd info says "CUDA: backend built").
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=${2:-gpu_bundle.tar.xz}
cmake --build "$BUILD" --target pipesgd pipesgd_train_bench cuda_layers_test cuda_codec_test \
  cuda_staging_test staged_allreduce_test device_slots_test
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin" "$STAGE/lib" "$STAGE/jobs"
BINS=("$BUILD/launcher/pipesgd" "$BUILD/bench/pipesgd_train_bench")
for t in cuda_layers_test cuda_codec_test cuda_staging_test staged_allreduce_test \
         device_slots_test; do
  BINS+=("$BUILD/tests/$t")
done
cp "${BINS[@]}" "$STAGE/bin/"
strip "$STAGE"/bin/*
for b in "${BINS[@]}"; do ldd "$b"; done | awk '$3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r soname path; do
    case "$soname" in libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|ld-linux*) continue;; esac
    cp -L "$path" "$STAGE/lib/$soname"
  done
# UCX loads its transports as modules at run time.
[[ -d /usr/lib/x86_64-linux-gnu/ucx ]] && cp -r /usr/lib/x86_64-linux-gnu/ucx "$STAGE/lib/ucx"
# The jobs as JSON, for bench/torch_train_throughput.py on the GPU machine.
for c in mlp cnn; do
  "$BUILD/bench/pipesgd_train_bench" "configs/fashion_mnist_$c.pbtxt" --print-job \
    >"$STAGE/jobs/fashion_mnist_$c.json"
done
tar -C "$STAGE" -cJf "$OUT" bin lib jobs
echo "gpu_bundle: $OUT ($(du -h "$OUT" | cut -f1))"
