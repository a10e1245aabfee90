#!/usr/bin/env bash
# Cluster tier: brings up a 4-node emulated lab (scripts/lab) with 1gbit links, runs a 4-rank
# AllReduce with exact results across the namespaces (one rank per node), then a short width-2
# training job across them, takes the lab down, and checks that nothing it made is left.
# Needs root and network namespaces; otherwise prints why and exits 77 (ctest: skipped).
# Usage: lab_test.sh PIPESGD_BINARY ALLREDUCE_CHECK_BINARY SOURCE_DIR
set -uo pipefail
PIPESGD="$1"; CHECK="$2"; SRC="$3"
export LAB_PREFIX="psgdci$$" LAB_SUBNET="10.79.$(( $$ % 200 ))"
LAB="$SRC/scripts/lab"

if [[ $(id -u) -ne 0 ]]; then echo "SKIPPED: the cluster tier needs root"; exit 77; fi
if ! ip netns add "${LAB_PREFIX}-probe" 2>/dev/null; then
  echo "SKIPPED: cannot create network namespaces here"; exit 77
fi
ip netns del "${LAB_PREFIX}-probe"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  "$LAB" down >/dev/null 2>&1
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$LAB" up 4 || fail "lab up"
"$LAB" shape 1gbit || fail "lab shape"
master=$("$LAB" addr 0)

# Ranks run inside the nodes; the root namespace never connects to a lab address.
run_ranks() {  # run_ranks TIMEOUT CMD... (RANK etc. set per node)
  local timeout="$1"; shift
  pids=()
  for i in 0 1 2 3; do
    RANK=$i WORLD_SIZE=4 MASTER_ADDR=$master MASTER_PORT=29500 OPENBLAS_NUM_THREADS=1 \
      timeout "$timeout" "$LAB" exec "$i" "$@" > "$tmp/out$i" 2> "$tmp/err$i" &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  pids=()
  return $rc
}
tmp=$(mktemp -d)

run_ranks 120 "$CHECK" || { cat "$tmp"/err*; fail "AllReduce across the lab"; }
for i in 0 1 2 3; do
  grep -q "rank $i ok: 4 ranks" "$tmp/out$i" || { cat "$tmp/out$i" "$tmp/err$i"; fail "rank $i"; }
done
echo "ok: exact AllReduce across 4 namespace nodes at 1gbit"

run_ranks 300 "$PIPESGD" worker "$SRC/configs/fashion_mnist_mlp.pbtxt" --set train.max_steps=300 \
  --set train.epochs=1 || { cat "$tmp"/err*; fail "training across the lab"; }
acc=$(grep -oE "final test accuracy: [0-9.]+" "$tmp/out0" | awk '{print $4}')
[[ -n "$acc" ]] || fail "no final accuracy"
awk -v a="$acc" 'BEGIN { exit !(a >= 0.75) }' || fail "accuracy $acc after 300 steps, expected >= 0.75"
echo "ok: width-2 training across the lab, accuracy $acc after 300 steps"

"$LAB" down >/dev/null || fail "lab down"
trap - EXIT
left=$(ip netns list | grep -c "^${LAB_PREFIX}" || true)
[[ "$left" -eq 0 ]] || fail "$left namespaces left behind"
ip route | grep -q "${LAB_SUBNET}.0/24" && fail "blackhole route left behind"
rm -rf "$tmp"
echo "ok: lab down, nothing left behind"
