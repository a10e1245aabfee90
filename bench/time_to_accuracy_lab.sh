#!/usr/bin/env bash
# Time to accuracy against PyTorch DDP on the emulated lab, full Fashion-MNIST (root only):
#
#   bench/time_to_accuracy_lab.sh run MODEL RATE   MODEL mlp or cnn; RATE 100mbit, 1gbit, none
#   bench/time_to_accuracy_lab.sh report           tables and PNGs from every run so far
#   bench/time_to_accuracy_lab.sh all              every model at every rate, then report
#
# One `run` brings up 5 namespace nodes on a bridge (scripts/lab; LAB_PREFIX, LAB_SUBNET) and
# shapes every link to RATE in both directions (each node's egress, and the bridge port toward
# the node, as a switch port). Nodes 0-3 are the four machines, CPU_SHARE of a CPU each (2
# cores / 4 = 0.5); node 4 holds the parameter server of the PS runs only (also CPU_SHARE), so
# the four workers are the same in every scheme. Then, with the same data (60,000 / 10,000),
# batch 64 per worker, lr 0.05, momentum 0.9, EPOCHS epochs and a test-set evaluation every
# EVAL_EVERY global steps (evaluation time left out of wall_s, in every scheme):
#   ddp, ddp_fp16     PyTorch DDP, gloo, defaults / its fp16_compress_hook (bench/peers/ddp_train.py)
#   ddp_plsH[_wN]     PyTorch DDP with its post-local SGD (post_localSGD_hook, PostLocalSGDOptimizer,
#                     PeriodicModelAverager): parameters averaged every H steps after N steps of
#                     plain DDP (default 50, as the outer loop's warm-up); e.g. ddp_pls16_w0
#   ps_sync, ps_async pipesgd's parameter servers (server on node 4, workers on nodes 0-3)
#   ring_k1           pipesgd width 1 (synchronous)
#   ring_k1_q8        width 1, q8 with error feedback
#   ring_k2_plain     width 2, no staleness compensation (train.staleness_compensation NONE, no
#                     synchronous warm-up): the plain Pipe-SGD recurrence
#   ring_k2           width 2 as shipped (LOCAL_GRADIENT after 50 synchronous steps)
#   ring_k2_trunc16   width 2, trunc16
#   ring_k2_q8        width 2, q8 with error feedback
#   ring_k1_q4, ring_k2_q4         width 1 / 2, q4 (4 bits, a scale per 256) with error feedback
#   ring_k1_sign1, ring_k2_sign1   width 1 / 2, sign1 (1 bit, scaled sign) with error feedback
#   ring_k1_psgd4, ring_k2_psgd4   width 1 / 2, PowerSGD rank 4 (comm.powersgd_rank)
#   outer_hH[_avg][_ov][_wN][_reset][_q8|_q4|_sign1|_psgd4]   the outer loop (docs/outer_loop.md):
#                     local_steps H, NESTEROV (DiLoCo's 0.7, 0.9) or avg (AVERAGE), ov
#                     (outer_overlap 1), wN (N synchronous steps first; default 50), reset (the
#                     inner momentum from zero each round), a codec with error feedback or
#                     PowerSGD rank 4 on the pseudo-gradient; e.g. outer_h16, outer_h16_avg_ov_w0_q4
# Raw outputs go to docs/results/time_to_accuracy/MODEL/RATE/ (metrics.jsonl and summary.json
# of each scheme, rank 0's log); `report` writes docs/results/time_to_accuracy.md and
# docs/results/time_to_accuracy_MODEL_RATE.png (test accuracy against wall-clock time).
# SEED=S (default 1) runs every scheme with train.seed / --seed S into MODEL/RATE-seedS/ (seed 1:
# MODEL/RATE/); the report adds the mean time to each target over the seeds it finds, e.g.
#   SEED=2 SCHEMES="ddp ring_k1 ring_k2 ring_k2_q8" bench/time_to_accuracy_lab.sh run mlp 100mbit
# TIMELINE=1 also records steps 100-139 of every ring run (--timeline; rank 0's is kept as
# SCHEME.timeline.rank0.json.gz) and the report lists its mean span times.
# RESULTS=DIR and REPORT=PREFIX put the raw outputs and the report elsewhere (an experiment of
# its own, with its own DDP run; the report then reads REPORT_notes.md, and REPORT_TITLE is its
# title). The compression experiment (docs/results/compression_tta.md) is
#   RESULTS=docs/results/compression_tta REPORT=docs/results/compression_tta \
#   REPORT_TITLE="Time to accuracy with fewer bits: q8, q4, sign1, PowerSGD against PyTorch DDP" \
#   SCHEMES="ddp ring_k1_q8 ring_k2_q8 ring_k1_q4 ring_k2_q4 ring_k1_sign1 ring_k2_sign1 ring_k1_psgd4 ring_k2_psgd4" \
#   bench/time_to_accuracy_lab.sh run mlp 100mbit        (then 1gbit, the seeds, the CNN, report)
# A full `all` took about 100 minutes on a 2-core machine; nothing else should run meanwhile
# (the nodes' CPU shares add up to the whole machine).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/build/launcher/pipesgd
export LAB_PREFIX="${LAB_PREFIX:-psgd18}" LAB_SUBNET="${LAB_SUBNET:-10.83.0}"
CPU_SHARE="${CPU_SHARE:-0.5}"
EVAL_EVERY="${EVAL_EVERY:-50}"
RESULTS="${RESULTS:-docs/results/time_to_accuracy}"
REPORT="${REPORT:-docs/results/time_to_accuracy}"
SCHEMES="${SCHEMES:-ddp ddp_fp16 ps_sync ps_async ring_k1 ring_k1_q8 ring_k2_plain ring_k2 ring_k2_trunc16 ring_k2_q8 ring_k1_q4 ring_k2_q4 ring_k2_sign1 ring_k1_psgd4 ring_k2_psgd4}"
SEED="${SEED:-1}"
TIMELINE="${TIMELINE:-0}"

epochs_of() { [[ $1 == mlp ]] && echo "${EPOCHS_MLP:-3}" || echo "${EPOCHS_CNN:-2}"; }

ensure_torch() {
  /usr/bin/python3 -c "import torch" 2>/dev/null && return
  echo "installing Debian's python3-torch (large) for the DDP runs"
  scripts/apt_install.sh time_to_accuracy python3-torch python3-numpy >/dev/null
}

run_rate() {
  local model="$1" rate="$2" out="$RESULTS/$1/$2"
  [[ $SEED == 1 ]] || out="$out-seed$SEED"
  [[ -x "$BIN" ]] || { echo "build first (scripts/test.sh or cmake --build build)" >&2; exit 1; }
  [[ $model == mlp || $model == cnn ]] || { echo "MODEL: mlp or cnn, not '$model'" >&2; exit 2; }
  ensure_torch
  local config=$PWD/configs/fashion_mnist_$model.pbtxt epochs; epochs=$(epochs_of "$model")
  rm -rf "$out"; mkdir -p "$out"
  local pids=()
  cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; scripts/lab down >/dev/null 2>&1 || true; }
  trap cleanup EXIT
  scripts/lab down >/dev/null 2>&1 || true
  scripts/lab up 5
  scripts/lab shape "$rate" both-ways
  scripts/lab cpu "$CPU_SHARE"
  local a0 a4; a0=$(scripts/lab addr 0); a4=$(scripts/lab addr 4)
  local common=(--set "train.epochs=$epochs" --set "train.eval_every_steps=$EVAL_EVERY"
                --set train.progress_per_epoch=0 --set comm.timeout_s=900 --set "train.seed=$SEED")
  {
    echo "model=$model rate=$rate epochs=$epochs eval_every=$EVAL_EVERY cpu_share=$CPU_SHARE seed=$SEED"
    echo "date=$(date -u +%FT%TZ) host_cores=$(nproc) kernel=$(uname -r) version=$("$BIN" --version 2>/dev/null || true)"
  } > "$out/setup.txt"

  local port=29700
  for scheme in $SCHEMES; do
    port=$((port + 1))
    local t0; t0=$(date +%s.%N)
    case "$scheme" in
      ddp|ddp_fp16|ddp_pls*)
        local hook=() part parts
        [[ $scheme == ddp_fp16 ]] && hook=(--fp16-hook)
        if [[ $scheme == ddp_pls* ]]; then
          IFS=_ read -ra parts <<< "${scheme#ddp_}"
          for part in "${parts[@]}"; do
            case "$part" in
              pls[0-9]*) hook+=(--post-local-sgd "${part#pls}") ;;
              w[0-9]*) hook+=(--local-sgd-start "${part#w}") ;;
              *) echo "unknown part '$part' of scheme $scheme" >&2; exit 2 ;;
            esac
          done
        fi
        for r in 0 1 2 3; do
          RANK=$r WORLD_SIZE=4 MASTER_ADDR=$a0 MASTER_PORT=$port GLOO_SOCKET_IFNAME=eth0 \
            OMP_NUM_THREADS=1 timeout 1800 scripts/lab exec "$r" /usr/bin/python3 \
            bench/peers/ddp_train.py --model "$model" --batch-size 64 --lr 0.05 --momentum 0.9 \
            --epochs "$epochs" --eval-every-steps "$EVAL_EVERY" --seed "$SEED" "${hook[@]}" \
            --metrics "$PWD/$out/$scheme.metrics.jsonl" > "$out/$scheme.$r.log" 2>&1 &
          pids+=($!)
        done ;;
      ps_sync|ps_async)
        local mode=PS_SYNC; [[ $scheme == ps_async ]] && mode=PS_ASYNC
        for r in 0 1 2 3 4; do  # rank 0, the server, on node 4; worker rank r on node r-1
          local node=$(( r == 0 ? 4 : r - 1 ))
          RANK=$r WORLD_SIZE=5 MASTER_ADDR=$a4 MASTER_PORT=$port OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
            timeout 1800 scripts/lab exec "$node" "$BIN" worker "$config" "${common[@]}" \
            --set "train.mode=$mode" $([[ $r == 1 ]] && echo --out "$PWD/$out/$scheme") \
            > "$out/$scheme.$r.log" 2>&1 &
          pids+=($!)
        done ;;
      ring_*)
        local extra=()
        case "$scheme" in
          ring_k1) extra=(--set train.pipeline_width=1) ;;
          ring_k1_q8) extra=(--set train.pipeline_width=1 --set comm.compression=q8 --set comm.error_feedback=true) ;;
          ring_k2_plain) extra=(--set train.staleness_compensation=NONE --set train.sync_warmup_steps=0) ;;
          ring_k2) extra=() ;;
          ring_k2_trunc16) extra=(--set comm.compression=trunc16) ;;
          ring_k2_q8) extra=(--set comm.compression=q8 --set comm.error_feedback=true) ;;
          ring_k1_q4|ring_k1_sign1)
            extra=(--set train.pipeline_width=1 --set "comm.compression=${scheme#ring_k1_}"
                   --set comm.error_feedback=true) ;;
          ring_k2_q4|ring_k2_sign1)
            extra=(--set "comm.compression=${scheme#ring_k2_}" --set comm.error_feedback=true) ;;
          ring_k1_psgd4) extra=(--set train.pipeline_width=1 --set comm.powersgd_rank=4) ;;
          ring_k2_psgd4) extra=(--set comm.powersgd_rank=4) ;;
          *) echo "unknown scheme $scheme" >&2; exit 2 ;;
        esac ;;&
      outer_*)
        local extra=() part parts
        IFS=_ read -ra parts <<< "${scheme#outer_}"
        for part in "${parts[@]}"; do
          case "$part" in
            h[0-9]*) extra+=(--set "train.local_steps=${part#h}") ;;
            avg) extra+=(--set train.outer_optimizer=AVERAGE) ;;
            ov) extra+=(--set train.outer_overlap=1) ;;
            w[0-9]*) extra+=(--set "train.sync_warmup_steps=${part#w}") ;;
            reset) extra+=(--set train.reset_inner_momentum=true) ;;
            q8|q4|sign1) extra+=(--set "comm.compression=$part" --set comm.error_feedback=true) ;;
            psgd4) extra+=(--set comm.powersgd_rank=4) ;;
            *) echo "unknown part '$part' of scheme $scheme" >&2; exit 2 ;;
          esac
        done ;;&
      ring_*|outer_*)
        [[ $TIMELINE == 1 ]] && extra+=(--timeline "$PWD/$out/$scheme.timeline.json"
                                        --timeline-first-step 100 --timeline-steps 40)
        for r in 0 1 2 3; do
          RANK=$r WORLD_SIZE=4 MASTER_ADDR=$a0 MASTER_PORT=$port OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
            timeout 1800 scripts/lab exec "$r" "$BIN" worker "$config" "${common[@]}" "${extra[@]}" \
            $([[ $r == 0 ]] && echo --out "$PWD/$out/$scheme") > "$out/$scheme.$r.log" 2>&1 &
          pids+=($!)
        done ;;
      *) echo "unknown scheme $scheme" >&2; exit 2 ;;
    esac
    local failed=0
    for p in "${pids[@]}"; do wait "$p" || failed=1; done; pids=()
    echo "$model $rate $scheme: $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s$( ((failed)) && echo ' FAILED')"
    grep -h "final test accuracy" "$out/$scheme".*.log || true
    ((failed == 0)) || { tail -n 20 "$out/$scheme".*.log; exit 1; }
    rm -f "$out/$scheme/.pipesgd.lock" "$out/$scheme".timeline.rank[1-9].json
    [[ -f "$out/$scheme.timeline.rank0.json" ]] && gzip -9f "$out/$scheme.timeline.rank0.json"
    # Only rank 0's log is kept (the other ranks' say the same, or nothing).
    for f in "$out/$scheme".[1-9].log; do [[ $f == "$out/$scheme.1.log" && $scheme == ps_* ]] || rm -f "$f"; done
  done
  trap - EXIT
  cleanup
}

case "${1:-}" in
  run) run_rate "${2:?MODEL}" "${3:?RATE}" ;;
  report) python3 bench/time_to_accuracy_report.py "$RESULTS" "$REPORT" ;;
  all)
    for m in mlp cnn; do for r in 100mbit 1gbit none; do run_rate "$m" "$r"; done; done
    python3 bench/time_to_accuracy_report.py "$RESULTS" docs/results/time_to_accuracy ;;
  *) echo "usage: bench/time_to_accuracy_lab.sh run MODEL RATE | report | all" >&2; exit 2 ;;
esac
