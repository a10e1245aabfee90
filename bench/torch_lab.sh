#!/usr/bin/env bash
# PyTorch DDP on pipesgd's torch.distributed backend against DDP over gloo, on the emulated lab
# (root only), full Fashion-MNIST, one command per model and link rate:
#
#   bench/torch_lab.sh run MODEL RATE    MODEL mlp, cnn or resnet; RATE 100mbit, 1gbit, none
#   bench/torch_lab.sh report            docs/results/torch_lab.md and a PNG per model and rate
#
# The same script trains every scheme: examples/torch/train_fashion_mnist.py, the example users
# copy, one rank per node of a 4-node lab (scripts/lab; every link shaped to RATE both ways,
# each node CPU_SHARE of a CPU: 2 cores / 4 = 0.5), batch 64 per worker, lr 0.05, momentum 0.9,
# EPOCHS epochs (3 for the MLP, 2 otherwise), the test set every EVAL_EVERY global steps:
#   ddp          DDP over gloo, no hook (PyTorch's default)
#   ddp_fp16     DDP over gloo with PyTorch's fp16_compress_hook
#   ddp_psgd4    DDP over gloo with PyTorch's PowerSGD hook, rank 4 (error feedback, warm start)
#   pg           DDP over the pipesgd backend (tcp), no hook
#   pg_q8, pg_q4 the pipesgd backend with pipesgd's codec hook, q8 / q4 with error feedback
#   pg_psgd4     the pipesgd backend with pipesgd's PowerSGD hook, rank 4
#   pg_w2        Pipe-SGD width 2 (pipesgd.torch.PipelinedOptimizer instead of DDP; the default
#                staleness compensation and 50 synchronous warm-up steps)
#   pg_w2_q4     width 2 with q4 and error feedback inside the ring
#   pg_w2_psgd4  width 2 with pipesgd's PowerSGD, rank 4
# SCHEMES picks some (replacing only theirs; setup.txt gains a line per run); SEED=S runs seed S
# into MODEL/RATE-seedS/ (seed 1: MODEL/RATE/). TIMELINE=1 runs each scheme for 125 steps (one
# epoch of the first 32,000 samples) into MODEL/RATE-timeline/, with a timeline of steps
# 100-119 (SCHEME/timeline.json, every rank's; the report's timeline table reads it). Raw
# outputs (each scheme's metrics.jsonl and summary.json, rank 0's log) go to
# RESULTS/MODEL/RATE/ (default docs/results/torch_lab). Nothing else should run meanwhile: the
# nodes' CPU shares add up to the whole machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export LAB_PREFIX="${LAB_PREFIX:-psgdtl}" LAB_SUBNET="${LAB_SUBNET:-10.84.0}"
CPU_SHARE="${CPU_SHARE:-0.5}"
EVAL_EVERY="${EVAL_EVERY:-50}"
RESULTS="${RESULTS:-docs/results/torch_lab}"
SCHEMES="${SCHEMES:-ddp ddp_fp16 ddp_psgd4 pg pg_q8 pg_q4 pg_psgd4}"
SEED="${SEED:-1}"
PY=/usr/bin/python3  # Debian's, which has python3-torch (a pyenv python3 on PATH has not)
EXAMPLE=$PWD/examples/torch/train_fashion_mnist.py

flags_of() {  # the example's flags for SCHEME
  case "$1" in
    ddp) echo "--backend gloo" ;;
    ddp_fp16) echo "--backend gloo --hook fp16" ;;
    ddp_psgd4) echo "--backend gloo --hook powersgd --powersgd-rank 4" ;;
    pg) echo "--backend pipesgd" ;;
    pg_q8) echo "--backend pipesgd --compression q8 --error-feedback" ;;
    pg_q4) echo "--backend pipesgd --compression q4 --error-feedback" ;;
    pg_psgd4) echo "--backend pipesgd --powersgd-rank 4" ;;
    pg_w2) echo "--backend pipesgd --width 2" ;;
    pg_w2_q4) echo "--backend pipesgd --width 2 --compression q4 --error-feedback" ;;
    pg_w2_psgd4) echo "--backend pipesgd --width 2 --powersgd-rank 4" ;;
    *) echo "unknown scheme '$1' (ddp ddp_fp16 ddp_psgd4 pg pg_q8 pg_q4 pg_psgd4 pg_w2 pg_w2_q4" \
            "pg_w2_psgd4)" >&2; return 2 ;;
  esac
}

run_rate() {
  local model="$1" rate="$2" out="$RESULTS/$1/$2"
  [[ $SEED == 1 ]] || out="$out-seed$SEED"
  [[ ${TIMELINE:-0} == 1 ]] && out="$RESULTS/$1/$2-timeline"
  [[ $model =~ ^(mlp|cnn|resnet)$ ]] || { echo "MODEL: mlp, cnn or resnet, not '$model'" >&2; exit 2; }
  [[ $rate =~ ^(100mbit|1gbit|none)$ ]] || { echo "RATE: 100mbit, 1gbit or none, not '$rate'" >&2; exit 2; }
  PYTHONPATH=$PWD/build/python $PY -c "import pipesgd.torch" \
    || { echo "build pipesgd with PyTorch first (scripts/torch_deps.sh; cmake -S . -B build)" >&2; exit 1; }
  local s; for s in $SCHEMES; do flags_of "$s" > /dev/null; done
  local epochs=2; [[ $model == mlp ]] && epochs=3
  local more=()
  [[ ${TIMELINE:-0} == 1 ]] && epochs=1 more=(--train-limit 32000)
  # Only the schemes run now are replaced (SCHEMES="ddp" reruns one beside the others).
  mkdir -p "$out"
  for s in $SCHEMES; do rm -rf "${out:?}/$s" "$out/$s".*.log; done
  local pids=()
  cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; scripts/lab down >/dev/null 2>&1 || true; }
  trap cleanup EXIT
  scripts/lab down >/dev/null 2>&1 || true
  scripts/lab up 4 > /dev/null
  scripts/lab shape "$rate" both-ways
  scripts/lab cpu "$CPU_SHARE"
  local a0; a0=$(scripts/lab addr 0)
  {
    echo "model=$model rate=$rate epochs=$epochs eval_every=$EVAL_EVERY cpu_share=$CPU_SHARE seed=$SEED schemes=$(echo $SCHEMES | tr ' ' ,)"
    echo "date=$(date -u +%FT%TZ) host_cores=$(nproc) kernel=$(uname -r) torch=$($PY -c 'import torch; print(torch.__version__)') commit=$(git rev-parse --short HEAD 2>/dev/null || echo none)"
  } >> "$out/setup.txt"
  local port=29800 scheme
  for scheme in $SCHEMES; do
    port=$((port + 1))
    local flags; read -r -a flags <<< "$(flags_of "$scheme")"
    [[ ${TIMELINE:-0} == 1 ]] && flags+=("${more[@]}" --timeline "$PWD/$out/$scheme/timeline.json"
                                         --timeline-first-step 100 --timeline-steps 20)
    local t0; t0=$(date +%s.%N)
    for r in 0 1 2 3; do
      RANK=$r WORLD_SIZE=4 MASTER_ADDR=$a0 MASTER_PORT=$port GLOO_SOCKET_IFNAME=eth0 \
        PYTHONPATH=$PWD/build/python OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        timeout 1800 scripts/lab exec "$r" $PY "$EXAMPLE" --model "$model" --batch 64 --lr 0.05 \
        --momentum 0.9 --epochs "$epochs" --eval-every "$EVAL_EVERY" --seed "$SEED" "${flags[@]}" \
        $([[ $r == 0 ]] && echo --out "$PWD/$out/$scheme") > "$out/$scheme.$r.log" 2>&1 &
      pids+=($!)
    done
    local failed=0
    for p in "${pids[@]}"; do wait "$p" || failed=1; done; pids=()
    echo "$model $rate $scheme: $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s$( ((failed)) && echo ' FAILED')"
    grep -h "final test accuracy" "$out/$scheme.0.log" || true
    ((failed == 0)) || { tail -n 20 "$out/$scheme".*.log; exit 1; }
    rm -f "$out/$scheme".[1-3].log  # the other ranks say nothing rank 0 does not
  done
  trap - EXIT
  cleanup
}

case "${1:-}" in
  run) run_rate "${2:?MODEL}" "${3:?RATE}" ;;
  report) $PY bench/torch_lab_report.py "$RESULTS" docs/results/torch_lab ;;
  *) echo "usage: bench/torch_lab.sh run MODEL RATE | report" >&2; exit 2 ;;
esac
