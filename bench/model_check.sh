#!/usr/bin/env bash
# The timing model against measured training iterations, in one run (issue 20's check):
#
#   bench/model_check.sh loopback     4 ranks on this machine (pipesgd run -np 4)
#   bench/model_check.sh RATE         the 4-node lab (root): 100mbit, 1gbit, or none (unshaped),
#                                     every node at CPU_SHARE of a core
#
# REPS rounds, each: `pipesgd probe` on the ranks the jobs will use, `pipesgd model --probe`, then
# every ring row of that model for the codecs in CODECS run once as a job at the row's width,
# codec and chunk size; on loopback the PS rows too (4 workers and the server: 5 processes, one
# more than the probe measured; the lab has 4 nodes, so there it runs the ring rows only). A
# probe before each round, as a user probes before a job: this machine's speed drifts by 10-20%
# over minutes (a probe and the jobs after it agree; the same job a few minutes later does not),
# and one probe for every round charged that drift to the model. A row's error is the median
# over the rounds of its prediction against its run. Then the confirmation: the model's best row
# (the one most rounds chose) and the TOP fastest measured, CONFIRM times each in turn; the
# model's best against the measured best compares medians of those runs. Time per iteration =
# summary.json's steady_step_s: the steps after the warm-up (train.sync_warmup_steps and 10
# more), what the model predicts; a job's first steps (fresh connections in slow start, first
# allocations) are not iterations of the kind it models. Raw lines (with their stage, rows or
# confirm, and round) go to docs/results/model_check/WHERE.jsonl; WHERE.txt keeps the first
# round's model, the inputs and best of the others, and the table.
set -euo pipefail
cd "$(dirname "$0")/.."
WHERE="${1:?usage: bench/model_check.sh loopback|100mbit|1gbit|none}"
BIN=$PWD/build/launcher/pipesgd
CONFIG="${CONFIG:-$PWD/configs/fashion_mnist_mlp.pbtxt}"
STEPS="${STEPS:-400}"
REPS="${REPS:-3}"
TOP="${TOP:-2}"
CONFIRM="${CONFIRM:-6}"
CPU_SHARE="${CPU_SHARE:-0.5}"
CODECS="${CODECS:-none trunc16 fp16 q8 q4 sign1}"
OUT=docs/results/model_check/$WHERE.jsonl
[[ -x "$BIN" ]] || { echo "build first: $BIN" >&2; exit 1; }
mkdir -p docs/results/model_check
# The jobs as auto_grid.sh runs them: no progress lines, a short test set, a short synchronous
# warm-up so that width 2's runs time the pipeline.
COMMON=(--set "train.max_steps=$STEPS" --set data.test_limit=1000 --set train.progress_per_epoch=0
        --set train.sync_warmup_steps=10)

if [[ "$WHERE" == loopback ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  run_mode() {  # run_mode NAME --set ...  (NP ranks, 4 unless set)
    local name="$1"; shift
    OPENBLAS_NUM_THREADS=1 timeout 900 "$BIN" run -np "${NP:-4}" "$CONFIG" "${COMMON[@]}" "$@" \
      --out "$tmp/$name" --overwrite > "$tmp/$name.log" 2>&1 ||
      { echo "$name failed:"; tail -n 20 "$tmp/$name.log"; exit 1; }
  }
  run_probe() {  # run_probe JSON
    OPENBLAS_NUM_THREADS=1 timeout 300 "$BIN" probe -np 4 "$CONFIG" --json "$1" > "$tmp/probe.log" 2>&1 ||
      { echo "probe failed:"; tail -n 20 "$tmp/probe.log"; exit 1; }
  }
else
  export LAB_PREFIX="${LAB_PREFIX:-psgdm}" LAB_SUBNET="${LAB_SUBNET:-10.85.0}"
  RATE="$WHERE"
  # shellcheck source=bench/lab_common.sh
  source bench/lab_common.sh
  scripts/lab cpu "$CPU_SHARE"
  run_probe() {  # run_probe JSON: one rank per node, as run_mode
    local port=$((29900 + RANDOM % 90)) rc=0
    for i in 0 1 2 3; do
      RANK=$i WORLD_SIZE=4 MASTER_ADDR=$master MASTER_PORT=$port OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
        timeout 300 scripts/lab exec "$i" "$BIN" probe "$CONFIG" \
        $([[ $i == 0 ]] && echo --json "$1") > "$tmp/probe.$i.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    pids=()
    [[ $rc == 0 ]] || { echo "probe failed (rc $rc):"; tail -n 20 "$tmp"/probe.*.log; exit 1; }
  }
fi

run_row() {  # run_row SCHEME CODEC CHUNK WIDTH PREDICTED REP STAGE: one run, appended to $OUT.tmp
  local scheme=$1 codec=$2 chunk=$3 width=$4 predicted=$5 rep=$6 stage=$7
  local name="$scheme-$codec-$chunk.$rep"
  if [[ $scheme == ps_* ]]; then
    NP=5 run_mode "$name" --set "train.mode=${scheme^^}" < /dev/null
  else
    run_mode "$name" --set "train.pipeline_width=$width" --set "comm.compression=$codec" \
      --set "comm.chunk_bytes=$chunk" < /dev/null
  fi
  python3 - "$tmp/$name/summary.json" "$WHERE" "$scheme" "$codec" "$chunk" "$rep" \
    "$predicted" "$stage" >> "$OUT.tmp" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({"where": sys.argv[2], "scheme": sys.argv[3], "codec": sys.argv[4],
                  "chunk_bytes": int(sys.argv[5]), "rep": sys.argv[6],
                  "predicted_s": float(sys.argv[7]), "stage": sys.argv[8],
                  "s_per_step": d["steady_step_s"],
                  "whole_run_s_per_step": d["train_wall_s"] / d["steps"]}))
PY
}

: > "$OUT.tmp"
: > "$tmp/bests"
for rep in $(seq 1 "$REPS"); do
  run_probe "$tmp/probe.json"
  "$BIN" model --probe "$tmp/probe.json" --json "$tmp/model.json" > "$tmp/model.$rep.txt"
  if [[ $rep == 1 ]]; then cat "$tmp/model.1.txt"; else grep '^best:' "$tmp/model.$rep.txt"; fi
  python3 - "$tmp/model.json" "$CODECS" "$WHERE" > "$tmp/rows" 2>> "$tmp/bests" <<'PY'
import json, sys
codecs = sys.argv[2].split()
model = json.load(open(sys.argv[1]))
for r in model["rows"]:
    if r["chunk_bytes"] == 0 and sys.argv[3] == "loopback":
        print(r["scheme"], r["codec"], 0, 0, r["iteration_s"])
    if r["chunk_bytes"] > 0 and r["codec"] in codecs:
        width = 1 if r["scheme"] == "ring_sync" else 2
        print(r["scheme"], r["codec"], int(r["chunk_bytes"]), width, r["iteration_s"])
b = model["best"]
print(b["scheme"], b["codec"], int(b["chunk_bytes"]), file=sys.stderr)
PY
  cp "$tmp/rows" "$tmp/rows.last"
  while read -r scheme codec chunk width predicted; do
    run_row "$scheme" "$codec" "$chunk" "$width" "$predicted" "$rep" rows
  done < "$tmp/rows"
done
# The confirmation: the model's best row (the one most rounds' models chose, at the chunk size
# the last of them gave it) and the TOP fastest rows measured (by their median), CONFIRM times
# each in turn, at the last round's chunk sizes and predictions. The fastest of many noisy rows
# is biased low (its runs were, as likely as not, lucky ones), so "the model's best against the
# measured best" compares medians of these runs, taken side by side.
python3 - "$OUT.tmp" "$tmp/bests" "$tmp/rows.last" "$TOP" > "$tmp/confirm" <<'PY'
import collections, json, statistics, sys
by = {}
for r in map(json.loads, open(sys.argv[1])):
    by.setdefault((r["scheme"], r["codec"]), []).append(r["s_per_step"])
bests = [tuple(l.split()[:2]) for l in open(sys.argv[2]) if l.strip()]
count = collections.Counter(bests)
model_best = max(count, key=lambda k: (count[k], max(i for i, b in enumerate(bests) if b == k)))
keys = sorted(by, key=lambda k: statistics.median(by[k]))[:int(sys.argv[4])]
if model_best not in keys:
    keys.append(model_best)
for line in open(sys.argv[3]):
    f = line.split()
    if (f[0], f[1]) in keys:
        print(line.strip())
PY
for rep in $(seq 1 "$CONFIRM"); do
  while read -r scheme codec chunk width predicted; do
    run_row "$scheme" "$codec" "$chunk" "$width" "$predicted" "c$rep" confirm
  done < "$tmp/confirm"
done
mv "$OUT.tmp" "$OUT"

python3 - "$OUT" "$tmp/bests" > "$tmp/table" <<'PY'
import collections, json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
bests = [tuple(l.split()[:2]) for l in open(sys.argv[2]) if l.strip()]
count = collections.Counter(bests)
key = max(count, key=lambda k: (count[k], max(i for i, b in enumerate(bests) if b == k)))
by, conf = {}, {}
for r in rows:
    k = (r["scheme"], r["codec"])
    if r["stage"] == "rows":
        by.setdefault(k, []).append(r)
    else:
        conf.setdefault(k, []).append(r["s_per_step"])
print(f"# {rows[0]['where']}: ms per iteration; each row's error: the median over the rounds of "
      f"its prediction (that round's probe) against its run")
print(f"# {'row':24s} {'chunks':>15s} {'model':>15s} {'measured':>15s} {'median error':>12s}")
worst, within = 0.0, 0
for k, rs in by.items():
    err = statistics.median(r["predicted_s"] / r["s_per_step"] - 1 for r in rs)
    worst = max(worst, abs(err))
    within += abs(err) <= 0.15
    chunks = sorted({r["chunk_bytes"] for r in rs})
    span = lambda v: f"{min(v)*1e3:.3f}-{max(v)*1e3:.3f}"
    print(f"  {' '.join(k):24s} {'/'.join(map(str, chunks)):>15s} "
          f"{span([r['predicted_s'] for r in rs]):>15s} {span([r['s_per_step'] for r in rs]):>15s} "
          f"{100*err:+11.1f}%")
print(f"worst error: {100*worst:.1f}%; within 15%: {within} of {len(by)}")
print(f"# the models' best, by round: {', '.join(' '.join(b) for b in bests)}")
if conf:
    med = {k: statistics.median(v) for k, v in conf.items()}
    n = min(len(v) for v in conf.values())
    print(f"# confirmation, {n} runs of each in turn (median):")
    for k in sorted(med, key=med.get):
        print(f"  {' '.join(k):24s} {med[k]*1e3:8.3f}")
    measured_best = min(med, key=med.get)
    print(f"measured best: {' '.join(measured_best)} {med[measured_best]*1e3:.3f} ms")
    if key in med:
        print(f"model's best: {' '.join(key)}, measured {med[key]*1e3:.3f} ms: "
              f"{med[key]/med[measured_best]:.3f}x the measured best")
if key not in by:
    print(f"model's best: {' '.join(key)} (a codec not run here)")
PY
{
  cat "$tmp/model.1.txt"
  for rep in $(seq 2 "$REPS"); do
    echo "# round $rep's probe:"
    grep -E '^# (pipesgd model|sigma and)|^best' "$tmp/model.$rep.txt"
  done
  cat "$tmp/table"
} > "docs/results/model_check/$WHERE.txt"
cat "$tmp/table"
