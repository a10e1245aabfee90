#!/usr/bin/env bash
# TCP against UCX for the ring AllReduce on the emulated 4-node lab (root only):
#   bench/transports_lab.sh [RATES] [MIN MAX]     RATES: tc rates, e.g. "1gbit none" (the default)
# For each rate: brings the lab up (scripts/lab, prefix psgducx, subnet 10.92.0), shapes the
# links, measures one TCP flow's goodput with iperf3 (node 1 -> node 0, 5 s), runs
# `pipesgd bench allreduce` with one rank per node over --transport tcp, then --transport ucx
# (UCX_TLS=tcp and UCX_NET_DEVICES=eth0: between namespaces of one host UCX would otherwise use
# shared memory or loopback and bypass the shaped links), then UCX again with
# UCX_RNDV_THRESH=inf (eager messages only, no rendezvous handshake), and takes the lab down.
# REPEATS=N (default 1) runs the whole sequence N times. Writes docs/results/transports_lab.md
# (tables, commands, raw output) and docs/results/transports_lab_<rate>_<variant>.json (the
# bench's rows, last repeat).
set -euo pipefail
cd "$(dirname "$0")/.."
RATES="${1:-1gbit none}"
MIN="${2:-64K}"
MAX="${3:-64M}"
BIN=build/launcher/pipesgd
export LAB_PREFIX="${LAB_PREFIX:-psgducx}" LAB_SUBNET="${LAB_SUBNET:-10.92.0}"
OUT=docs/results/transports_lab
[[ -x "$BIN" ]] || { echo "build first (scripts/test.sh or cmake --build build)" >&2; exit 1; }
"$BIN" info | grep -q "ucx: built in" || { echo "this pipesgd has no UCX transport" >&2; exit 1; }

pids=()
tmp=$(mktemp -d)
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  scripts/lab down > /dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT

run_ranks() {  # run_ranks LOG ENV... -- CMD...: one rank per node, rank i on node i
  local log="$1"; shift
  local vars=()
  while [[ "$1" != "--" ]]; do vars+=("$1"); shift; done
  shift
  for i in 0 1 2 3; do
    env RANK=$i WORLD_SIZE=4 MASTER_ADDR="$master" MASTER_PORT=29500 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
      "${vars[@]}" timeout 1800 scripts/lab exec "$i" "$@" > "$tmp/$log.$i.log" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  pids=()
  [[ $rc -eq 0 ]] || { cat "$tmp/$log".*.log >&2; exit "$rc"; }
  cat "$tmp/$log.0.log"
}

REPEATS="${REPEATS:-1}"
VARIANTS=(tcp ucx ucx_eager)
commands=()
for repeat in $(seq 1 "$REPEATS"); do
for rate in $RATES; do
  scripts/lab up 4 > /dev/null
  scripts/lab shape "$rate" > /dev/null
  master=$(scripts/lab addr 0)
  scripts/lab exec 0 iperf3 -s -1 -B "$master" > /dev/null 2>&1 &
  pids+=($!)
  sleep 0.5
  scripts/lab exec 1 iperf3 -c "$master" -t 5 -J > "$tmp/iperf_$rate.json"
  wait "${pids[@]}" 2>/dev/null || true
  pids=()
  goodput=$(python3 -c "import json; print(f\"{json.load(open('$tmp/iperf_$rate.json'))['end']['sum_received']['bits_per_second']/1e9:.4f}\")")
  echo "$rate: iperf3 goodput $goodput Gbit/s"
  echo "$goodput" > "$tmp/goodput_${rate}_r$repeat"
  bench=(bench allreduce -b "$MIN" -e "$MAX" -f 4 -n 5 -w 1 -c --link-gbps "$goodput")
  for variant in "${VARIANTS[@]}"; do
    transport=${variant%%_*}
    extra=()
    [[ $transport == ucx ]] && extra=(UCX_TLS=tcp UCX_NET_DEVICES=eth0)
    [[ $variant == ucx_eager ]] && extra+=(UCX_RNDV_THRESH=inf)
    name="${rate}_${variant}_r$repeat"
    run_ranks "$name" "${extra[@]}" -- "$BIN" "${bench[@]}" --transport "$transport" \
      --json "$tmp/$name.json"
    mkdir -p docs/results
    cp "$tmp/$name.json" "${OUT}_${rate}_${variant}.json"
    [[ $repeat == 1 ]] && commands+=("[$rate, $variant] for i in 0..3: scripts/lab exec i env RANK=i WORLD_SIZE=4 MASTER_ADDR=$master MASTER_PORT=29500 ${extra[*]} $BIN ${bench[*]} --transport $transport")
  done
  scripts/lab down > /dev/null
done
done

printf '%s\n' "${commands[@]}" > "$tmp/commands"
python3 - "$tmp" "$OUT" "$RATES" "$MIN" "$MAX" "$REPEATS" "${VARIANTS[@]}" <<'PY'
import json, sys, datetime
tmp, out, rates, lo, hi, repeats = sys.argv[1:7]
variants = sys.argv[7:]
label = {"tcp": "tcp", "ucx": "ucx", "ucx_eager": "ucx eager"}
text = [f"# TCP and UCX transports on the emulated 4-node lab", "",
        f"Measured {datetime.date.today()} with `REPEATS={repeats} bench/transports_lab.sh \"{rates}\" {lo} {hi}`",
        "on a 2-core Debian 12 VM that other jobs share: **the machine is shared and noisy** (its",
        "load average was well above its 2 cores during these runs), so differences of tens of",
        "percent between runs, and between transports, can be noise; the repeats show how much.",
        "4 network namespaces on a bridge, one rank per node, in-place AllReduce of float32",
        "(`pipesgd bench allreduce`, mean over ranks of 5 iterations after 1 warm-up; `-c` checked",
        "every element: #wrong is 0 in every row). Chunk size 1 MiB, one stream per neighbour, no",
        "compression. `ucx` is UCX 1.13.1 with `UCX_TLS=tcp UCX_NET_DEVICES=eth0`, so its traffic",
        "crosses the shaped links like TCP's (left to itself, UCX between namespaces of one host",
        "would use loopback or shared memory); `ucx eager` adds `UCX_RNDV_THRESH=inf` (no rendezvous",
        "handshake: every message is sent eagerly). busbw = algbw x 2(n-1)/n; `% of goodput` is",
        "busbw against one TCP flow's iperf3 goodput. Above 100%: tbf lets a burst through at more",
        "than the rate, which short transfers see.", ""]
for repeat in range(1, int(repeats) + 1):
    for rate in rates.split():
        goodput = float(open(f"{tmp}/goodput_{rate}_r{repeat}").read())
        rows = {v: json.load(open(f"{tmp}/{rate}_{v}_r{repeat}.json")) for v in variants}
        shaping = "links unshaped (veth at full speed: CPU-bound)" if rate == "none" else f"links shaped to {rate} (tc tbf)"
        text += [f"## {shaping}, run {repeat}", "",
                 f"iperf3 goodput, one TCP flow node 1 -> node 0, 5 s: **{goodput} Gbit/s** ({goodput / 8:.4f} GB/s).", "",
                 "| size | " + " | ".join(f"{label[v]} time (us) | {label[v]} busbw (GB/s) | {label[v]} % of goodput" for v in variants) + " |",
                 "|---:|" + "---:|---:|---:|" * len(variants)]
        for i, first in enumerate(rows[variants[0]]):
            cells = []
            for v in variants:
                r = rows[v][i]["in_place"]
                assert r.get("wrong", 0) == 0, (rate, v, rows[v][i])
                cells += [f"{r['time_us']:.1f}", f"{r['busbw_gbs']:.4f}", f"{100 * r['busbw_gbs'] * 8 / goodput:.1f}"]
            text.append(f"| {first['size_bytes']} | " + " | ".join(cells) + " |")
        text.append("")
text += ["## Commands", "", "```"] + open(f"{tmp}/commands").read().splitlines() + ["```", "", "## Raw output (rank 0, run 1)", ""]
for rate in rates.split():
    for v in variants:
        text += [f"{rate}, {label[v]}:", "", "```"] + open(f"{tmp}/{rate}_{v}_r1.0.log").read().splitlines() + ["```", ""]
open(f"{out}.md", "w").write("\n".join(text))
PY
echo "wrote $OUT.md and ${OUT}_*.json"
