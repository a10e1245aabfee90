#!/usr/bin/env bash
# The spread over seeds behind CompressedMainJob's tolerances (tests/cli_test.cc): the main job
# (4 local workers, width 2, 3 epochs) with each setting the test runs, for every seed in SEEDS,
# and each setting's final test accuracy minus the uncompressed run's of the same seed.
# A CPU with other floating-point kernels (OpenBLAS's, oneDNN's) changes a run's digits the way
# a seed does, so the test's bounds come from this spread, not from one machine's single value.
# Needs a build (scripts/quickstart.sh or scripts/test.sh).
# Usage: SEEDS="1 2 3 4 5 6" scripts/compression_seeds.sh [--set key=value]... > table.md
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/launcher/pipesgd
CONFIG=configs/fashion_mnist_mlp.pbtxt
SEEDS=${SEEDS:-"1 2 3 4 5 6"}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

SETTINGS=(
  "none|comm.compression=none"
  "trunc16|comm.compression=trunc16"
  "q8 + error feedback|comm.compression=q8 comm.error_feedback=true"
  "q4 + error feedback|comm.compression=q4 comm.error_feedback=true"
  "sign1 + error feedback|comm.compression=sign1 comm.error_feedback=true"
  "PowerSGD rank 4|comm.powersgd_rank=4"
)
for seed in $SEEDS; do
  for entry in "${SETTINGS[@]}"; do
    label=${entry%%|*}
    sets=(--set "train.seed=$seed")
    for s in ${entry#*|}; do sets+=(--set "$s"); done
    rm -rf "$tmp/out"
    "$BIN" run -np 4 "$CONFIG" "${sets[@]}" "$@" --out "$tmp/out" > "$tmp/log" 2>&1 ||
      { cat "$tmp/log" >&2; exit 1; }
    python3 -c 'import json,sys; print(sys.argv[2], sys.argv[3], json.load(open(sys.argv[1]))["final_test_accuracy"], sep="\t")' \
      "$tmp/out/summary.json" "$seed" "$label" >> "$tmp/accuracies.tsv"
  done
done
python3 - "$tmp/accuracies.tsv" <<'PY'
import statistics, sys
acc = {}
for line in open(sys.argv[1]):
    seed, label, value = line.rstrip("\n").split("\t")
    acc.setdefault(label, {})[seed] = float(value)
seeds = list(acc["none"])
print(f"Final test accuracy, seeds {' '.join(seeds)}; difference = setting - none, same seed")
print()
print("| setting | " + " | ".join(f"seed {s}" for s in seeds) +
      " | mean difference | min | max | std. dev. |")
print("|---|" + "---:|" * (len(seeds) + 4))
for label, by_seed in acc.items():
    diffs = [by_seed[s] - acc["none"][s] for s in seeds]
    cells = " | ".join(f"{by_seed[s]:.4f}" for s in seeds)
    spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    print(f"| {label} | {cells} | {statistics.mean(diffs):+.4f} | {min(diffs):+.4f} | "
          f"{max(diffs):+.4f} | {spread:.4f} |")
PY
