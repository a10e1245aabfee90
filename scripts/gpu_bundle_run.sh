#!/usr/bin/env bash
# The GPU check from a bundle made by scripts/gpu_bundle.sh, in the repository root on a machine
# with an NVIDIA GPU: the gpu test tier, 4-rank jobs sharing GPU 0 over loopback (TCP, and UCX),
# and the training step's samples/s against PyTorch on the GPU (when python3 has torch).
# It goes on after a failure and prints every step's status at the end (exit 1 if any failed).
#
# Usage: scripts/gpu_bundle_run.sh BUNDLE.tar.xz DATA_DIR [OUT_DIR]
#   DATA_DIR holds Fashion-MNIST's four .gz IDX files; OUT_DIR (default gpu_out) gets the log.
set -u
BUNDLE=$1 DATA=$2 OUT=${3:-gpu_out}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
START=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - START )) s] $*"; }
B=$(mktemp -d)
tar -C "$B" -xJf "$BUNDLE"
CUBLAS=$(ls /usr/local/cuda*/lib64/libcublas.so.13* /usr/local/cuda*/targets/x86_64-linux/lib/libcublas.so.13* \
  /usr/lib/x86_64-linux-gnu/libcublas.so.13* 2>/dev/null | head -1)
echo "cuBLAS: ${CUBLAS:-not found (set LD_LIBRARY_PATH to its directory)}"
CUDNN=$(ls /usr/local/cuda*/lib64/libcudnn.so.9* /usr/local/cuda*/lib/libcudnn.so.9* \
  /usr/lib/x86_64-linux-gnu/libcudnn.so.9* 2>/dev/null | head -1)
echo "cuDNN: ${CUDNN:-not found (the GPU convolutions fall back to cuBLAS)}"
export UCX_MODULE_DIR=$B/lib/ucx
pg() { LD_LIBRARY_PATH="$B/lib${CUBLAS:+:$(dirname "$CUBLAS")}${CUDNN:+:$(dirname "$CUDNN")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }
declare -A RC
run() { local name=$1; shift; step "$name"; "$@"; RC[$name]=$?; echo "--- $name rc=${RC[$name]}"; }
step machine
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
run info pg "$B/bin/pipesgd" info
for t in cuda_layers_test cuda_codec_test cuda_staging_test staged_allreduce_test device_slots_test; do
  run "$t" pg timeout 300 "$B/bin/$t"
done
D=(--set "data.train_images=$DATA/train-images-idx3-ubyte.gz"
   --set "data.train_labels=$DATA/train-labels-idx1-ubyte.gz"
   --set "data.test_images=$DATA/t10k-images-idx3-ubyte.gz"
   --set "data.test_labels=$DATA/t10k-labels-idx1-ubyte.gz")
G=(--set model.device=CUDA --set model.gpu_index=0)
P="$B/bin/pipesgd"
run mlp4_tcp pg timeout 300 "$P" run -np 4 configs/fashion_mnist_mlp.pbtxt "${D[@]}" "${G[@]}" --transport tcp
run cnn4_tcp pg timeout 300 "$P" run -np 4 configs/fashion_mnist_cnn.pbtxt "${D[@]}" "${G[@]}" --transport tcp
run mlp4_q8_ef pg timeout 300 "$P" run -np 4 configs/fashion_mnist_mlp.pbtxt "${D[@]}" "${G[@]}" \
  --transport tcp --set train.epochs=1 --set comm.compression=q8 --set comm.error_feedback=true
run mlp4_trunc16 pg timeout 300 "$P" run -np 4 configs/fashion_mnist_mlp.pbtxt "${D[@]}" "${G[@]}" \
  --transport tcp --set train.epochs=1 --set comm.compression=trunc16
run mlp4_ucx pg timeout 300 "$P" run -np 4 configs/fashion_mnist_mlp.pbtxt "${D[@]}" "${G[@]}" \
  --transport ucx --set train.epochs=1
step "training step, one worker, samples/s"
if ! torch_why=$(python3 -c "import torch; assert torch.cuda.is_available(), 'torch.cuda.is_available() is False'" 2>&1); then
  echo "PyTorch on the GPU: not run here: $(echo "$torch_why" | tail -1)"
fi
for c in mlp cnn; do for b in 16 64 256; do
  pg timeout 120 "$B/bin/pipesgd_train_bench" "configs/fashion_mnist_$c.pbtxt" --batch $b \
    --device cuda --steps 200 --repeats 3 | tee -a "$OUT/speed.jsonl"
  # The CNN on both GPU convolutions: cuDNN (AUTO where it loads) and im2col + cuBLAS.
  [[ $c == cnn ]] && pg timeout 120 "$B/bin/pipesgd_train_bench" "configs/fashion_mnist_$c.pbtxt" \
    --batch $b --device cuda --steps 200 --repeats 3 --set model.kernels=CUBLAS \
    | tee -a "$OUT/speed.jsonl"
  if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    timeout 300 python3 bench/torch_train_throughput.py "$B/jobs/fashion_mnist_$c.json" \
      --batch $b --device cuda --steps 200 --repeats 3 | tee -a "$OUT/speed.jsonl"
  fi
done; done
step summary
fail=0
for k in "${!RC[@]}"; do echo "$k rc=${RC[$k]}"; [[ ${RC[$k]} == 0 ]] || fail=1; done
exit $fail
