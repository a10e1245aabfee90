#!/usr/bin/env bash
# The headline time-to-accuracy table (README.md) and the results page's
# (docs/results/README.md) are the table scripts/results_table.py makes from the newest results
# in docs/results/: a new result set, or a hand edit of either table, fails here until
# `scripts/results_table.py --write` is run. Then, on a copy of the two pages beside the same
# results, that the check is a real one: a changed number fails it and --write mends it.
# Usage: results_table_test.sh SOURCE_DIR
set -uo pipefail
SRC="$1"
TABLE=(python3 "$SRC/scripts/results_table.py")
command -v python3 > /dev/null || { echo "SKIP: no python3"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

"${TABLE[@]}" --root "$SRC" --check || fail "the pages' table is stale: run scripts/results_table.py --write"
echo "ok: README.md and docs/results/README.md carry the table of the newest results"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/docs/results"
cp "$SRC/README.md" "$tmp/README.md"
for f in "$SRC"/docs/results/*; do
  if [[ $(basename "$f") == README.md ]]; then cp "$f" "$tmp/docs/results/"; else ln -s "$f" "$tmp/docs/results/"; fi
done
"${TABLE[@]}" --root "$tmp" --check || fail "the copy's check fails before any change"
# The first row's DDP cell, e.g. "| MLP, 100mbit | 32.8 |", given another value.
sed -i -E '0,/^\| MLP, 100mbit \| [0-9.]+ \|/s//| MLP, 100mbit | 999.9 |/' "$tmp/README.md"
grep -q '| MLP, 100mbit | 999.9 |' "$tmp/README.md" || fail "the test could not change the table"
"${TABLE[@]}" --root "$tmp" --check 2> /dev/null && fail "--check passes a changed table"
"${TABLE[@]}" --root "$tmp" --write > /dev/null || fail "--write failed"
"${TABLE[@]}" --root "$tmp" --check || fail "--check fails after --write"
cmp -s "$tmp/README.md" "$SRC/README.md" || fail "--write did not restore README.md"
echo "ok: a changed number fails --check, and --write restores the table"
