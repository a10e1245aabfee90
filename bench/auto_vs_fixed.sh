#!/usr/bin/env bash
# An all-auto job against today's defaults, run in turn on the 4-node lab (root), each with rank
# 0's timeline: whether the tuning chose the defaults' values, what its width trial measured,
# and the job's steps after it (per window of 60), beside the defaults' own job:
#
#   bench/auto_vs_fixed.sh RATE        100mbit, 1gbit or none; STEPS (300), N runs each (2),
#                                      CPU_SHARE per node (0.5)
#
# Prints per run: time per iteration ((train_wall_s - eval_s) / steps, as bench/auto_grid.sh),
# the values, the width trial's steps, the mean step per window of 60, how many steps took over
# 1.15x the median, and the TCP segments retransmitted on the 4 nodes during the run (nstat).
set -euo pipefail
cd "$(dirname "$0")/.."
RATE="${1:?usage: bench/auto_vs_fixed.sh 100mbit|1gbit|none}"
BIN=$PWD/build/launcher/pipesgd
CONFIG="${CONFIG:-$PWD/configs/fashion_mnist_mlp.pbtxt}"
STEPS="${STEPS:-300}"
N="${N:-2}"
CPU_SHARE="${CPU_SHARE:-0.5}"
[[ -x "$BIN" ]] || { echo "build first: $BIN" >&2; exit 1; }
COMMON=(--set "train.max_steps=$STEPS" --set data.test_limit=1000 --set train.progress_per_epoch=0
        --set train.sync_warmup_steps=10)
export LAB_PREFIX="${LAB_PREFIX:-psgdv}" LAB_SUBNET="${LAB_SUBNET:-10.86.0}" RATE
# shellcheck source=bench/lab_common.sh
source bench/lab_common.sh
scripts/lab cpu "$CPU_SHARE"

retransmitted() {  # the 4 nodes' TcpRetransSegs, summed
  local i sum=0 v
  for i in 0 1 2 3; do
    v=$(scripts/lab exec "$i" nstat -az TcpRetransSegs | awk '$1 == "TcpRetransSegs" {print $2}')
    sum=$((sum + ${v:-0}))
  done
  echo "$sum"
}

for rep in $(seq 1 "$N"); do
  for point in auto defaults; do
    args=()
    [[ $point == auto ]] && args=(--set train.pipeline_width=auto --set comm.chunk_bytes=auto
                                  --set comm.streams=auto --set comm.transport=tcp)
    before=$(retransmitted)
    run_mode "$point.$rep" "${args[@]}" --timeline "$tmp/timeline_${point}_$rep.json" \
      --timeline-steps "$STEPS" < /dev/null > /dev/null
    after=$(retransmitted)
    python3 - "$tmp/$point.$rep/summary.json" "$tmp/timeline_${point}_$rep.rank0.json" \
      "$point" "$((after - before))" <<'PY'
import json, statistics, sys
d = json.load(open(sys.argv[1]))
det, point, retrans = d["details"], sys.argv[3], sys.argv[4]
trial = " ".join(f"w{w['width']} {w['step_s'] * 1e3:.2f}"
                 for w in (det.get("auto") or {}).get("widths", []))
events = json.load(open(sys.argv[2]))
events = events["traceEvents"] if isinstance(events, dict) else events
starts = sorted(e["ts"] for e in events if e.get("name") == "forward" and e.get("ph") in ("X", "B"))
steps = [(b - a) / 1e3 for a, b in zip(starts, starts[1:])]
median = statistics.median(steps)
windows = " ".join(f"{statistics.mean(steps[i:i + 60]):.2f}" for i in range(0, len(steps), 60))
print(f"{point:8s} {(d['train_wall_s'] - d['eval_s']) / d['steps'] * 1e3:8.3f} ms/iter  "
      f"width {det['pipeline_width']} chunk {det['chunk_bytes']} streams {det['streams']}"
      + (f"  trial: {trial}" if trial else ""))
print(f"         steps per 60 (ms): {windows}; over 1.15x the median: "
      f"{sum(s > 1.15 * median for s in steps)}; TCP retransmitted: {retrans}")
PY
  done
done
