#!/usr/bin/env bash
# The bandwidth-limited speedup experiment on the emulated lab (root only):
#
#   bench/speedup_lab.sh run RATE     one link rate (100mbit, 1gbit, none = unshaped)
#   bench/speedup_lab.sh report       tables and plots from every rate run so far
#   bench/speedup_lab.sh all          run 100mbit, 1gbit and none, then report
#
# One `run` brings up 5 namespace nodes on a bridge (scripts/lab; LAB_PREFIX, LAB_SUBNET), shapes
# every link to RATE in both directions (each node's egress, and the bridge port's egress toward
# the node, so a node's downlink is RATE too: a real switch port), gives every node the same CPU
# share (scripts/lab cpu; 2 cores / 5 nodes = 0.4 each), then on the Fashion-MNIST MLP:
#   pipesgd probe (nodes 1-4) and pipesgd model (predictions for each scheme as run),
#   ps_sync, ps_async   (server on node 0, workers on nodes 1-4),
#   ring_k1, ring_k2, ring_k1_q8, ring_k2_q8   (ranks on nodes 1-4; K = pipeline width, q8 with
#                        error feedback), each with a --timeline of steps 20-59,
#   ddp                 (PyTorch DDP, gloo, nodes 1-4: bench/peers/ddp_train.py),
# all with the same data, batch, learning rate, momentum and epochs. Raw outputs go to
# docs/results/speedup_lab/RATE/. `report` writes docs/results/speedup_lab.md and the PNGs.
#
# Sizes (shortened to fit a 2-core machine; override with the variables below): TRAIN_LIMIT
# training samples (50 steps of global batch 64 per epoch), EPOCHS epochs, TEST_LIMIT test
# samples evaluated after each epoch, TARGET test accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/build/launcher/pipesgd
CONFIG=$PWD/configs/fashion_mnist_mlp.pbtxt
export LAB_PREFIX="${LAB_PREFIX:-psgd6}" LAB_SUBNET="${LAB_SUBNET:-10.82.0}"
TRAIN_LIMIT="${TRAIN_LIMIT:-3200}"
TEST_LIMIT="${TEST_LIMIT:-2000}"
EPOCHS="${EPOCHS:-5}"
BATCH="${BATCH:-16}"
CPU_SHARE="${CPU_SHARE:-0.4}"
TARGET="${TARGET:-0.78}"
RESULTS=docs/results/speedup_lab
SCHEMES="ps_sync ps_async ring_k1 ring_k2 ring_k1_q8 ring_k2_q8 ddp"

run_rate() {
  local rate="$1" out="$RESULTS/$1"
  [[ -x "$BIN" ]] || { echo "build first" >&2; exit 1; }
  rm -rf "$out"; mkdir -p "$out"
  local pids=()
  cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; scripts/lab down >/dev/null 2>&1 || true; }
  trap cleanup EXIT
  scripts/lab down >/dev/null 2>&1 || true
  scripts/lab up 5
  scripts/lab shape "$rate" both-ways
  scripts/lab cpu "$CPU_SHARE"
  local a0 a1; a0=$(scripts/lab addr 0); a1=$(scripts/lab addr 1)
  local common=(--set "data.train_limit=$TRAIN_LIMIT" --set "data.test_limit=$TEST_LIMIT"
                --set "train.epochs=$EPOCHS" --set "train.batch_size=$BATCH"
                --set train.progress_per_epoch=0 --set comm.timeout_s=600)
  {
    echo "rate=$rate train_limit=$TRAIN_LIMIT test_limit=$TEST_LIMIT epochs=$EPOCHS batch=$BATCH cpu_share=$CPU_SHARE"
    echo "date=$(date -u +%FT%TZ) host_cores=$(nproc) kernel=$(uname -r)"
  } > "$out/setup.txt"

  # Probe on the ring's nodes (1-4), then the model for the configurations as run (chunk 1 MiB).
  for r in 0 1 2 3; do
    RANK=$r WORLD_SIZE=4 MASTER_ADDR=$a1 MASTER_PORT=29611 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
      timeout 300 scripts/lab exec $((r + 1)) "$BIN" probe "$CONFIG" "${common[@]}" \
      --json "$PWD/$out/probe.json" > "$out/probe.$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done; pids=()
  cat "$out/probe.0.log"
  "$BIN" model --probe "$out/probe.json" --chunk-bytes 1048576 --json "$out/model.json" | tee "$out/model.txt"
  "$BIN" model --probe "$out/probe.json" --json "$out/model_best.json" | tee "$out/model_best.txt"

  local port=29620
  for scheme in $SCHEMES; do
    port=$((port + 1))
    local t0; t0=$(date +%s.%N)
    case "$scheme" in
      ps_sync|ps_async)
        local mode=PS_SYNC; [[ $scheme == ps_async ]] && mode=PS_ASYNC
        for r in 0 1 2 3 4; do
          RANK=$r WORLD_SIZE=5 MASTER_ADDR=$a0 MASTER_PORT=$port OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
            timeout 900 scripts/lab exec $r "$BIN" worker "$CONFIG" "${common[@]}" \
            --set "train.mode=$mode" --out "$PWD/$out/$scheme" > "$out/$scheme.$r.log" 2>&1 &
          pids+=($!)
        done ;;
      ring_*)
        local width=${scheme:6:1} extra=()
        [[ $scheme == *_q8 ]] && extra=(--set comm.compression=q8 --set comm.error_feedback=true)
        for r in 0 1 2 3; do
          RANK=$r WORLD_SIZE=4 MASTER_ADDR=$a1 MASTER_PORT=$port OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
            timeout 900 scripts/lab exec $((r + 1)) "$BIN" worker "$CONFIG" "${common[@]}" \
            --set "train.pipeline_width=$width" "${extra[@]}" --out "$PWD/$out/$scheme" \
            --timeline "$PWD/$out/$scheme.timeline.json" --timeline-first-step 20 --timeline-steps 40 \
            > "$out/$scheme.$r.log" 2>&1 &
          pids+=($!)
        done ;;
      ddp)
        for r in 0 1 2 3; do
          RANK=$r WORLD_SIZE=4 MASTER_ADDR=$a1 MASTER_PORT=$port GLOO_SOCKET_IFNAME=eth0 \
            OMP_NUM_THREADS=1 timeout 900 scripts/lab exec $((r + 1)) /usr/bin/python3 \
            bench/peers/ddp_train.py --model mlp --train-limit "$TRAIN_LIMIT" --test-limit "$TEST_LIMIT" \
            --batch-size "$BATCH" --lr 0.05 --momentum 0.5 --epochs "$EPOCHS" \
            --metrics "$PWD/$out/ddp.metrics.jsonl" > "$out/$scheme.$r.log" 2>&1 &
          pids+=($!)
        done ;;
    esac
    local failed=0
    for p in "${pids[@]}"; do wait "$p" || failed=1; done; pids=()
    echo "$scheme: $(awk "BEGIN{print $(date +%s.%N) - $t0}") s$( ((failed)) && echo ' FAILED')"
    grep -h "final test accuracy" "$out/$scheme".*.log || tail -3 "$out/$scheme.1.log"
    ((failed == 0)) || exit 1
  done
  if [[ -f "$out/ring_k2.timeline.rank0.json" ]]; then :; fi
  trap - EXIT
  cleanup
}

report() {
  # The model from each rate's probe, with the per-byte CPU rates as the median over ranks
  # (what pipesgd probe writes since this experiment; the first runs wrote the slowest rank's).
  for d in "$RESULTS"/*/; do
    [[ -f "$d/probe.json" ]] || continue
    local rho ovh
    rho=$(python3 -c "import json,statistics as s; p=json.load(open('$d/probe.json'))['per_rank']; print(s.median_high([r['reduce_s_per_byte'] for r in p]))")
    ovh=$(python3 -c "import json,statistics as s; p=json.load(open('$d/probe.json'))['per_rank']; print(s.median_high([r['chunk_overhead_s'] for r in p]))")
    "$BIN" model --probe "$d/probe.json" --reduce-s-per-byte "$rho" --chunk-overhead-s "$ovh" \
      --chunk-bytes 1048576 --json "$d/model.json" > "$d/model.txt"
    "$BIN" model --probe "$d/probe.json" --reduce-s-per-byte "$rho" --chunk-overhead-s "$ovh" \
      --json "$d/model_best.json" > "$d/model_best.txt"
  done
  python3 bench/speedup_report.py "$RESULTS" "$TARGET" docs/results/speedup_lab
}

case "${1:-}" in
  run) run_rate "${2:?RATE}" ;;
  report) report ;;
  all) for r in 100mbit 1gbit none; do run_rate "$r"; done; report ;;
  *) echo "usage: bench/speedup_lab.sh run RATE | report | all" >&2; exit 2 ;;
esac
