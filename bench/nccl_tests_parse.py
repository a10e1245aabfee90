#!/usr/bin/env python3
"""Reads the output of an nccl-tests benchmark (all_reduce_perf and its kin) or of
`pipesgd bench allreduce`, which prints the same layout.

The layout, as nccl-tests prints it: comment lines start with '#'; each data row is
    size count type redop root  time algbw busbw #wrong  time algbw busbw #wrong  [more...]
(out-of-place, then in-place; #wrong an integer or N/A; columns after the 13th are ignored),
and the run ends with
    # Out of bounds values : N OK|FAILED
    # Avg bus bandwidth    : X

Usage: nccl_tests_parse.py [FILE]   (default: stdin). Prints one JSON object: the rows, the
out-of-bounds count and verdict, the average bus bandwidth. Exits 1 naming the line when a
non-comment line is not a data row or a footer line is missing.
"""
import json
import re
import sys

OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s+(OK|FAILED)\s*$")
AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([-+0-9.eE]+)")


def parse_pass(fields):
    time, algbw, busbw, wrong = fields
    return {
        "time_us": float(time),
        "algbw_gbs": float(algbw),
        "busbw_gbs": float(busbw),
        "wrong": None if wrong == "N/A" else int(wrong),
    }


def parse(lines):
    rows, oob, avg = [], None, None
    for number, raw in enumerate(lines, 1):
        line = raw.rstrip("\n")
        text = line.strip()
        if not text:
            continue
        if text.startswith("#"):
            if m := OOB.match(text):
                oob = {"count": int(m.group(1)), "verdict": m.group(2)}
            elif m := AVG.match(text):
                avg = float(m.group(1))
            continue
        f = text.split()
        try:
            if len(f) < 13:
                raise ValueError(f"{len(f)} columns, expected at least 13")
            rows.append({
                "size_bytes": int(f[0]),
                "count": int(f[1]),
                "type": f[2],
                "redop": f[3],
                "root": int(f[4]),
                "out_of_place": parse_pass(f[5:9]),
                "in_place": parse_pass(f[9:13]),
            })
        except ValueError as e:
            sys.exit(f"nccl_tests_parse: line {number} is neither a comment nor a data row "
                     f"({e}): {line!r}")
    if oob is None:
        sys.exit("nccl_tests_parse: no '# Out of bounds values : N OK|FAILED' line")
    if avg is None:
        sys.exit("nccl_tests_parse: no '# Avg bus bandwidth : X' line")
    if not rows:
        sys.exit("nccl_tests_parse: no data rows")
    return {"rows": rows, "out_of_bounds": oob, "avg_busbw_gbs": avg}


if __name__ == "__main__":
    stream = open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin
    print(json.dumps(parse(stream)))
