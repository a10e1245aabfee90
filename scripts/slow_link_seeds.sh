#!/usr/bin/env bash
# The spread over seeds behind SlowLinkConfigs' bounds (tests/slow_link_configs_test.cc): each
# shipped slow-link config run as shipped (4 local ranks) for every seed in SEEDS, once with this
# CPU's own kernels and once with older ones (OpenBLAS's Sandybridge kernels for the MLP's
# matrix products, oneDNN limited to AVX for the CNN's convolutions): another CPU's kernels move
# a run's digits as another seed does. Prints each run's final test accuracy, then the mean and
# the standard deviation per config. Needs a build.
# Usage: SEEDS="1 2 3 4" scripts/slow_link_seeds.sh [mlp|cnn]...
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/launcher/pipesgd
SEEDS=${SEEDS:-"1 2 3 4"}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
models=("$@")
[[ ${#models[@]} -gt 0 ]] || models=(mlp cnn)
for model in "${models[@]}"; do
  case "$model" in
    mlp) older=OPENBLAS_CORETYPE=Sandybridge ;;
    cnn) older=ONEDNN_MAX_CPU_ISA=AVX ;;
    *) echo "unknown model '$model' (mlp, cnn)" >&2; exit 2 ;;
  esac
  for seed in $SEEDS; do
    for kernels in own "$older"; do
      rm -rf "$tmp/out"
      env $([[ $kernels == own ]] || echo "$kernels") "$BIN" run -np 4 \
        "configs/fashion_mnist_${model}_slow_link.pbtxt" --set "train.seed=$seed" \
        --set train.progress_per_epoch=0 --out "$tmp/out" > "$tmp/log" 2>&1 ||
        { cat "$tmp/log" >&2; exit 1; }
      python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], sys.argv[4], s["final_test_accuracy"], round(s["wall_s"], 1), sep="\t")' \
        "$tmp/out/summary.json" "$model" "$seed" "$kernels" | tee -a "$tmp/acc.tsv"
    done
  done
done
python3 - "$tmp/acc.tsv" <<'PY'
import statistics, sys
by = {}
for line in open(sys.argv[1]):
    model, seed, kernels, acc, wall = line.rstrip("\n").split("\t")
    by.setdefault(model, []).append(float(acc))
for model, xs in by.items():
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    print(f"{model}: {len(xs)} runs, {min(xs):.4f}-{max(xs):.4f}, mean {statistics.mean(xs):.4f}, "
          f"standard deviation {sd:.4f}, mean - 4 sd {statistics.mean(xs) - 4 * sd:.4f}")
PY
