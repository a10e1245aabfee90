#!/usr/bin/env bash
# The timing model against measured training iterations, in one run (issue 20's check):
#
#   bench/model_check.sh loopback     4 ranks on this machine (pipesgd run -np 4)
#   bench/model_check.sh RATE         the 4-node lab (root): 100mbit, 1gbit, or none (unshaped),
#                                     every node at CPU_SHARE of a core
#
# `pipesgd probe` on the ranks the jobs will use, `pipesgd model --probe`, then every ring row of
# the model for the codecs in CODECS run as a job at the row's width, codec and chunk size, REPS
# times in turn; on loopback the PS rows too (4 workers and the server: 5 processes, one more
# than the probe measured; the lab has 4 nodes, so there it runs the ring rows only). Time per iteration = (train_wall_s - eval_s) / steps from summary.json. Raw lines
# go to docs/results/model_check/WHERE.jsonl; the table prints each row's error and whether the
# model's best row is the measured best or within 5% of it.
set -euo pipefail
cd "$(dirname "$0")/.."
WHERE="${1:?usage: bench/model_check.sh loopback|100mbit|1gbit|none}"
BIN=$PWD/build/launcher/pipesgd
CONFIG="${CONFIG:-$PWD/configs/fashion_mnist_mlp.pbtxt}"
STEPS="${STEPS:-400}"
REPS="${REPS:-2}"
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
      RANK=$i WORLD_SIZE=4 MASTER_ADDR=$master MASTER_PORT=$port OPENBLAS_NUM_THREADS=1 \
        timeout 300 scripts/lab exec "$i" "$BIN" probe "$CONFIG" \
        $([[ $i == 0 ]] && echo --json "$1") > "$tmp/probe.$i.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    pids=()
    [[ $rc == 0 ]] || { echo "probe failed (rc $rc):"; tail -n 20 "$tmp"/probe.*.log; exit 1; }
  }
fi

run_probe "$tmp/probe.json"
"$BIN" model --probe "$tmp/probe.json" --json "$tmp/model.json" | tee "$tmp/model.txt"
python3 - "$tmp/model.json" "$CODECS" "$WHERE" > "$tmp/rows" <<'PY'
import json, sys
codecs = sys.argv[2].split()
for r in json.load(open(sys.argv[1]))["rows"]:
    if r["chunk_bytes"] == 0 and sys.argv[3] == "loopback":
        print(r["scheme"], r["codec"], 0, 0, r["iteration_s"])
    if r["chunk_bytes"] > 0 and r["codec"] in codecs:
        width = 1 if r["scheme"] == "ring_sync" else 2
        print(r["scheme"], r["codec"], int(r["chunk_bytes"]), width, r["iteration_s"])
PY

: > "$OUT.tmp"
for rep in $(seq 1 "$REPS"); do
  while read -r scheme codec chunk width predicted; do
    name="$scheme-$codec-$chunk.$rep"
    if [[ $scheme == ps_* ]]; then
      NP=5 run_mode "$name" --set "train.mode=${scheme^^}" < /dev/null
    else
      run_mode "$name" --set "train.pipeline_width=$width" --set "comm.compression=$codec" \
        --set "comm.chunk_bytes=$chunk" < /dev/null
    fi
    python3 - "$tmp/$name/summary.json" "$WHERE" "$scheme" "$codec" "$chunk" "$rep" \
      "$predicted" >> "$OUT.tmp" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({"where": sys.argv[2], "scheme": sys.argv[3], "codec": sys.argv[4],
                  "chunk_bytes": int(sys.argv[5]), "rep": int(sys.argv[6]),
                  "predicted_s": float(sys.argv[7]),
                  "s_per_step": (d["train_wall_s"] - d["eval_s"]) / d["steps"]}))
PY
  done < "$tmp/rows"
done
mv "$OUT.tmp" "$OUT"

python3 - "$OUT" "$tmp/model.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
best_model = json.load(open(sys.argv[2]))["best"]
by = {}
for r in rows:
    by.setdefault((r["scheme"], r["codec"], r["chunk_bytes"]), []).append(r)
print(f"# {rows[0]['where']}: ms per iteration, {max(r['rep'] for r in rows)} runs per row")
print(f"# {'row':28s} {'model':>8s} {'measured (each run)':>24s} {'error of the mean':>18s}")
worst, mean_of = 0.0, {}
for key, rs in by.items():
    m = sum(r["s_per_step"] for r in rs) / len(rs)
    mean_of[key] = m
    p = rs[0]["predicted_s"]
    worst = max(worst, abs(p / m - 1))
    runs = ", ".join(f"{r['s_per_step']*1e3:.3f}" for r in rs)
    print(f"  {key[0]+' '+key[1]+' '+str(key[2]):28s} {p*1e3:8.3f} {runs:>24s} {100*(p/m-1):+17.1f}%")
measured_best = min(mean_of, key=mean_of.get)
key = (best_model["scheme"], best_model["codec"], int(best_model["chunk_bytes"]))
print(f"worst error: {100*worst:.1f}%")
print(f"measured best: {' '.join(map(str, measured_best))} {mean_of[measured_best]*1e3:.3f} ms")
if key in mean_of:
    print(f"model's best: {' '.join(map(str, key))}, measured {mean_of[key]*1e3:.3f} ms: "
          f"{mean_of[key]/mean_of[measured_best]:.3f}x the measured best")
else:
    print(f"model's best: {' '.join(map(str, key))} (a codec not run here)")
PY
