#!/usr/bin/env bash
# The GPU check, in one go, for a maintainer on a machine with an NVIDIA GPU and the CUDA toolkit
# (written for one H200 + 16 cores; about 5-8 minutes there):
#   1. configure and build with the CUDA backend required (-DPIPESGD_CUDA=ON, sm_90 unless
#      CUDA_ARCH says otherwise): the pipesgd binary and the gpu test tier only;
#   2. run the gpu test tier (ctest -L gpu): CUDA layers vs CPU layers, a training step on the
#      GPU vs the CPU, CUDA codecs vs CPU codecs, the staged AllReduce of device buffers;
#   3. a short 4-rank training run with model.device = CUDA over loopback TCP, the 4 ranks
#      sharing GPU 0;
#   4. samples/s of the MLP (and of the CNN, if configs/fashion_mnist_cnn.pbtxt exists) on one
#      worker, GPU and CPU, same config.
# Prints everything and exits non-zero at the first failure.
#
# Usage: scripts/gpu_check.sh [BUILD_DIR]        (default build-gpu)
# Environment: CUDA_ARCH (default 90), JOBS (default nproc), FASHION_MNIST_DIR (default
# /usr/share/datasets/fashion-mnist; when it is missing, random IDX data of the same shape is
# generated with python3 so the runs still measure speed, but their accuracy means nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
CUDA_ARCH=${CUDA_ARCH:-90}
JOBS=${JOBS:-$(nproc)}
DATA=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
START=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - START )) s] $*"; }

step "machine"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || {
  echo "gpu_check: nvidia-smi failed: no usable GPU here" >&2; exit 1; }
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
nvcc --version | tail -2

step "build (PIPESGD_CUDA=ON, CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH, -j$JOBS)"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DPIPESGD_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" | grep -E "CUDA|transport:" || true
cmake --build "$BUILD" --parallel "$JOBS" --target pipesgd cuda_layers_test cuda_codec_test \
  cuda_staging_test staged_allreduce_test
"$BUILD/launcher/pipesgd" info

step "gpu test tier (ctest -L gpu) and the staging pipeline on the CPU"
# A skipped GPU test here would mean the GPU was not seen: treat it as a failure.
ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 300 | tee "$BUILD/gpu_ctest.log"
# (CudaDevice.NoDeviceIsReportedNotCrashed is the one test that skips where there IS a device.)
if grep "(Skipped)" "$BUILD/gpu_ctest.log" | grep -qv NoDeviceIsReportedNotCrashed; then
  echo "gpu_check: GPU tests were skipped although a GPU is present" >&2; exit 1
fi
ctest --test-dir "$BUILD" -R StagedAllReduce --output-on-failure

step "data"
if [[ ! -f "$DATA/train-images-idx3-ubyte.gz" && ! -f "$DATA/train-images-idx3-ubyte" ]]; then
  DATA="$BUILD/random-fashion-mnist"
  echo "Fashion-MNIST not found; generating random IDX data of the same shape in $DATA"
  echo "(speed numbers are valid; accuracies of these runs are meaningless)"
  mkdir -p "$DATA"
  python3 - "$DATA" <<'PY'
import os, struct, sys
d = sys.argv[1]
for name, n in (("train", 60000), ("t10k", 10000)):
    with open(os.path.join(d, f"{name}-images-idx3-ubyte"), "wb") as f:
        f.write(struct.pack(">IIII", 0x803, n, 28, 28)); f.write(os.urandom(n * 784))
    with open(os.path.join(d, f"{name}-labels-idx1-ubyte"), "wb") as f:
        f.write(struct.pack(">II", 0x801, n)); f.write(bytes(b % 10 for b in os.urandom(n)))
PY
  SUFFIX=""
else
  SUFFIX=".gz"
  [[ -f "$DATA/train-images-idx3-ubyte.gz" ]] || SUFFIX=""
fi
DATA_SET=(--set "data.train_images=$DATA/train-images-idx3-ubyte$SUFFIX"
          --set "data.train_labels=$DATA/train-labels-idx1-ubyte$SUFFIX"
          --set "data.test_images=$DATA/t10k-images-idx3-ubyte$SUFFIX"
          --set "data.test_labels=$DATA/t10k-labels-idx1-ubyte$SUFFIX")
PSGD="$BUILD/launcher/pipesgd"

step "4 ranks, model.device = CUDA, all on GPU 0, loopback TCP (1 epoch)"
timeout 300 "$PSGD" run -np 4 configs/fashion_mnist_mlp.pbtxt "${DATA_SET[@]}" \
  --set model.device=CUDA --set model.gpu_index=0 --set train.epochs=1 \
  --out "$BUILD/gpu_check_4ranks" --overwrite

step "samples/s, one worker (batch 16 as in the config, then batch 256)"
CONFIGS=(configs/fashion_mnist_mlp.pbtxt)
[[ -f configs/fashion_mnist_cnn.pbtxt ]] && CONFIGS+=(configs/fashion_mnist_cnn.pbtxt)
for config in "${CONFIGS[@]}"; do
  for batch in 16 256; do
    for device in CUDA CPU; do
      extra=(--set "model.device=$device")
      [[ $device == CUDA ]] && extra+=(--set model.gpu_index=0)
      echo "--- $(basename "$config") device $device batch $batch (OPENBLAS_NUM_THREADS=$JOBS)"
      log="$BUILD/speed_$(basename "$config" .pbtxt)_${device}_${batch}.log"
      if ! OPENBLAS_NUM_THREADS=$JOBS timeout 240 "$PSGD" run -np 1 "$config" "${DATA_SET[@]}" \
          "${extra[@]}" --set train.epochs=1 --set "train.batch_size=$batch" \
          --set train.max_steps=$(( 20000 / batch )) >"$log" 2>&1; then
        cat "$log"; echo "gpu_check: the run above failed" >&2; exit 1
      fi
      grep -E "samples/s" "$log" | tail -2
    done
  done
done

step "gpu_check: done in $(( $(date +%s) - START )) s"
