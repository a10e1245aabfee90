#!/bin/bash
# Training-step throughput (samples/s) of one CPU worker, pipesgd against PyTorch on the CPU:
# the same model (built from the same job config), batch, thread count and optimizer, random
# inputs, no data loading, no network. Run it alone on the machine:
#   flock -x /tmp/pipesgd-cpu.lock bench/train_vs_torch.sh [BUILD_DIR] [OUT.jsonl]
# Prints a table; with OUT, also every measurement as one JSON object per line.
# Needs PyTorch for /usr/bin/python3 (Debian python3-torch; not in scripts/install_deps.sh, being
# large and needed only here). STEPS, REPEATS, THREADS ("1 2"), BATCHES ("16 64") override.
# THREADS sets OPENBLAS_NUM_THREADS and OMP_NUM_THREADS (oneDNN's) for pipesgd, torch's
# set_num_threads for PyTorch. SET="model.kernels=OPENBLAS" passes --set to pipesgd's side.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
out=${2:-}
bench=$build/bench/pipesgd_train_bench
python=${PYTHON:-/usr/bin/python3}
steps=${STEPS:-200}
repeats=${REPEATS:-3}
[ -x "$bench" ] || { echo "no $bench (cmake --build $build --target pipesgd_train_bench)" >&2; exit 1; }
"$python" -c "import torch" 2>/dev/null || { echo "no PyTorch for $python (apt-get install python3-torch)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[ -n "$out" ] && : > "$out"

printf '%-5s %5s %7s  %12s  %12s  %s\n' model batch threads pipesgd pytorch ratio
for cfg in fashion_mnist_mlp fashion_mnist_cnn; do
  "$bench" "$root/configs/$cfg.pbtxt" --print-job > "$tmp/job.json"
  for threads in ${THREADS:-1 2}; do
    for batch in ${BATCHES:-16 64}; do
      p=$(OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads "$bench" "$root/configs/$cfg.pbtxt" --batch "$batch" \
            --steps "$steps" --repeats "$repeats" ${SET:+--set "$SET"})
      t=$(OMP_NUM_THREADS=$threads "$python" "$root/bench/torch_train_throughput.py" "$tmp/job.json" \
            --batch "$batch" --threads "$threads" --steps "$steps" --repeats "$repeats")
      if [ -n "$out" ]; then
        echo "$p" | "$python" -c "import json,sys; d=json.load(sys.stdin); d.update(config='$cfg', threads=$threads); print(json.dumps(d))" >> "$out"
        echo "$t" | "$python" -c "import json,sys; d=json.load(sys.stdin); d.update(config='$cfg'); print(json.dumps(d))" >> "$out"
      fi
      ps=$(echo "$p" | "$python" -c "import json,sys; print(json.load(sys.stdin)['median_samples_per_s'])")
      ts=$(echo "$t" | "$python" -c "import json,sys; print(json.load(sys.stdin)['median_samples_per_s'])")
      printf '%-5s %5s %7s  %12s  %12s  %sx\n' "${cfg#fashion_mnist_}" "$batch" "$threads" "$ps" "$ts" \
        "$("$python" -c "print(f'{$ps / $ts:.2f}')")"
    done
  done
done
echo "(samples/s of the training step, median of $repeats x $steps steps; ratio = pipesgd / pytorch)"
