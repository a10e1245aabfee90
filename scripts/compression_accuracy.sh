#!/usr/bin/env bash
# Final test accuracy of the main job (4 local workers, width 2, 3 epochs, same seed) with each
# compression setting, beside the uncompressed run, and the bytes each rank sent per step.
# Needs a build (scripts/quickstart.sh or scripts/test.sh).
# Usage: scripts/compression_accuracy.sh [--set key=value]... > table.md
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/launcher/pipesgd
CONFIG=configs/fashion_mnist_mlp.pbtxt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run() {  # run LABEL SETTINGS...: one job; prints a table row
  local label="$1"; shift
  local sets=()
  for s in "$@" ; do sets+=(--set "$s"); done
  rm -rf "$tmp/out"
  "$BIN" run -np 4 "$CONFIG" "${sets[@]}" "${EXTRA[@]}" --out "$tmp/out" > "$tmp/log" 2>&1 ||
    { cat "$tmp/log" >&2; exit 1; }
  python3 - "$tmp/out" "$label" <<'PY'
import json, sys
out, label = sys.argv[1:3]
s = json.load(open(f"{out}/summary.json"))
last = [json.loads(l) for l in open(f"{out}/metrics.jsonl")][-1]
print(f"| {label} | {s['final_test_accuracy']:.4f} | {last['wire_bytes_per_step'] / 1e6:.3f} | "
      f"{last['compression_ratio']:.2f} | {s['saturated_elements']} |")
PY
}

EXTRA=("$@")
echo "| setting | final test accuracy | MB sent per rank per step | compression ratio | saturated elements |"
echo "|---|---:|---:|---:|---:|"
run "none" comm.compression=none
run "trunc16" comm.compression=trunc16
run "trunc16, round to nearest even" comm.compression=trunc16 comm.round_to_nearest_even=true
run "fp16" comm.compression=fp16
run "q8" comm.compression=q8
run "q8 + error feedback" comm.compression=q8 comm.error_feedback=true
run "q8 stochastic + error feedback" comm.compression=q8 comm.stochastic_rounding=true comm.error_feedback=true
