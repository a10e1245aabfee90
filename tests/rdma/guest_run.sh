#!/usr/bin/env bash
# Runs a gtest binary inside scripts/rdma_vm's guest and fails if any case skipped: in the rdma
# tier an active RDMA port is the point, so a skip there means something was not exercised.
#   tests/rdma/guest_run.sh BINARY [GTEST ARGS...]
set -uo pipefail
log=$(mktemp /tmp/rdma_guest_run.XXXXXX)
"$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if grep -q '^\[  SKIPPED \]' "$log"; then
  echo "rdma tier: these cases skipped inside the guest, where they must run:" >&2
  grep '^\[  SKIPPED \]' "$log" | grep -v ' tests\?, listed below' >&2
  [[ $rc -eq 0 ]] && rc=1
fi
rm -f "$log"
exit "$rc"
