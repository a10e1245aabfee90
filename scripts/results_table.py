#!/usr/bin/env python3
"""The time-to-accuracy table of README.md and docs/results/README.md, from the newest results.

  scripts/results_table.py            print the table (markdown) and the lines under it
  scripts/results_table.py --write    put it between the markers in both files
  scripts/results_table.py --check    exit 1 where either file's table differs from it
  --results DIR                       use DIR instead of the newest result set
  --root DIR                          the repository (default: this script's parent's parent)

The two pages carry the same block, between
  <!-- results-table:tta begin -->  and  <!-- results-table:tta end -->
so the headline and the results page cannot drift apart, and a test (tests/results_table_test.sh)
fails when a new run lands without the pages being regenerated.

A result set is a directory under docs/results/ as bench/time_to_accuracy_lab.sh leaves it:
MODEL/RATE/ (seed 1) and MODEL/RATE-seedS/, each with setup.txt, ddp.metrics.jsonl and
SCHEME/metrics.jsonl (+ summary.json). The newest is the one whose runs carry the latest date in
their setup.txt, among the sets that ran DDP, width 1 and width 2 (the headline's question;
a set of codecs alone, e.g. docs/results/compression_tta/, answers another one).
Every number is computed as bench/time_to_accuracy_report.py computes its tables (the first
evaluation at or above 0.85, "x DDP" = DDP's time over the scheme's, seed means only where
every seed reached 0.85), with the same rounding, so the table matches that report's.
"""
import argparse
import json
import os
import sys
import textwrap

# The time-to-accuracy reader is the report's own (bench/time_to_accuracy_report.py), so the
# table and the per-run report can never compute a cell two ways.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from time_to_accuracy_report import first_reach, metrics_of  # noqa: E402

TARGET = 0.85
BEGIN = "<!-- results-table:tta begin -->"
END = "<!-- results-table:tta end -->"
PAGES = ("README.md", "docs/results/README.md")
MODELS = ("mlp", "cnn")
RATES = ("100mbit", "1gbit", "none")
RATE_NAMES = {"100mbit": "100mbit", "1gbit": "1gbit", "none": "unshaped"}
# Column order and the short names used on the pages (bench/time_to_accuracy_lab.sh's schemes).
SCHEMES = {
    "ddp": "DDP (gloo)",
    "ddp_fp16": "DDP + fp16 hook",
    "ps_sync": "PS sync",
    "ps_async": "PS async",
    "ring_k1": "width 1",
    "ring_k1_q8": "width 1 + q8",
    "ring_k1_q4": "width 1 + q4",
    "ring_k1_sign1": "width 1 + sign1",
    "ring_k1_psgd4": "width 1 + PowerSGD r4",
    "ring_k2_plain": "width 2, no compensation",
    "ring_k2": "width 2",
    "ring_k2_trunc16": "width 2 + trunc16",
    "ring_k2_q8": "width 2 + q8",
    "ring_k2_q4": "width 2 + q4",
    "ring_k2_sign1": "width 2 + sign1",
    "ring_k2_psgd4": "width 2 + PowerSGD r4",
}
REQUIRED = ("ddp", "ring_k1", "ring_k2")


def setup_of(d):
    """setup.txt's key=value pairs (the value of `version=` holds spaces: it runs to the end)."""
    out = {}
    path = os.path.join(d, "setup.txt")
    if not os.path.exists(path):
        return out
    for line in open(path):
        rest = line.strip()
        while rest:
            key, _, rest = rest.partition("=")
            if key == "version":
                out[key], rest = rest, ""
                break
            value, _, rest = rest.partition(" ")
            out[key] = value
    return out


def cells_of(results):
    """{(model, rate, seed): directory} of one result set."""
    cells = {}
    for model in MODELS:
        base = os.path.join(results, model)
        if not os.path.isdir(base):
            continue
        for name in sorted(os.listdir(base)):
            rate, _, seed = name.partition("-seed")
            d = os.path.join(base, name)
            if rate in RATES and os.path.exists(os.path.join(d, "setup.txt")):
                cells[(model, rate, int(seed) if seed else 1)] = d
    return cells


def newest_results(root):
    """The result set under docs/results/ with the latest setup.txt date that ran REQUIRED."""
    top = os.path.join(root, "docs", "results")
    best = None
    for name in sorted(os.listdir(top)):
        d = os.path.join(top, name)
        if not os.path.isdir(d):
            continue
        cells = cells_of(d)
        seed1 = [c for k, c in cells.items() if k[2] == 1]
        if not seed1 or not all(metrics_of(c, s) for c in seed1 for s in REQUIRED):
            continue
        date = max(setup_of(c).get("date", "") for c in cells.values())
        if best is None or date > best[0]:
            best = (date, d)
    if best is None:
        sys.exit(f"results_table: no time-to-accuracy results with {', '.join(REQUIRED)} under {top}")
    return best[1]


def fmt_s(x):
    return "never" if x is None else f"{x:.1f}"


def cpu_words(share):
    return "half a CPU" if share == "0.5" else f"{share} of a CPU"


def block(root, results):
    rel = os.path.relpath(results, root)
    cells = cells_of(results)
    seed1 = {(m, r): d for (m, r, s), d in cells.items() if s == 1}
    rows = [(m, r) for m in MODELS for r in RATES if (m, r) in seed1]
    runs = {k: {s: metrics_of(d, s) for s in SCHEMES} for k, d in seed1.items()}
    columns = [s for s in SCHEMES if any(runs[k][s] for k in rows)]
    setups = {k: setup_of(d) for k, d in cells.items()}

    out = [f"Seconds of training to {TARGET} test accuracy against PyTorch DDP in the same run, "
           "seed 1 (in brackets DDP's seconds over the scheme's: above 1 is sooner; q8 with error "
           "feedback):", "",
           "| model, link | " + " | ".join(SCHEMES[s] for s in columns) + " |",
           "|---|" + "---:|" * len(columns)]
    never = set()
    for k in rows:
        ddp = first_reach(runs[k]["ddp"], TARGET)
        line = []
        for s in columns:
            m = runs[k][s]
            t = first_reach(m, TARGET) if m else None
            if not m:
                line.append("not run")
            elif s == "ddp" or t is None or ddp is None:
                line.append(fmt_s(t))
            else:
                line.append(f"{t:.1f} ({ddp / t:.2f}x)")
            if m and t is None:
                never.add(k[0])
        out.append(f"| {k[0].upper()}, {RATE_NAMES[k[1]]} | " + " | ".join(line) + " |")
    out.append("")
    if never:
        epochs = {m: setups[(m, r, 1)].get("epochs", "?") for (m, r) in rows}
        out.append("never: not within the run's epochs (" +
                   ", ".join(f"{m.upper()} {epochs[m]}" for m in MODELS if m in never) + ").")
        out.append("")

    # Seed means where a cell ran more than one seed (as the report's seed table).
    for (m, r) in rows:
        seeds = sorted(s for (mm, rr, s) in cells if (mm, rr) == (m, r))
        if len(seeds) < 2:
            continue
        per = {}
        for s in SCHEMES:
            t = [first_reach(metrics_of(cells[(m, r, seed)], s), TARGET)
                 for seed in seeds if metrics_of(cells[(m, r, seed)], s)]
            if len(t) > 1:
                per[s] = None if any(x is None for x in t) else sum(t) / len(t)
        ddp = per.get("ddp")
        parts = []
        for s, t in per.items():
            ratio = f" ({ddp / t:.2f}x)" if (s != "ddp" and ddp and t) else ""
            parts.append(f"{SCHEMES[s]} {fmt_s(t)}{ratio}")
        out.append(f"Over seeds {', '.join(map(str, seeds))}, {m.upper()} at {RATE_NAMES[r]}, "
                   f"the mean seconds to {TARGET}: " + ", ".join(parts) + ".")
        out.append("")

    # When and where: setup.txt's date, the nodes' CPU share and the host's cores and kernel;
    # summary.json's world size and host name. The lab's nodes are network namespaces on that
    # one host, so its name is the only machine name the results record.
    dates = sorted(st["date"][:10] for st in setups.values() if "date" in st)
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    first = setups[(rows[0][0], rows[0][1], 1)]
    summary = os.path.join(seed1[rows[0]], "ring_k1", "summary.json")
    info = json.load(open(summary)) if os.path.exists(summary) else {}
    kernels = sorted({st.get("kernel", "?") for st in setups.values()})
    host = f"host name \"{info['host']}\", " if info.get("host") else ""
    where = (f"{info.get('world_size', 4)} emulated nodes at {cpu_words(first.get('cpu_share', '?'))} "
             f"each on one {first.get('host_cores', '?')}-core machine ({host}kernel "
             f"{', '.join(kernels)}; no other machine name is recorded in the results)")
    schemes = " ".join(s for s in SCHEMES if any(runs[k][s] for k in rows))
    pairs = ", ".join(f"{m} {r}" for (m, r) in rows)
    seeds = ""
    for (m, r) in rows:
        more = sorted(s for (mm, rr, s) in cells if (mm, rr) == (m, r) and s != 1)
        if more:
            seeds += f"; {m} {r} also with SEED={' and SEED='.join(map(str, more))}"
    out.append(f"Measured {when} on {where}, from `{rel}/`; command: `RESULTS={rel} REPORT={rel} "
               f"SCHEMES=\"{schemes}\" bench/time_to_accuracy_lab.sh run MODEL RATE` "
               f"(MODEL RATE: {pairs}{seeds}). This table: `scripts/results_table.py --write`.")
    # Prose wrapped as the pages' own text is; table rows stay one line each.
    return "\n".join(l if l.startswith("|") else
                     textwrap.fill(l, 96, break_long_words=False, break_on_hyphens=False)
                     for l in out)


def replace(text, new, path):
    b, e = text.find(BEGIN), text.find(END)
    if b < 0 or e < b:
        sys.exit(f"results_table: {path} lacks the markers {BEGIN} ... {END}")
    return text[:b + len(BEGIN)] + "\n" + new + "\n" + text[e:]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=os.path.dirname(here))
    p.add_argument("--results", help="a result set directory (default: the newest)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true")
    a = p.parse_args()
    root = os.path.abspath(a.root)
    results = os.path.abspath(a.results) if a.results else newest_results(root)
    new = block(root, results)
    if not (a.write or a.check):
        print(new)
        return 0
    stale = []
    for page in PAGES:
        path = os.path.join(root, page)
        text = open(path).read()
        updated = replace(text, new, page)
        if updated == text:
            continue
        if a.check:
            stale.append(page)
        else:
            open(path, "w").write(updated)
            print(f"results_table: wrote {page}")
    if stale:
        print(f"results_table: the time-to-accuracy table in {', '.join(stale)} is not the one "
              f"{os.path.relpath(results, root)}/ gives; run scripts/results_table.py --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
