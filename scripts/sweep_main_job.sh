#!/usr/bin/env bash
# Reproduces docs/results/main_job_sweep.md: final test accuracy of the main job (4 local
# workers, 3 epochs) for pipeline width 1 and 2 over per-worker batch size, learning rate and
# momentum, with standardised inputs. Needs a build (scripts/quickstart.sh or scripts/test.sh).
# Usage: scripts/sweep_main_job.sh > sweep.md
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/launcher/pipesgd
CONFIG=configs/fashion_mnist_mlp.pbtxt

# The table in docs/results/main_job_sweep.md predates staleness compensation: NONE, no warm-up.
COMPENSATION="${COMPENSATION:-NONE}"
WARMUP="${WARMUP:-0}"

accuracy() {
  "$BIN" run -np 4 "$CONFIG" --set "train.staleness_compensation=$COMPENSATION" \
    --set "train.sync_warmup_steps=$WARMUP" "$@" 2>&1 | grep -oE 'final test accuracy: [0-9.]+' | awk '{print $4}'
}

echo "| batch/worker | lr | momentum | width 1 | width 2 |"
echo "|---|---|---|---|---|"
for b in 16 32 64; do
  for lr in 0.02 0.05 0.1; do
    for m in 0.5 0.8 0.9; do
      common=(--set train.batch_size=$b --set train.learning_rate=$lr --set train.momentum=$m)
      a1=$(accuracy "${common[@]}" --set train.pipeline_width=1)
      a2=$(accuracy "${common[@]}" --set train.pipeline_width=2)
      echo "| $b | $lr | $m | $a1 | $a2 |"
    done
  done
done
