#!/usr/bin/env bash
# AllReduce bandwidth on the emulated 4-node lab at a given link rate (root only):
#   bench/lab_allreduce.sh RATE [MIN MAX]     RATE: a tc rate (100mbit, 1gbit, 10gbit) or none
# Brings the lab up (scripts/lab), measures the link's TCP goodput with iperf3 (node 1 -> node 0,
# 10 s), runs `pipesgd bench allreduce` with one rank per node, takes the lab down, and writes
# docs/results/allreduce_lab_<RATE>.md (and .json) with the commands and the numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE="${1:?usage: bench/lab_allreduce.sh RATE [MIN MAX]}"
MIN="${2:-64K}"
MAX="${3:-256M}"
BIN=build/launcher/pipesgd
export LAB_PREFIX="${LAB_PREFIX:-psgdbench}" LAB_SUBNET="${LAB_SUBNET:-10.83.0}"
OUT=docs/results/allreduce_lab_${RATE}
[[ -x "$BIN" ]] || { echo "build first (scripts/quickstart.sh or scripts/test.sh)" >&2; exit 1; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; scripts/lab down >/dev/null 2>&1 || true; }
trap cleanup EXIT
scripts/lab up 4
scripts/lab shape "$RATE"
master=$(scripts/lab addr 0)
tmp=$(mktemp -d)

# Link goodput, one TCP flow, measured inside the lab (never from the root namespace).
scripts/lab exec 0 iperf3 -s -1 -B "$master" > /dev/null 2>&1 &
pids+=($!)
sleep 0.5
scripts/lab exec 1 iperf3 -c "$master" -t 10 -J > "$tmp/iperf.json"
wait "${pids[@]}" 2>/dev/null || true
pids=()
goodput_bps=$(python3 -c "import json,sys; print(json.load(open('$tmp/iperf.json'))['end']['sum_received']['bits_per_second'])")
goodput_gbps=$(python3 -c "print(f'{$goodput_bps/1e9:.4f}')")
echo "iperf3 goodput: $goodput_gbps Gbit/s"

link_args=()
[[ "$RATE" != none ]] && link_args=(--link-gbps "$goodput_gbps")
cmd=(bench allreduce -b "$MIN" -e "$MAX" -f 4 -n 5 -w 1 -c "${link_args[@]}" --json "$tmp/rows.json")
for i in 0 1 2 3; do
  RANK=$i WORLD_SIZE=4 MASTER_ADDR=$master MASTER_PORT=29500 OPENBLAS_NUM_THREADS=1 \
    timeout 1200 scripts/lab exec "$i" "$BIN" "${cmd[@]}" > "$tmp/rank$i.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
pids=()
cat "$tmp/rank0.log"

mkdir -p docs/results
cp "$tmp/rows.json" "$OUT.json"
{
  echo "# AllReduce on the emulated 4-node lab, links shaped to $RATE"
  echo
  echo "Measured $(date -u +%Y-%m-%d) on a 2-core Debian 12 machine: 4 network namespaces on a bridge,"
  echo "each node's link shaped by tc tbf to $RATE, one rank per node, TCP. Command:"
  echo
  echo '```'
  echo "bench/lab_allreduce.sh $RATE $MIN $MAX"
  echo '```'
  echo
  echo "Link goodput (iperf3, one TCP flow, node 1 -> node 0, 10 s): **$goodput_gbps Gbit/s**."
  [[ "$RATE" != none ]] && echo "The %link columns are busbw as a share of that goodput."
  echo
  echo '```'
  cat "$tmp/rank0.log"
  echo '```'
} > "$OUT.md"
rm -rf "$tmp"
echo "wrote $OUT.md and $OUT.json"
