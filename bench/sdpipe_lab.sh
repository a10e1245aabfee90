#!/usr/bin/env bash
# SDPipe against ring synchronous SGD (width 1) and Pipe-SGD (width 2) on the emulated 4-node lab
# with slow nodes (root only):
#   bench/sdpipe_lab.sh SLOW [RATE]     SLOW: 1 or 2 slow nodes; RATE: tc rate (default 1gbit)
# Brings the lab up (scripts/lab, LAB_PREFIX/LAB_SUBNET from the environment), caps every node's
# CPU with `scripts/lab cpu` (fast nodes 0.5 CPU, slow nodes 0.125: a quarter), runs the Fashion-
# MNIST MLP once per mode with one rank per node (rank 3, and rank 2 with SLOW=2, are slow), takes
# the lab down, and writes docs/results/sdpipe_lab_slow<SLOW>.{md,csv,json} and .png: accuracy
# against wall-clock time per mode, time to the target accuracy, throughput, and SDPipe's group
# sizes. Run it under `flock -x /tmp/pipesgd-cpu.lock` (about 5 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
SLOW="${1:?usage: bench/sdpipe_lab.sh SLOW(1|2) [RATE]}"
RATE="${2:-10gbit}"
[[ "$SLOW" == 1 || "$SLOW" == 2 ]] || { echo "SLOW must be 1 or 2" >&2; exit 2; }
BIN=build/launcher/pipesgd
CONFIG=configs/fashion_mnist_mlp.pbtxt
export LAB_PREFIX="${LAB_PREFIX:-psgd10}" LAB_SUBNET="${LAB_SUBNET:-10.81.0}"
OUT=docs/results/sdpipe_lab_slow${SLOW}${TAG:+_$TAG}   # TAG: a suffix for variants
TARGET="${TARGET:-0.80}"   # test accuracy that counts as reached
EPOCHS="${EPOCHS:-8}" LIMIT="${LIMIT:-12000}" BATCH="${BATCH:-64}" LR="${LR:-0.1}"
# The same job for every mode: LIMIT training samples, BATCH per rank per step (large enough that
# a step's compute, which the slow nodes stretch, outweighs its communication), 2000 test samples
# evaluated at each epoch end, so accuracy is sampled often enough for time-to-target.
COMMON=(--set "data.train_limit=$LIMIT" --set data.test_limit=2000 --set "train.epochs=$EPOCHS"
        --set "train.batch_size=$BATCH" --set "train.learning_rate=$LR"
        --set train.progress_per_epoch=0 --set comm.timeout_s=600)
FAST=0.5 SLOWCPU=0.125
if [[ "$SLOW" == 1 ]]; then CAPS=($FAST $FAST $FAST $SLOWCPU); else CAPS=($FAST $FAST $SLOWCPU $SLOWCPU); fi
[[ -x "$BIN" ]] || { echo "build first" >&2; exit 1; }

source bench/lab_common.sh
scripts/lab cpu "${CAPS[@]}"

run_mode ring  --set train.mode=RING --set train.pipeline_width=1
run_mode pipe  --set train.mode=RING --set train.pipeline_width=2
run_mode sdpipe --set train.mode=SDPIPE

mkdir -p docs/results
python3 - "$tmp" "$OUT" "$SLOW" "$RATE" "$TARGET" "$EPOCHS" "$goodput_gbps" "${CAPS[*]}" "$LIMIT" "$BATCH" "$LR" <<'PY'
import json, sys, datetime
tmp, out, slow, rate, target, epochs, goodput, caps, limit, batch, lr = sys.argv[1:12]
target = float(target)
names = {"ring": "ring synchronous (width 1)", "pipe": "Pipe-SGD (width 2)", "sdpipe": "SDPipe (P = 10)"}
runs = {}
for m in names:
    metrics = [json.loads(l) for l in open(f"{tmp}/{m}/metrics.jsonl")]
    summary = json.load(open(f"{tmp}/{m}/summary.json"))
    reached = next((x["wall_s"] for x in metrics if x["test_accuracy"] >= target), None)
    samples = metrics[-1]["step"] * 4 * int(batch)
    runs[m] = {"metrics": metrics, "summary": {k: v for k, v in summary.items() if k != "config"},
               "time_to_target_s": reached, "final_accuracy": summary["final_test_accuracy"],
               "train_wall_s": summary["train_wall_s"],
               "throughput_samples_per_s": samples / metrics[-1]["wall_s"]}
json.dump({"slow_nodes": int(slow), "rate": rate, "cpu_caps": caps, "target": target,
           "runs": runs}, open(f"{out}.json", "w"), indent=1)
# accuracy against wall-clock, one column pair per mode (gnuplot reads blocks by index)
with open(f"{out}.csv", "w") as f:
    f.write("mode,epoch,wall_s,test_accuracy,samples_per_s\n")
    for m in names:
        for x in runs[m]["metrics"]:
            f.write(f"{m},{x['epoch']},{x['wall_s']:.3f},{x['test_accuracy']:.4f},{x['samples_per_s']:.1f}\n")
for m in names:
    with open(f"{tmp}/{m}.dat", "w") as f:
        for x in runs[m]["metrics"]:
            f.write(f"{x['wall_s']:.3f} {x['test_accuracy']:.4f}\n")
sizes = runs["sdpipe"]["summary"]["details"]["group_sizes"]
with open(f"{tmp}/sizes.dat", "w") as f:
    for k in range(1, 5):
        f.write(f"{k} {sizes.get(str(k), 0)}\n")
ring_t = runs["ring"]["time_to_target_s"]
fmt = lambda v: f"{v:.1f}" if v is not None else "not reached"
md = [f"# SDPipe on the emulated 4-node lab, {slow} slow node{'s' if slow != '1' else ''}", "",
      f"Measured {datetime.date.today()} on a 2-core Debian 12 machine: 4 network namespaces on a bridge,",
      f"links shaped to {rate} (iperf3 goodput {goodput} Gbit/s), one rank per node, TCP; CPU caps per",
      f"node (scripts/lab cpu, CPUs): {caps} (a slow node has a quarter of a fast one's CPU). The",
      f"Fashion-MNIST MLP of configs/fashion_mnist_mlp.pbtxt (784-256-128-10, batch {batch} per rank, lr {lr},",
      f"momentum 0.5) on the first {limit} training samples, {epochs} epochs, evaluated on 2000 test samples",
      "at every epoch end (SDPipe: an epoch is the same number of samples over all ranks, ended by a",
      "barrier of everyone). Command:", "",
      "```", f"{'TAG=' + out.split('_slow')[1].split('_', 1)[1] + ' ' if '_' in out.split('_slow')[1] else ''}LIMIT={limit} BATCH={batch} LR={lr} EPOCHS={epochs} TARGET={target} \\",
      f"  flock -x /tmp/pipesgd-cpu.lock bench/sdpipe_lab.sh {slow} {rate}", "```", "",
      f"![accuracy against wall-clock time, and SDPipe's group sizes]({out.split('/')[-1]}.png)", "",
      f"| mode | time to {target:.2f} accuracy (s) | vs ring | final accuracy | training wall (s) | throughput (samples/s) |",
      "|---|---:|---:|---:|---:|---:|"]
for m, label in names.items():
    r = runs[m]
    t = r["time_to_target_s"]
    speed = f"{ring_t / t:.2f}x" if (t and ring_t) else "n/a"
    md.append(f"| {label} | {fmt(t)} | {speed} | {r['final_accuracy']:.4f} | {r['train_wall_s']:.1f} | {r['throughput_samples_per_s']:.0f} |")
s = runs["sdpipe"]["summary"]["details"]
md += ["", f"SDPipe's scheduler formed {s['rounds']} groups: by size {json.dumps(s['group_sizes'])}, by kind",
       f"{json.dumps(s['rounds_by_kind'])}; rank 0 was alone in {s['rank0_rounds_alone']} of its rounds.", "",
       "Per epoch (wall-clock s, test accuracy):", "", "```"]
for m in names:
    md.append(m + ": " + "  ".join(f"{x['wall_s']:.1f}s {x['test_accuracy']:.4f}" for x in runs[m]["metrics"]))
md += ["```"]
open(f"{out}.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
if command -v gnuplot > /dev/null; then
  gnuplot <<GP
set terminal pngcairo size 1100,480 font "sans,11"
set output "$OUT.png"
set multiplot layout 1,2 title "4 ranks, $SLOW slow node(s) at a quarter CPU, links $RATE"
set xlabel "wall-clock time (s)"
set ylabel "test accuracy"
set grid
set key bottom right
set yrange [0.5:0.9]
plot "$tmp/ring.dat" using 1:2 with linespoints lw 2 pt 7 title "ring sync (width 1)", \\
     "$tmp/pipe.dat" using 1:2 with linespoints lw 2 pt 5 title "Pipe-SGD (width 2)", \\
     "$tmp/sdpipe.dat" using 1:2 with linespoints lw 2 pt 9 title "SDPipe (P = 10)", \\
     $TARGET with lines dt 2 lc rgb "gray" title "target"
set xlabel "group size (ranks)"
set ylabel "groups formed"
set yrange [0:*]
set xrange [0.5:4.5]
set boxwidth 0.6
set style fill solid 0.6
unset key
plot "$tmp/sizes.dat" using 1:2 with boxes lc rgb "#3070b0"
unset multiplot
GP
fi
rm -rf "$tmp"
echo "wrote $OUT.md, $OUT.csv, $OUT.json and $OUT.png"
