#!/usr/bin/env bash
# `pipesgd bench allreduce` output read by a parser of nccl-tests output
# (bench/nccl_tests_parse.py), unchanged, stdout and stderr together as a user pipes them:
#  - the parser first reads a real all_reduce_perf output (tests/data/nccl_tests_all_reduce_perf.txt:
#    16 H100s, from a public repository's saved run), so it is a parser of nccl-tests' format;
#  - then ours: checked and unchecked, sum and avg, -i steps, with --compression and --link-gbps
#    (extra columns after the 13 of nccl-tests): every row parses, sizes and counts are the ones
#    asked for, #wrong is 0 (or N/A with -c 0), the footer says 0 OK, and the average bus
#    bandwidth is the mean of the rows' busbw (to the table's rounding);
#  - argument errors (-b > -e, -g 8, -d half) fail before any rank starts.
# Usage: bench_output_test.sh PIPESGD_BINARY SOURCE_DIR
set -uo pipefail
PIPESGD="$1"; SRC="$2"
PARSE=(python3 "$SRC/bench/nccl_tests_parse.py")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"${PARSE[@]}" "$SRC/tests/data/nccl_tests_all_reduce_perf.txt" > "$tmp/real.json" \
  || fail "the parser does not read the real all_reduce_perf output"
python3 - "$tmp/real.json" << 'PY' || exit 1
import json, sys
r = json.load(open(sys.argv[1]))
rows = r["rows"]
assert len(rows) == 31, len(rows)
assert rows[0]["size_bytes"] == 8 and rows[-1]["size_bytes"] == 8589934592, rows[-1]
assert rows[-1]["in_place"]["busbw_gbs"] == 337.35 and rows[-1]["root"] == -1
assert r["out_of_bounds"] == {"count": 0, "verdict": "OK"} and r["avg_busbw_gbs"] == 70.742, r
print("ok: the parser reads a real all_reduce_perf output: 31 rows, 0 OK, avg busbw 70.742")
PY

# run NAME EXPECTED_SIZES WRONG OP ARGS...: our bench, parsed and checked.
run() {
  local name=$1 sizes=$2 wrong=$3 op=$4; shift 4
  timeout 300 "$PIPESGD" bench allreduce "$@" > "$tmp/$name.txt" 2>&1 \
    || { cat "$tmp/$name.txt"; fail "$name: pipesgd bench allreduce $* exited $?"; }
  "${PARSE[@]}" "$tmp/$name.txt" > "$tmp/$name.json" \
    || { cat "$tmp/$name.txt"; fail "$name: the nccl-tests parser does not read it"; }
  python3 - "$tmp/$name.json" "$sizes" "$wrong" "$op" "$name" << 'PY' || { cat "$tmp/$name.txt"; exit 1; }
import json, sys
r = json.load(open(sys.argv[1]))
sizes = [int(s) for s in sys.argv[2].split(",")]
wrong = None if sys.argv[3] == "N/A" else int(sys.argv[3])
op, name = sys.argv[4], sys.argv[5]
rows = r["rows"]
assert [x["size_bytes"] for x in rows] == sizes, [x["size_bytes"] for x in rows]
for x in rows:
    assert x["count"] == x["size_bytes"] // 4 and x["type"] == "float" and x["redop"] == op, x
    assert x["root"] == -1, x
    for p in ("out_of_place", "in_place"):
        assert x[p]["wrong"] == wrong, (p, x)
        assert x[p]["time_us"] > 0, x
assert r["out_of_bounds"] == {"count": 0, "verdict": "OK"}, r["out_of_bounds"]
busbw = [x[p]["busbw_gbs"] for x in rows for p in ("out_of_place", "in_place")]
mean = sum(busbw) / len(busbw)
# The rows print busbw to 0.01 GB/s, the footer from the unrounded values.
assert abs(r["avg_busbw_gbs"] - mean) <= 0.005 + 1e-9, (r["avg_busbw_gbs"], mean)
print(f"ok: {name}: {len(rows)} rows parsed, #wrong {sys.argv[3]}, 0 OK, avg busbw {r['avg_busbw_gbs']}")
PY
}

run checked 4096,16384,65536 0 sum --np 3 -b 4K -e 64K -f 4 -n 3 -w 1 -c 1
run unchecked 4096,16384,65536 N/A sum --np 2 -b 4K -e 64K -f 4 -n 3 -w 1 -c 0
run avg_steps 4096,24576,45056,65536 0 avg --np 3 -b 4K -e 64K -i 20K -n 2 -w 1 -o avg -a 3
run compressed 262144,1048576 0 sum --np 3 -b 256K -e 1M -f 4 -n 2 -w 1 -c 1 \
  --compression fp16 --link-gbps 10
# The old spelling, a bare -c, still means one checked iteration; all_reduce_perf's other
# flags at the values that describe this bench are taken; -b rounds up to whole elements.
run bare_c 4096 0 sum --np 2 -b 4K -e 4K -n 1 -w 0 -c -t 1 -g 1 -m 1 -z 0 -G 0 -p 0
run odd_b 4,8,16 0 sum --np 2 -b 3 -e 16 -n 1 -w 0
grep -q "^\[rank" "$tmp/checked.txt" && fail "a line carries the launcher's [rank R] prefix"

errors() {
  local want=$1; shift
  "$PIPESGD" bench allreduce --np 2 "$@" > "$tmp/err.txt" 2>&1 && fail "$* was accepted"
  grep -qF -- "$want" "$tmp/err.txt" || { cat "$tmp/err.txt"; fail "$*: no '$want'"; }
  grep -q "starting" "$tmp/err.txt" && fail "$*: ranks were started before the check"
  return 0
}
errors "-b 1048576 is larger than -e 4096" -b 1M -e 4K
errors "-g 8: pipesgd drives one device per rank" -g 8
errors "-d half: expected float" -d half
errors "-o max: expected sum or avg" -o max
errors "-c -1: expected 0 (no check) or a number of checks" -c -1
errors "-t 2: expected 1" -t 2
errors "-b 5 -e 6: no whole float32 element" -b 5 -e 6
echo "ok: argument errors named before any rank starts"
