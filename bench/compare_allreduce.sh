#!/usr/bin/env bash
# pipesgd's AllReduce beside Gloo's on the emulated 4-node lab, in one run (root only):
#   bench/compare_allreduce.sh RATE [MIN MAX]    RATE: a tc rate (100mbit, 1gbit, 10gbit) or none
# Brings the lab up (scripts/lab), measures the link's TCP goodput with iperf3 (node 1 -> node 0,
# 10 s), runs `pipesgd bench allreduce`, bench/peers/gloo_allreduce (if built: Debian
# libgloo-dev) and bench/peers/mpi_allreduce (if built: Debian libopenmpi-dev; mpirun launches
# its ranks through bench/peers/netns_rsh instead of ssh) with one rank per node over the same
# sizes, takes the lab down, and writes
# docs/results/allreduce_lab_<RATE>.{md,csv,json}: per size the time of each, pipesgd's time over
# the best peer's, and busbw as a share of the measured goodput.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE="${1:?usage: bench/compare_allreduce.sh RATE [MIN MAX]}"
MIN="${2:-64K}"
MAX="${3:-256M}"
BIN=build/launcher/pipesgd
GLOO=build/bench/gloo_allreduce
MPI=build/bench/mpi_allreduce
export LAB_PREFIX="${LAB_PREFIX:-psgdbench}" LAB_SUBNET="${LAB_SUBNET:-10.83.0}"
OUT=docs/results/allreduce_lab_${RATE}
[[ -x "$BIN" ]] || { echo "build first (scripts/quickstart.sh or scripts/test.sh)" >&2; exit 1; }
bytes() { python3 -c "
s='$1'; m={'K':1<<10,'M':1<<20,'G':1<<30}
print(int(float(s[:-1])*m[s[-1].upper()]) if s[-1].upper() in m else int(s))"; }

# plot_busbw CSV PNG RATE: busbw of each library against size, and the link's goodput.
plot_busbw() {
  command -v gnuplot > /dev/null || { echo "no gnuplot (apt-get install gnuplot-nox): no plot" >&2; return 0; }
  local shaping="links shaped to $3"
  [[ "$3" == none ]] && shaping="links unshaped"
  gnuplot <<GP
set terminal pngcairo size 900,560 font "sans,11"
set output "$2"
set datafile separator ","
set key autotitle columnhead top left
set logscale x 2
set format x "%.0b%B"
set xlabel "message size (bytes)"
set ylabel "busbw (GB/s)"
set yrange [0:*]
set grid
set title "AllReduce, 4 ranks on 4 namespace nodes, $shaping"
plot "$1" using 1:3 with linespoints lw 2 pt 7 title "pipesgd", \\
     "" using 1:(\$8 > 0 ? \$8 : 1/0) with linespoints lw 2 pt 5 title "Gloo", \\
     "" using 1:(\$9 > 0 ? \$9 : 1/0) with linespoints lw 2 pt 9 title "Open MPI", \\
     "" using 1:10 with lines dt 2 lw 2 title "iperf3 goodput"
GP
}

# Lab up and shaped, torn down on exit; master, tmp and goodput_gbps set.
source bench/lab_common.sh

run_ranks() {  # run_ranks NAME CMD...: one rank per node, rank i on node i
  local name="$1"; shift
  for i in 0 1 2 3; do
    RANK=$i WORLD_SIZE=4 MASTER_ADDR=$master MASTER_PORT=29500 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
      GLOO_STORE_DIR="$tmp/gloo_store" BIND_HOST="$(scripts/lab addr "$i")" \
      timeout 1800 scripts/lab exec "$i" "$@" > "$tmp/$name.$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  pids=()
  cat "$tmp/$name.0.log"
}

run_ranks pipesgd "$BIN" bench allreduce -b "$MIN" -e "$MAX" -f 4 -n 5 -w 1 -c \
  --link-gbps "$goodput_gbps" --json "$tmp/pipesgd.json"
have_gloo=0
if [[ -x "$GLOO" ]]; then
  mkdir -p "$tmp/gloo_store"
  run_ranks gloo "$GLOO" "$(bytes "$MIN")" "$(bytes "$MAX")" 4 5 1 "$goodput_gbps"
  have_gloo=1
fi

have_mpi=0
if [[ -x "$MPI" ]]; then
  hosts=$(for i in 0 1 2 3; do scripts/lab addr "$i"; done | paste -sd,)
  # btl tcp,self: no shared memory, so MPI's traffic crosses the shaped links like ours.
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 1800 scripts/lab exec 0 \
    mpirun --allow-run-as-root -np 4 --host "$hosts" --mca plm_rsh_agent "$PWD/bench/peers/netns_rsh" \
    --mca btl tcp,self --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
    -x LAB_PREFIX -x LAB_SUBNET "$PWD/$MPI" "$(bytes "$MIN")" "$(bytes "$MAX")" 4 5 1 \
    "$goodput_gbps" > "$tmp/mpi.0.log" 2>&1
  cat "$tmp/mpi.0.log"
  have_mpi=1
fi

mkdir -p docs/results
cp "$tmp/pipesgd.json" "$OUT.json"
python3 - "$tmp" "$OUT" "$RATE" "$goodput_gbps" "$have_gloo" "$MIN" "$MAX" "$have_mpi" <<'PY'
import json, sys, datetime
tmp, out, rate, goodput, have_gloo, lo, hi, have_mpi = sys.argv[1:9]
goodput = float(goodput)
rows = json.load(open(f"{tmp}/pipesgd.json"))
def peer(name, present):
    times = {}
    if present == "1":
        for line in open(f"{tmp}/{name}.0.log"):
            f = line.split()
            if f and f[0].isdigit():
                times[int(f[0])] = float(f[4])
    return times
gloo, mpi = peer("gloo", have_gloo), peer("mpi", have_mpi)
csv = ["size_bytes,pipesgd_time_us,pipesgd_busbw_gbs,pipesgd_busbw_share_of_goodput,gloo_time_us,mpi_time_us,pipesgd_over_best_peer,gloo_busbw_gbs,mpi_busbw_gbs,goodput_gbs"]
busbw = lambda size, us: f"{size / (us * 1e3) * 2 * 3 / 4:.4f}" if us else ""  # 4 ranks
md = ["| size | pipesgd time (us) | busbw (GB/s) | % of goodput | Gloo time (us) | Open MPI time (us) | pipesgd / best peer |",
      "|---:|---:|---:|---:|---:|---:|---:|"]
fmt = lambda v: f"{v:.1f}" if v else "n/a"
for r in rows:
    size = r["size_bytes"]; ip = r["in_place"]
    t, bw = ip["time_us"], ip["busbw_gbs"]
    share = 100 * bw * 8 / goodput
    g, m = gloo.get(size), mpi.get(size)
    peers = [v for v in (g, m) if v]
    ratio = f"{t / min(peers):.2f}" if peers else "n/a"
    csv.append(f"{size},{t:.1f},{bw:.4f},{share:.1f},{g or ''},{m or ''},{ratio},"
               f"{busbw(size, g)},{busbw(size, m)},{goodput / 8:.4f}")
    md.append(f"| {size} | {t:.1f} | {bw:.4f} | {share:.1f} | {fmt(g)} | {fmt(m)} | {ratio} |")
open(f"{out}.csv", "w").write("\n".join(csv) + "\n")
shaping = "unshaped (veth at full speed, CPU-bound)" if rate == "none" else f"links shaped to {rate}"
link = "links not shaped" if rate == "none" else f"each node's link shaped by tc tbf to {rate}"
text = [f"# AllReduce on the emulated 4-node lab, {shaping}", "",
        f"Measured {datetime.date.today()} on a 2-core Debian 12 machine: 4 network namespaces on a bridge,",
        f"{link}, one rank per node, TCP. Command:", "",
        "```", f"bench/compare_allreduce.sh {rate} {lo} {hi}", "```", "",
        f"![busbw against size]({out.split('/')[-1]}.png)", "",
        f"Link goodput (iperf3, one TCP flow, node 1 -> node 0, 10 s): **{goodput} Gbit/s**.",
        "pipesgd columns are its in-place AllReduce (`pipesgd bench allreduce`, mean over ranks of",
        "5 iterations after 1 warm-up); Gloo is `gloo::allreduce` over its TCP transport, timed the same",
        "way (bench/peers/gloo_allreduce.cc); Open MPI is MPI_Allreduce in place with its default",
        "algorithm choice over the tcp BTL (bench/peers/mpi_allreduce.cc). A ratio below 1 means",
        "pipesgd is faster than the best of the two.", ""] + md + ["", "Raw tables:", "", "```"]
text += open(f"{tmp}/pipesgd.0.log").read().splitlines()
for name, present in (("gloo", have_gloo), ("mpi", have_mpi)):
    if present == "1":
        text += [""] + open(f"{tmp}/{name}.0.log").read().splitlines()
text += ["```"]
open(f"{out}.md", "w").write("\n".join(text) + "\n")
PY
plot_busbw "$OUT.csv" "$OUT.png" "$RATE"
rm -rf "$tmp"
echo "wrote $OUT.md, $OUT.csv, $OUT.json and $OUT.png"
