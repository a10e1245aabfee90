#!/usr/bin/env bash
# The AllReduce bench over TCP, ibverbs and UCX rc_verbs side by side, in one soft-RoCE guest
# (scripts/rdma_vm), every row checked (-c). rdma_rxe is a software device and the guest's CPU
# is emulated (TCG on machines whose /dev/kvm cannot boot a stock kernel): these numbers compare
# the three paths on one device; they say nothing about a real NIC.
#   bench/rdma_vm_allreduce.sh [BUILD_DIR] [RANKS] [MAX_BYTES]   (defaults: build 2 4M)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD="${1:-build}"
RANKS="${2:-2}"
MAX="${3:-4M}"
PIPESGD="$(cd "$BUILD" && pwd)/launcher/pipesgd"
[[ -x "$PIPESGD" ]] || { echo "rdma_vm_allreduce: $PIPESGD not built (cmake --build $BUILD)" >&2; exit 1; }
[[ "$RANKS" =~ ^[0-9]+$ && "$RANKS" -ge 2 ]] || { echo "rdma_vm_allreduce: RANKS '$RANKS': expected an integer >= 2" >&2; exit 2; }
inner=$(cat <<INNER
set -e
for t in tcp ibverbs ucx; do
  echo "### transport \$t"
  # UCX over rc_verbs; both ranks share one rxe device, so UD's destination-GID check must be off.
  UCX_TLS=rc_v UCX_UD_VERBS_ETH_DGID_CHECK=n "$PIPESGD" bench allreduce -np $RANKS --transport \$t \
    -b 4K -e $MAX -f 4 -n 10 -w 2 -c 2>&1 | grep -vE '^\[rank [0-9]+\] \[20' || exit 1
done
INNER
)
exec scripts/rdma_vm --timeout 540 -- bash -c "$inner"
