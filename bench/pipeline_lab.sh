#!/usr/bin/env bash
# Pipeline-parallel SDPipe (docs/pipeline.md) against the same 2 stages x 2 pipelines with a
# synchronous all-replica average after every step, on the emulated 4-node lab with one slow node
# (root only):
#   bench/pipeline_lab.sh [RATE]        RATE: tc rate of every node's link (default 10gbit)
# Brings the lab up (scripts/lab, LAB_PREFIX/LAB_SUBNET from the environment), caps every node's
# CPU (fast nodes 0.5 CPU, rank 3 = stage 1 of pipeline 1 at 0.125: a quarter), runs
# configs/fashion_mnist_mlp_pipeline.pbtxt once per mode with one rank per node, takes the lab
# down, and writes docs/results/pipeline_lab.{md,csv,json}: time to the target accuracy,
# throughput, final accuracy. The two modes differ only in sdpipe.period: 10 (the config's
# default: the group scheduler's rounds, a full average every 10 steps) and 1 (a full average of
# every stage's replicas after every step: synchronous all-reduce between replicas).
# Run it under `flock -x /tmp/pipesgd-cpu.lock`.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE="${1:-10gbit}"
BIN=build/launcher/pipesgd
CONFIG="${CONFIG:-configs/fashion_mnist_mlp_pipeline.pbtxt}"   # or the CNN: configs/fashion_mnist_cnn_pipeline.pbtxt
export LAB_PREFIX="${LAB_PREFIX:-psgd11}" LAB_SUBNET="${LAB_SUBNET:-10.82.0}"
OUT=docs/results/pipeline_lab${TAG:+_$TAG}
TARGET="${TARGET:-0.80}" EPOCHS="${EPOCHS:-6}" LIMIT="${LIMIT:-12000}" BATCH="${BATCH:-64}"
LR="${LR:-0.1}"
COMMON=(--set "data.train_limit=$LIMIT" --set data.test_limit=2000 --set "train.epochs=$EPOCHS"
        --set "train.batch_size=$BATCH" --set "train.learning_rate=$LR"
        --set train.progress_per_epoch=0 --set comm.timeout_s=600)
CAPS=(0.5 0.5 0.5 0.125)
[[ -x "$BIN" ]] || { echo "build first" >&2; exit 1; }

source bench/lab_common.sh
scripts/lab cpu "${CAPS[@]}"

run_mode sdpipe --set sdpipe.period=10
run_mode sync --set sdpipe.period=1

mkdir -p docs/results
python3 - "$tmp" "$OUT" "$RATE" "$TARGET" "$EPOCHS" "$goodput_gbps" "${CAPS[*]}" "$LIMIT" "$BATCH" "$LR" "$CONFIG" "${TAG:-}" <<'PY'
import json, sys, datetime
tmp, out, rate, target, epochs, goodput, caps, limit, batch, lr, config, tag = sys.argv[1:13]
target = float(target)
names = {"sdpipe": "SDPipe groups (P = 10)", "sync": "synchronous all-replica average (P = 1)"}
runs = {}
for m in names:
    metrics = [json.loads(l) for l in open(f"{tmp}/{m}/metrics.jsonl")]
    summary = json.load(open(f"{tmp}/{m}/summary.json"))
    reached = next((x["wall_s"] for x in metrics if x["test_accuracy"] >= target), None)
    samples = metrics[-1]["step"] * 2 * int(batch)  # 2 pipelines
    runs[m] = {"metrics": metrics, "summary": {k: v for k, v in summary.items() if k != "config"},
               "time_to_target_s": reached, "final_accuracy": summary["final_test_accuracy"],
               "train_wall_s": summary["train_wall_s"],
               "throughput_samples_per_s": samples / metrics[-1]["wall_s"]}
json.dump({"rate": rate, "cpu_caps": caps, "target": target, "runs": runs},
          open(f"{out}.json", "w"), indent=1)
with open(f"{out}.csv", "w") as f:
    f.write("mode,epoch,wall_s,test_accuracy,samples_per_s\n")
    for m in names:
        for x in runs[m]["metrics"]:
            f.write(f"{m},{x['epoch']},{x['wall_s']:.3f},{x['test_accuracy']:.4f},{x['samples_per_s']:.1f}\n")
sync_t = runs["sync"]["time_to_target_s"]
fmt = lambda v: f"{v:.1f}" if v is not None else "not reached"
md = ["# Pipeline-parallel SDPipe on the emulated 4-node lab, one slow node", "",
      f"Measured {datetime.date.today()} on a 2-core Debian 12 machine: 4 network namespaces on a bridge,",
      f"links shaped to {rate} (iperf3 goodput {goodput} Gbit/s), one rank per node, TCP; CPU caps per",
      f"node (scripts/lab cpu, CPUs): {caps}, so rank 3 (stage 1 of pipeline 1) has a quarter of a",
      f"fast node's CPU. 2 stages x 2 pipelines of {config} (its own stage split",
      f"and 4 micro-batches, 1F1B with weight stashing), batch {batch} per",
      f"pipeline, lr {lr}, momentum 0.5, the first {limit} training samples, {epochs} epochs, 2000 test samples",
      "evaluated at every epoch end. Command:", "",
      "```", f"{'TAG=' + tag + ' ' if tag else ''}CONFIG={config} LIMIT={limit} BATCH={batch} LR={lr} EPOCHS={epochs} TARGET={target} \\",
      f"  flock -x /tmp/pipesgd-cpu.lock bench/pipeline_lab.sh {rate}", "```", "",
      f"| replica synchronization | time to {target:.2f} accuracy (s) | vs synchronous | final accuracy | training wall (s) | throughput (samples/s) |",
      "|---|---:|---:|---:|---:|---:|"]
for m, label in names.items():
    r = runs[m]
    t = r["time_to_target_s"]
    speed = f"{sync_t / t:.2f}x" if (t and sync_t) else "n/a"
    md.append(f"| {label} | {fmt(t)} | {speed} | {r['final_accuracy']:.4f} | {r['train_wall_s']:.1f} | {r['throughput_samples_per_s']:.0f} |")
md += ["", "Scheduler rounds per stage (SDPipe run): " + json.dumps(runs["sdpipe"]["summary"]["details"].get("stages")), "",
       "Per epoch (wall-clock s, test accuracy):", "", "```"]
for m in names:
    md.append(m + ": " + "  ".join(f"{x['wall_s']:.1f}s {x['test_accuracy']:.4f}" for x in runs[m]["metrics"]))
md += ["```"]
open(f"{out}.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
rm -rf "$tmp"
echo "wrote $OUT.md, $OUT.csv and $OUT.json"
