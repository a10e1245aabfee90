#!/usr/bin/env bash
# The auto values (train.pipeline_width, comm.chunk_bytes, comm.streams = auto; comm.transport
# AUTO) against a manual grid, in one run (issue 20's check):
#
#   bench/auto_grid.sh loopback       4 ranks on this machine (pipesgd run -np 4)
#   bench/auto_grid.sh RATE           the 4-node lab (root): 100mbit, 1gbit, or none (unshaped),
#                                     every node at CPU_SHARE of a core
#
# Grid: width 1/2 x chunk 64 KiB/256 KiB/1 MiB/4 MiB x streams 1/2 x transport tcp/ucx, then
# today's defaults and the all-auto job, each REPS times in turn (the grid is walked REPS
# times, so slow drifts of a shared machine hit every point alike). Time per iteration =
# (train_wall_s - eval_s) / steps from each run's summary.json, the minimum over the REPS runs.
# Raw lines go to docs/results/auto_grid/WHERE.jsonl; the table ends with auto / best-of-grid and
# auto / defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
WHERE="${1:?usage: bench/auto_grid.sh loopback|100mbit|1gbit|none}"
BIN=$PWD/build/launcher/pipesgd
CONFIG="${CONFIG:-$PWD/configs/fashion_mnist_mlp.pbtxt}"
STEPS="${STEPS:-300}"
REPS="${REPS:-2}"
CPU_SHARE="${CPU_SHARE:-0.5}"
TRANSPORTS="${TRANSPORTS:-tcp ucx}"
OUT=docs/results/auto_grid/$WHERE.jsonl
[[ -x "$BIN" ]] || { echo "build first: $BIN" >&2; exit 1; }
# Short runs: the synchronous warm-up of width 2 is cut to SYNC_WARMUP steps for every point
# alike, so that the runs time the pipeline they configure (the trial steps of auto do).
SYNC_WARMUP="${SYNC_WARMUP:-10}"
COMMON=(--set "train.max_steps=$STEPS" --set data.test_limit=1000 --set train.progress_per_epoch=0
        --set "train.sync_warmup_steps=$SYNC_WARMUP")

if [[ "$WHERE" == loopback ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  run_mode() {  # run_mode NAME --set ...
    local name="$1"; shift
    OPENBLAS_NUM_THREADS=1 timeout 900 "$BIN" run -np 4 "$CONFIG" "${COMMON[@]}" "$@" \
      --out "$tmp/$name" --overwrite > "$tmp/$name.log" 2>&1 ||
      { echo "$name failed:"; tail -n 20 "$tmp/$name.log"; exit 1; }
  }
else
  export LAB_PREFIX="${LAB_PREFIX:-psgda}" LAB_SUBNET="${LAB_SUBNET:-10.84.0}"
  RATE="$WHERE"
  # shellcheck source=bench/lab_common.sh
  source bench/lab_common.sh
  scripts/lab cpu "$CPU_SHARE"
fi

points=()
for t in $TRANSPORTS; do
  for w in 1 2; do
    for s in 1 2; do
      for c in 65536 262144 1048576 4194304; do points+=("w$w-c$c-s$s-$t"); done
    done
  done
done
points+=(defaults auto)

args_of() {  # the --set flags of a point
  case "$1" in
    defaults) ;;
    auto) echo --set train.pipeline_width=auto --set comm.chunk_bytes=auto \
               --set comm.streams=auto --set comm.transport=AUTO ;;
    *) IFS=- read -r w c s t <<< "$1"
       echo --set "train.pipeline_width=${w#w}" --set "comm.chunk_bytes=${c#c}" \
            --set "comm.streams=${s#s}" --set "comm.transport=$t" ;;
  esac
}

: > "$OUT.tmp"
for rep in $(seq 1 "$REPS"); do
  for point in "${points[@]}"; do  # not p: lab_common.sh's run_mode loops over p
    # shellcheck disable=SC2046
    run_mode "$point.$rep" $(args_of "$point")
    python3 - "$tmp/$point.$rep/summary.json" "$point" "$rep" "$WHERE" >> "$OUT.tmp" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
det = d["details"]
a = det.get("auto") or {}
print(json.dumps({"where": sys.argv[4], "point": sys.argv[2], "rep": int(sys.argv[3]),
                  "s_per_step": (d["train_wall_s"] - d["eval_s"]) / d["steps"],
                  "transport": d["transport"], "pipeline_width": det["pipeline_width"],
                  "chunk_bytes": det["chunk_bytes"], "streams": det["streams"],
                  "tuning_s": a.get("tuning_s"), "wall_s": d["wall_s"],
                  "final_test_accuracy": d["final_test_accuracy"]}))
PY
  done
done
mv "$OUT.tmp" "$OUT"

python3 - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
best = {}
for r in rows:
    if r["point"] not in best or r["s_per_step"] < best[r["point"]]["s_per_step"]:
        best[r["point"]] = r
grid = {k: v for k, v in best.items() if k not in ("auto", "defaults")}
g = min(grid.values(), key=lambda r: r["s_per_step"])
print(f"# {rows[0]['where']}: ms per iteration, min over {max(r['rep'] for r in rows)} runs")
for k, r in sorted(best.items(), key=lambda kv: kv[1]["s_per_step"]):
    print(f"{k:28s} {r['s_per_step']*1e3:9.3f}   ({r['transport']}, width {r['pipeline_width']}, "
          f"chunk {r['chunk_bytes']}, streams {r['streams']})")
a, dflt = best["auto"], best["defaults"]
autos = [r for r in rows if r["point"] == "auto"]
print(f"best of grid: {g['point']} {g['s_per_step']*1e3:.3f} ms")
print(f"auto chose: " + "; ".join(f"{r['transport']} width {r['pipeline_width']} chunk "
      f"{r['chunk_bytes']} streams {r['streams']} ({r['s_per_step']*1e3:.3f} ms, tuning "
      f"{r['tuning_s']:.2f} s)" for r in autos))
print(f"auto / best of grid: {a['s_per_step']/g['s_per_step']:.3f}")
print(f"auto / defaults: {a['s_per_step']/dflt['s_per_step']:.3f}")
PY
