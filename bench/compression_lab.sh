#!/usr/bin/env bash
# Compression inside the ring on the emulated 4-node lab (root only):
#   bench/compression_lab.sh RATE [MIN MAX [ITERS]]   RATE: a tc rate (100mbit, 1gbit) or none
# Brings the lab up (scripts/lab), measures the link's TCP goodput with iperf3, then for each
# codec (trunc16, fp16, q8) runs `pipesgd bench allreduce --compression X` with one rank per node:
# every size is timed compressed and uncompressed in the same run, algbw counted on the float32
# size. Takes the lab down and writes docs/results/compression_lab_<RATE>.{md,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE="${1:?usage: bench/compression_lab.sh RATE [MIN MAX [ITERS]]}"
MIN="${2:-64K}"
MAX="${3:-64M}"
ITERS="${4:-3}"
BIN=build/launcher/pipesgd
export LAB_PREFIX="${LAB_PREFIX:-psgdcomp}" LAB_SUBNET="${LAB_SUBNET:-10.86.0}"
OUT=docs/results/compression_lab_${RATE}
[[ -x "$BIN" ]] || { echo "build first (scripts/quickstart.sh or scripts/test.sh)" >&2; exit 1; }

# Lab up and shaped, torn down on exit; master, tmp and goodput_gbps set.
source bench/lab_common.sh

for codec in trunc16 fp16 q8; do
  for i in 0 1 2 3; do
    RANK=$i WORLD_SIZE=4 MASTER_ADDR=$master MASTER_PORT=29500 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
      timeout 3600 scripts/lab exec "$i" "$BIN" bench allreduce -b "$MIN" -e "$MAX" -f 4 \
      -n "$ITERS" -w 1 -c --compression "$codec" --link-gbps "$goodput_gbps" \
      --json "$tmp/$codec.json" > "$tmp/$codec.$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  pids=()
  cat "$tmp/$codec.0.log"
done

mkdir -p docs/results
python3 - "$tmp" "$OUT" "$RATE" "$goodput_gbps" "$MIN" "$MAX" "$ITERS" <<'PY'
import json, sys, datetime
tmp, out, rate, goodput, lo, hi, iters = sys.argv[1:8]
codecs = ["trunc16", "fp16", "q8"]
data = {c: json.load(open(f"{tmp}/{c}.json")) for c in codecs}
json.dump({"rate": rate, "goodput_gbps": float(goodput), "codecs": data}, open(f"{out}.json", "w"), indent=2)
sizes = [r["size_bytes"] for r in data["trunc16"]]
md = [f"# Compression inside the ring AllReduce, 4-node lab, links shaped to {rate}", "",
      f"Measured {datetime.date.today()} on a 2-core Debian 12 machine: 4 network namespaces on a bridge,",
      f"each node's link shaped by tc tbf to {rate}, one rank per node, TCP, chunk 1 MiB. Command:", "",
      "```", f"bench/compression_lab.sh {rate} {lo} {hi} {iters}", "```", "",
      f"Link goodput (iperf3, one TCP flow, 10 s): **{goodput} Gbit/s**. Times are in-place means",
      f"over ranks of {iters} iterations after 1 warm-up; `none` is the same call uncompressed in the",
      "same run (one per codec run; the table shows the trunc16 run's). Speedup = none / codec.",
      "busbw counts float32 bytes, so it can exceed the link. `#wrong` (-c) counts elements off by",
      "more than N times the codec's bound; all were 0.", "",
      "| size | none (us) | trunc16 (us) | speedup | fp16 (us) | speedup | q8 (us) | speedup | q8 busbw (GB/s, fp32 bytes) |",
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
for i, size in enumerate(sizes):
    row = [str(size), f"{data['trunc16'][i]['in_place_uncompressed']['time_us']:.1f}"]
    for c in codecs:
        r = data[c][i]
        row += [f"{r['in_place']['time_us']:.1f}", f"{r['speedup_over_none']:.2f}"]
    row.append(f"{data['q8'][i]['in_place']['busbw_gbs']:.4f}")
    md.append("| " + " | ".join(row) + " |")
md += ["", "Raw tables:", "", "```"]
for c in codecs:
    md += open(f"{tmp}/{c}.0.log").read().splitlines() + [""]
md += ["```"]
open(f"{out}.md", "w").write("\n".join(md) + "\n")
PY
rm -rf "$tmp"
echo "wrote $OUT.md and $OUT.json"
