#!/usr/bin/env python3
"""Report of bench/time_to_accuracy_lab.sh: markdown tables and gnuplot PNGs from the raw outputs.

  python3 bench/time_to_accuracy_report.py RESULTS OUT_PREFIX

RESULTS holds MODEL/RATE/ directories as the lab script leaves them; writes OUT_PREFIX.md and
OUT_PREFIX_MODEL_RATE.png (test accuracy against wall-clock training time, evaluations left out);
OUT_PREFIX_notes.md, when it exists, is the hand-written reading placed after the summary;
REPORT_TITLE, when set, is the page's title.
Every number comes from the metrics lines: wall_s of the first evaluation at or above a target,
the last evaluation's accuracy, samples/s over the whole run's training time.
"""
import gzip
import json
import os
import subprocess
import sys

TARGETS = (0.85, 0.87)
RATES = ("100mbit", "1gbit", "none")
LABELS = {
    "ddp": "PyTorch DDP (gloo)",
    "ddp_fp16": "PyTorch DDP + fp16 hook",
    "ps_sync": "pipesgd PS sync",
    "ps_async": "pipesgd PS async",
    "ring_k1": "pipesgd width 1",
    "ring_k1_q8": "pipesgd width 1 + q8 EF",
    "ring_k2_plain": "pipesgd width 2, no compensation",
    "ring_k2": "pipesgd width 2 (default)",
    "ring_k2_trunc16": "pipesgd width 2 + trunc16",
    "ring_k2_q8": "pipesgd width 2 + q8 EF",
    "ring_k1_q4": "pipesgd width 1 + q4 EF",
    "ring_k2_q4": "pipesgd width 2 + q4 EF",
    "ring_k1_sign1": "pipesgd width 1 + sign1 EF",
    "ring_k2_sign1": "pipesgd width 2 + sign1 EF",
    "ring_k1_psgd4": "pipesgd width 1 + PowerSGD r4",
    "ring_k2_psgd4": "pipesgd width 2 + PowerSGD r4",
}
CODECS = {"q8": "q8 EF", "q4": "q4 EF", "sign1": "sign1 EF", "psgd4": "PowerSGD r4"}


def label(s):
    """A scheme's name in the tables: the fixed ones above, and the parameterised families of the
    lab script, outer_hH[_avg][_ov][_wN][_reset][_CODEC] and ddp_plsH[_wN], spelled out."""
    if s in LABELS:
        return LABELS[s]
    parts = s.split("_")
    if s.startswith("outer_"):
        words = [f"pipesgd outer loop H = {parts[1][1:]}",
                 "AVERAGE" if "avg" in parts else "NESTEROV"]
        words += ["overlapped"] if "ov" in parts else []
        words += [f"warm-up {p[1:]}" for p in parts[2:] if p[0] == "w" and p[1:].isdigit()]
        words += ["momentum reset"] if "reset" in parts else []
        return ", ".join(words) + "".join(f" + {CODECS[p]}" for p in parts if p in CODECS)
    if s.startswith("ddp_pls"):
        start = next((p[1:] for p in parts[2:] if p[0] == "w"), "50")
        return f"PyTorch DDP + post-local SGD, H = {parts[1][3:]} after {start}"
    return s


def is_pipesgd(s):
    return s.startswith(("ring_", "ps_", "outer_"))


def schemes_in(d):
    """The schemes with results in d: the fixed ones in LABELS' order, then the others by name."""
    found = {f[:-len(".metrics.jsonl")] for f in os.listdir(d) if f.endswith(".metrics.jsonl")}
    found |= {f for f in os.listdir(d) if os.path.exists(os.path.join(d, f, "metrics.jsonl"))}
    return [s for s in LABELS if s in found] + sorted(found - set(LABELS))


def load(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def metrics_of(d, scheme):
    if scheme.startswith("ddp"):
        return load(os.path.join(d, f"{scheme}.metrics.jsonl"))
    return load(os.path.join(d, scheme, "metrics.jsonl"))


def first_reach(lines, target):
    return next((l["wall_s"] for l in lines if l["test_accuracy"] >= target), None)


def fmt_s(x):
    return "not reached" if x is None else f"{x:.2f}" if x < 10 else f"{x:.1f}"


def main():
    results, prefix = sys.argv[1], sys.argv[2]
    md = ["# " + os.environ.get("REPORT_TITLE", "Time to accuracy against PyTorch DDP"), "",
          f"Produced by `bench/time_to_accuracy_lab.sh` (raw outputs in "
          f"`{results}/`; the setup of each run in its `setup.txt`). Emulated "
          "lab: 4 namespace nodes at half a CPU each (a 5th, for the PS server only), every link "
          "shaped both ways with tbf; full Fashion-MNIST (60,000 training, 10,000 test samples), "
          "batch 64 per worker (global 256), SGD lr 0.05, momentum 0.9, the same for every "
          "scheme; the test set evaluated every 50 global steps and at each epoch's end. "
          "Times are wall-clock training seconds since the first step with the evaluations left "
          "out (in every scheme, DDP included). \"x DDP\" is DDP's time to 0.85 divided by the "
          "scheme's: above 1 is sooner. One run per cell.", ""]
    summary = []
    for model in ("mlp", "cnn"):
        for rate in RATES:
            d = os.path.join(results, model, rate)
            if not os.path.isdir(d):
                continue
            seeds = seed_table(results, model, rate)
            setup = open(os.path.join(d, "setup.txt")).read().strip().replace("\n", "; ") if os.path.exists(
                os.path.join(d, "setup.txt")) else ""
            rows = {}
            for s in schemes_in(d):
                m = metrics_of(d, s)
                if not m:
                    continue
                steps = m[-1]["step"]
                rows[s] = {"t85": first_reach(m, 0.85), "t87": first_reach(m, 0.87),
                           "final": m[-1]["test_accuracy"], "wall": m[-1]["wall_s"],
                           "sps": steps * 256 / m[-1]["wall_s"] if m[-1]["wall_s"] > 0 else 0,
                           "curve": [(l["wall_s"], l["test_accuracy"]) for l in m]}
            if not rows:
                continue
            ddp85 = rows.get("ddp", {}).get("t85")
            md += [f"## {model.upper()}, links {rate}", "", f"`{setup}`", "",
                   "| scheme | time to 0.85 (s) | x DDP | time to 0.87 (s) | final accuracy | training time (s) | samples/s |",
                   "|---|---|---|---|---|---|---|"]
            for s, r in rows.items():
                ratio = f"{ddp85 / r['t85']:.2f}x" if (ddp85 and r["t85"]) else "n/a"
                md.append(f"| {label(s)} | {fmt_s(r['t85'])} | {ratio} | {fmt_s(r['t87'])} | "
                          f"{r['final']:.4f} | {r['wall']:.1f} | {r['sps']:.0f} |")
            png = f"{os.path.basename(prefix)}_{model}_{rate}.png"
            md += ["", f"![test accuracy against training time, {model}, {rate}]({png})", ""]
            md += seeds
            md += timeline_table(results, model, rate)
            plot(prefix, model, rate, rows)
            # The best pipesgd scheme by time to 0.85, against DDP; width 2 against width 1.
            reached = {s: r for s, r in rows.items() if is_pipesgd(s) and r["t85"]}
            if reached and ddp85:
                best = min(reached, key=lambda s: reached[s]["t85"])
                summary.append(f"- {model.upper()} {rate}: best pipesgd scheme {label(best)}, 0.85 "
                               f"in {reached[best]['t85']:.1f} s against DDP's {ddp85:.1f} s "
                               f"({ddp85 / reached[best]['t85']:.2f}x sooner), final accuracy "
                               f"{reached[best]['final']:.4f} against DDP's {rows['ddp']['final']:.4f}")
            for k2, k1 in (("ring_k2", "ring_k1"), ("ring_k2_q8", "ring_k1_q8"),
                           ("ring_k2_q4", "ring_k1_q4"), ("ring_k2_sign1", "ring_k1_sign1"),
                           ("ring_k2_psgd4", "ring_k1_psgd4")):
                a, b = rows.get(k2, {}).get("t85"), rows.get(k1, {}).get("t85")
                if a and b:
                    summary.append(f"  - {LABELS[k2]} against {LABELS[k1]}: 0.85 in {a:.1f} s "
                                   f"against {b:.1f} s ({b / a:.2f}x sooner); final "
                                   f"{rows[k2]['final']:.4f} against {rows[k1]['final']:.4f}")
    notes = os.path.join(os.path.dirname(prefix), os.path.basename(prefix) + "_notes.md")
    reading = open(notes).read().rstrip().split("\n") + [""] if os.path.exists(notes) else []
    md[4:4] = (["## Summary (seed 1)", ""] + summary + [""] if summary else []) + reading
    open(prefix + ".md", "w").write("\n".join(md) + "\n")
    print("\n".join(md))


def seed_table(results, model, rate):
    """Time to 0.85 and 0.87 and the final accuracy over the seeds run (MODEL/RATE is seed 1,
    MODEL/RATE-seedS seed S), for the schemes run with more than one seed."""
    base = os.path.join(results, model)
    dirs = {1: os.path.join(base, rate)}
    for name in sorted(os.listdir(base)):
        if name.startswith(rate + "-seed"):
            dirs[int(name[len(rate) + 5:])] = os.path.join(base, name)
    if len(dirs) < 2:
        return []
    per = {}
    for seed, d in sorted(dirs.items()):
        for s in schemes_in(d):
            m = metrics_of(d, s)
            if m:
                per.setdefault(s, {})[seed] = (first_reach(m, 0.85), first_reach(m, 0.87),
                                               m[-1]["test_accuracy"])
    per = {s: v for s, v in per.items() if len(v) > 1}
    if not per:
        return []

    def mean(xs):
        xs = [x for x in xs]
        return None if any(x is None for x in xs) else sum(xs) / len(xs)

    seeds = sorted({k for v in per.values() for k in v})
    ddp = mean([t[0] for t in per["ddp"].values()]) if "ddp" in per else None
    out = [f"Over seeds {', '.join(map(str, seeds))} (`SEED=S`; each seed changes the "
           "initialisation and the shuffles, in both trainers): time to 0.85 per seed, and "
           "means (a mean is given only when every seed reached the target).", "",
           "| scheme | seeds | time to 0.85 per seed (s) | mean | x DDP (means) | mean time to 0.87 (s) | mean final accuracy |",
           "|---|---|---|---|---|---|---|"]
    for s, v in per.items():
        t85 = mean([t[0] for t in v.values()])
        t87 = mean([t[1] for t in v.values()])
        final = sum(t[2] for t in v.values()) / len(v)
        ratio = f"{ddp / t85:.2f}x" if (ddp and t85) else "n/a"
        each = " / ".join(fmt_s(v[k][0]) for k in sorted(v))
        out.append(f"| {label(s)} | {len(v)} | {each} | {fmt_s(t85)} | {ratio} | {fmt_s(t87)} | {final:.4f} |")
    return out + [""]


def timeline_table(results, model, rate):
    """Mean span times (ms) of rank 0 over the recorded steps, from SCHEME.timeline.rank0.json.gz
    (Chrome trace JSON, gzipped; ui.perfetto.dev opens it) in any seed's directory of this model
    and rate (TIMELINE=1 runs)."""
    base = os.path.join(results, model)
    out = []
    for name in sorted(os.listdir(base)):
        if name != rate and not name.startswith(rate + "-seed"):
            continue
        for s in schemes_in(os.path.join(base, name)):
            path = os.path.join(base, name, f"{s}.timeline.rank0.json.gz")
            if not os.path.exists(path):
                continue
            spans = {}
            for e in json.load(gzip.open(path, "rt"))["traceEvents"]:
                if e.get("ph") == "X":
                    spans.setdefault(e["name"], []).append(e["dur"] / 1000.0)
            steps = len(spans.get("forward", [])) or 1
            cells = [f"{k} {sum(v) / steps:.1f}" for k, v in sorted(spans.items())
                     if k in ("inner_step", "forward", "backward", "predict", "update", "wait_aggregate",
                              "allreduce", "encode", "decode", "reduce", "feedback")]
            out.append(f"| {label(s)} ({name}) | {steps} | {', '.join(cells)} |")
    if not out:
        return []
    return (["Rank 0's timeline, mean milliseconds per step (`TIMELINE=1`; compute track: "
             "forward, backward, predict, update, wait_aggregate, and for the outer loop "
             "inner_step, an inner step's forward, backward and update, per inner step; "
             "communication track: allreduce and, summed per step, its chunks' encode, reduce, "
             "decode, feedback):", "",
             "| scheme | steps | ms per step |", "|---|---|---|"] + out + [""])


# One colour and dash per scheme: peers dashed, the baselines dotted, pipesgd's rings solid.
STYLE = {
    "ddp": "lc rgb '#000000' dt 2", "ddp_fp16": "lc rgb '#777777' dt 2",
    "ps_sync": "lc rgb '#a6761d' dt 3", "ps_async": "lc rgb '#e6ab02' dt 3",
    "ring_k1": "lc rgb '#1f78b4' dt 1", "ring_k1_q8": "lc rgb '#a6cee3' dt 1",
    "ring_k2_plain": "lc rgb '#e31a1c' dt 4", "ring_k2": "lc rgb '#33a02c' dt 1",
    "ring_k2_trunc16": "lc rgb '#6a3d9a' dt 1", "ring_k2_q8": "lc rgb '#b2df8a' dt 1",
    "ring_k1_q4": "lc rgb '#fdbf6f' dt 1", "ring_k2_q4": "lc rgb '#ff7f00' dt 1",
    "ring_k1_sign1": "lc rgb '#cab2d6' dt 1", "ring_k2_sign1": "lc rgb '#f781bf' dt 1",
    "ring_k1_psgd4": "lc rgb '#80cdc1' dt 1", "ring_k2_psgd4": "lc rgb '#01665e' dt 1",
}


PALETTE = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666")


def style(s, i):
    """The fixed schemes' own style; the others a colour by position, peers dashed."""
    if s in STYLE:
        return STYLE[s]
    return f"lc rgb '{PALETTE[i % len(PALETTE)]}' dt {2 if s.startswith('ddp') else 1}"


def plot(prefix, model, rate, rows):
    tmp = f"{prefix}_{model}_{rate}.dat"
    with open(tmp, "w") as f:
        for s, r in rows.items():
            f.write(f"# {s}\n")
            for w, a in r["curve"]:
                f.write(f"{w:.3f} {a:.4f}\n")
            f.write("\n\n")
    plots = ", ".join(f"'{tmp}' index {i} with linespoints lw 2 pt 7 ps 0.4 {style(s, i)} "
                      f"title '{label(s)}'" for i, s in enumerate(rows))
    script = (f"set terminal pngcairo size 960,600\nset output '{prefix}_{model}_{rate}.png'\n"
              f"set title 'Fashion-MNIST {model.upper()}, 4 nodes at 0.5 CPU, links {rate}'\n"
              "set xlabel 'training time (s, evaluations left out; log scale)'\n"
              "set ylabel 'test accuracy'\nset logscale x\n"
              "set yrange [0.7:0.9]\nset key bottom right\nset grid\n"
              "set arrow from graph 0, first 0.85 to graph 1, first 0.85 nohead dt 2\n"
              f"plot {plots}\n")
    subprocess.run(["gnuplot"], input=script.encode(), check=True)
    os.remove(tmp)


if __name__ == "__main__":
    main()
