#!/usr/bin/python3
"""Report of bench/torch_lab.sh: markdown tables and a gnuplot PNG per model and rate.

  python3 bench/torch_lab_report.py RESULTS OUT_PREFIX

RESULTS holds MODEL/RATE[-seedS]/ directories as the lab script leaves them; writes OUT_PREFIX.md
and OUT_PREFIX_MODEL_RATE.png; OUT_PREFIX_notes.md, when it exists, is the hand-written reading
placed after the title. Every number comes from the example's own outputs: summary.json's
steady_step_s (training time per step after the first 10, evaluations left out) and the
metrics lines (wall_s of the first evaluation at or above a target; the last evaluation's
accuracy; wire_bytes_per_step where a pipesgd hook counted it).
"""
import json
import os
import subprocess
import sys

# The accuracies each model is timed to. The MLP and the CNN pass 0.87 within their epochs. The
# residual network (2 epochs, batch norm, lr 0.05) ends near 0.84 under DDP over gloo, so it is
# timed to 0.80 and 0.83.
TARGETS = {"mlp": (0.85, 0.87), "cnn": (0.85, 0.87), "resnet": (0.80, 0.83)}
MODELS = ("mlp", "cnn", "resnet")
RATES = ("100mbit", "1gbit", "none")
LABELS = {
    "ddp": "DDP, gloo",
    "ddp_fp16": "DDP, gloo + PyTorch's fp16 hook",
    "ddp_psgd4": "DDP, gloo + PyTorch's PowerSGD r4",
    "pg": "DDP, pipesgd backend",
    "pg_q8": "DDP, pipesgd + q8 EF hook",
    "pg_q4": "DDP, pipesgd + q4 EF hook",
    "pg_psgd4": "DDP, pipesgd + pipesgd's PowerSGD r4",
    "pg_w2": "Pipe-SGD width 2, pipesgd",
    "pg_w2_q4": "Pipe-SGD width 2 + q4 EF",
    "pg_w2_psgd4": "Pipe-SGD width 2 + pipesgd's PowerSGD r4",
}
STYLE = {"ddp": "lc rgb '#000000' dt 2", "ddp_fp16": "lc rgb '#777777' dt 2",
         "ddp_psgd4": "lc rgb '#a6761d' dt 2", "pg": "lc rgb '#1f78b4' dt 1",
         "pg_q8": "lc rgb '#b2df8a' dt 1", "pg_q4": "lc rgb '#ff7f00' dt 1",
         "pg_psgd4": "lc rgb '#01665e' dt 1", "pg_w2": "lc rgb '#e31a1c' dt 1",
         "pg_w2_q4": "lc rgb '#6a3d9a' dt 1", "pg_w2_psgd4": "lc rgb '#b15928' dt 1"}
DDP = ("ddp", "ddp_fp16", "ddp_psgd4")


def run_of(d, scheme, targets=(0.85, 0.87)):
    """The scheme's metrics lines and summary in directory d, or None if it did not run."""
    m, s = os.path.join(d, scheme, "metrics.jsonl"), os.path.join(d, scheme, "summary.json")
    if not (os.path.exists(m) and os.path.exists(s)):
        return None
    lines = [json.loads(x) for x in open(m) if x.strip()]
    summary = json.load(open(s))
    reach = {t: next((x["wall_s"] for x in lines if x["test_accuracy"] >= t), None) for t in targets}
    wire = [x["wire_bytes_per_step"] for x in lines if x.get("wire_bytes_per_step")]
    return {"step_ms": summary["steady_step_s"] * 1e3, "final": summary["final_test_accuracy"],
            "reach": reach, "wire": sum(wire) / len(wire) if wire else None,
            "curve": [(x["wall_s"], x["test_accuracy"]) for x in lines]}


def fmt(x, spec=".1f", none="not reached"):
    return none if x is None else format(x, spec)


def seed_dirs(results, model, rate):
    base = os.path.join(results, model)
    dirs = {}
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if name == rate:
            dirs[1] = os.path.join(base, name)
        elif name.startswith(rate + "-seed"):
            dirs[int(name[len(rate) + 5:])] = os.path.join(base, name)
    return dict(sorted(dirs.items()))


def seed1_table(d, model, rate, prefix):
    lo, hi = TARGETS[model]
    runs = {s: r for s in LABELS if (r := run_of(d, s, TARGETS[model]))}
    if not runs:
        return []
    setup = open(os.path.join(d, "setup.txt")).read().strip().replace("\n", "; ")
    ddp = runs.get("ddp")
    best = min((runs[s]["reach"][lo] for s in DDP if s in runs and runs[s]["reach"][lo]),
               default=None)
    md = [f"### {model.upper()}, links {rate}, seed 1", "", f"`{setup}`", "",
          f"| scheme | ms per step | step time / gloo's | time to {lo} (s) | x best DDP | "
          f"time to {hi} (s) | final accuracy | points from DDP | wire MB per step |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s, r in runs.items():
        t_lo = r["reach"][lo]
        md.append(
            f"| {LABELS[s]} | {r['step_ms']:.1f} | "
            f"{fmt(r['step_ms'] / ddp['step_ms'] if ddp else None, '.3f', 'n/a')} | {fmt(t_lo)} | "
            f"{fmt(best / t_lo if best and t_lo else None, '.2f', 'n/a')} | "
            f"{fmt(r['reach'][hi])} | {r['final']:.4f} | "
            f"{fmt(100 * (r['final'] - ddp['final']) if ddp else None, '+.2f', 'n/a')} | "
            f"{fmt(r['wire'] / 1e6 if r['wire'] else None, '.3f', '')} |")
    png = f"{prefix}_{model}_{rate}.png"
    plot(png, model, rate, runs)
    return md + ["", f"![test accuracy against training time, {model}, {rate}]"
                     f"({os.path.basename(png)})", ""]


def seeds_table(dirs, model, rate):
    """Final accuracy per seed, and each scheme against DDP over gloo on the same seeds (paired).
    A run that ran beside other work (a file "busy" in its seed's directory, or in the scheme's
    own) counts for its accuracy (which does not depend on timing), not for its step time."""
    per = {}
    for seed, d in dirs.items():
        for s in LABELS:
            if (r := run_of(d, s)):
                r["timed"] = not (os.path.exists(os.path.join(d, "busy"))
                                  or os.path.exists(os.path.join(d, s, "busy")))
                per.setdefault(s, {})[seed] = r
    if "ddp" not in per or len(per["ddp"]) < 2:
        return []
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    ddp = per["ddp"]
    md = [f"### {model.upper()}, links {rate}, over seeds {', '.join(map(str, dirs))}", "",
          "Each seed changes the initialisation and the shuffles, the same in every scheme. "
          "\"points from DDP\" is the mean over the seeds both ran of the scheme's final accuracy "
          "minus DDP over gloo's; the spread is the largest minus the smallest final accuracy. "
          "Step times only from runs on a quiet machine (seeds marked * ran beside other work).",
          "",
          "| scheme | seeds | final accuracy per seed | mean | spread (points) | points from DDP "
          "(paired) | mean ms per step | step time / gloo's (same seeds) |",
          "|---|---:|---|---:|---:|---:|---:|---:|"]
    for s, v in per.items():
        finals = [v[k]["final"] for k in sorted(v)]
        paired = mean([v[k]["final"] - ddp[k]["final"] for k in v if k in ddp])
        timed = [k for k in v if v[k]["timed"] and k in ddp and ddp[k]["timed"]]
        step = mean([v[k]["step_ms"] for k in timed])
        ratio = step / mean([ddp[k]["step_ms"] for k in timed]) if timed else None
        seeds = " ".join(f"{k}{'' if v[k]['timed'] else '*'}" for k in sorted(v))
        md.append(f"| {LABELS[s]} | {seeds} | {' / '.join(f'{x:.4f}' for x in finals)} | "
                  f"{mean(finals):.4f} | {100 * (max(finals) - min(finals)):.2f} | "
                  f"{fmt(None if paired is None else 100 * paired, '+.2f', '')} | "
                  f"{fmt(step, '.1f', '')} | {fmt(ratio, '.3f', '')} |")
    return md + [""]


def plot(png, model, rate, runs):
    dat = png[:-4] + ".dat"
    with open(dat, "w") as f:
        for r in runs.values():
            f.write("\n".join(f"{w:.3f} {a:.4f}" for w, a in r["curve"]) + "\n\n\n")
    plots = ", ".join(f"'{dat}' index {i} with linespoints lw 2 pt 7 ps 0.4 {STYLE[s]} "
                      f"title \"{LABELS[s]}\"" for i, s in enumerate(runs))
    script = (f"set terminal pngcairo size 960,600\nset output '{png}'\n"
              f"set title 'PyTorch {model.upper()} on Fashion-MNIST, 4 nodes at 0.5 CPU, links {rate}'\n"
              "set xlabel 'training time (s, evaluations left out; log scale)'\n"
              "set ylabel 'test accuracy'\nset logscale x\nset yrange [0.7:0.9]\n"
              "set key bottom right\nset grid\n"
              f"set arrow from graph 0, first {TARGETS[model][0]} to graph 1, first "
              f"{TARGETS[model][0]} nohead dt 2\n"
              f"plot {plots}\n")
    try:
        subprocess.run(["gnuplot"], input=script.encode(), check=True)
    finally:
        os.remove(dat)


def timeline_of(path):
    """Rank 0's mean per recorded step (ms): the step (one forward start to the next), each
    compute span, and the AllReduce on the communication track; None without a timeline."""
    if not os.path.exists(path):
        return None
    spans = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    steps = sorted({e["args"]["step"] for e in spans})
    if not steps:
        return None
    starts = {e["args"]["step"]: e["ts"] for e in spans if e["name"] == "forward"}
    gaps = [starts[t + 1] - starts[t] for t in steps if t in starts and t + 1 in starts]
    out = {"steps": len(steps), "step": sum(gaps) / len(gaps) / 1e3 if gaps else None}
    for name in ("forward", "backward", "update", "predict", "wait_aggregate", "allreduce"):
        # The AllReduces a step launched (the pipelined ones are tagged with it; evaluation's
        # collectives are not AllReduces of gradients but are few: the mean is over steps).
        out[name] = sum(e["dur"] for e in spans if e["name"] == name) / len(steps) / 1e3
    return out


COLORS = {"forward": "#4477aa", "backward": "#66ccee", "update": "#228833", "predict": "#ccbb44",
          "wait_aggregate": "#ee6677", "allreduce": "#aa3377"}


def plot_timeline(png, d, model, rate, schemes, steps=4):
    """Rank 0's first `steps` recorded steps of each scheme, one row per track, from the start of
    its first recorded step."""
    dat, tics, firsts = png[:-4] + ".dat", [], []
    with open(dat, "w") as f:
        for i, s in enumerate(schemes):
            spans = [e for e in json.load(open(os.path.join(d, s, "timeline.json")))["traceEvents"]
                     if e["ph"] == "X" and e["pid"] == 0 and e["name"] in COLORS]
            first = min(e["args"]["step"] for e in spans)
            firsts.append(first)
            spans = [e for e in spans if e["args"]["step"] < first + steps]
            t0 = min(e["ts"] for e in spans if e["name"] == "forward")
            for e in spans:
                y = 2 * (len(schemes) - 1 - i) + (1 - e["tid"])  # compute above communication
                x0, x1 = (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3
                f.write(f"{(x0 + x1) / 2:.3f} {y} {x0:.3f} {x1:.3f} {y - 0.35} {y + 0.35} "
                        f"0x{COLORS[e['name']][1:]}\n")
            tics += [f'"{LABELS[s]}: compute" {2 * (len(schemes) - 1 - i) + 1}',
                     f'"communication" {2 * (len(schemes) - 1 - i)}']  # empty under gloo
    keys = ", ".join(f"NaN with boxes fs solid lc rgb '{c}' title '{n}'" for n, c in COLORS.items())
    script = (f"set terminal pngcairo noenhanced size 1200,{120 + 60 * len(schemes)}\n"
              f"set output '{png}'\n"
              f"set title 'PyTorch {model.upper()}, links {rate}: rank 0, {steps} steps from "
              f"step {min(firsts)}'\nset xlabel 'ms'\n"
              f"set ytics ({', '.join(tics)})\nset yrange [-0.6:{2 * len(schemes) - 0.4}]\n"
              "set key outside bottom horizontal\nset grid x\n"
              f"plot '{dat}' using 1:2:3:4:5:6:7 with boxxyerror fs solid border lc rgb 'white' lc rgb variable "
              "notitle, "
              f"{keys}\n")
    try:
        subprocess.run(["gnuplot"], input=script.encode(), check=True)
    finally:
        os.remove(dat)


def timeline_table(d, model, rate, prefix):
    """The schemes' timelines (bench/torch_lab.sh with TIMELINE=1): where a step's time goes."""
    rows = {s: t for s in LABELS if (t := timeline_of(os.path.join(d, s, "timeline.json")))}
    if not rows:
        return []
    setup = open(os.path.join(d, "setup.txt")).read().strip().replace("\n", "; ")
    md = [f"### {model.upper()}, links {rate}: timelines of steps 100-119", "", f"`{setup}`", "",
          "Rank 0's mean per step in ms, from each scheme's `timeline.json` in "
          f"`{d}/` (open it in https://ui.perfetto.dev). Compute: forward + backward + update + "
          "predict; under DDP backward includes the AllReduce of every bucket but the last "
          "(gloo's run inside it); AllReduce: the pipesgd backend's communication track.", "",
          "| scheme | step | forward | backward | update + predict | wait for the aggregate | "
          "AllReduce | step - compute |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s, t in rows.items():
        compute = t["forward"] + t["backward"] + t["update"] + t["predict"]
        md.append(f"| {LABELS[s]} | {fmt(t['step'], '.1f', 'n/a')} | {t['forward']:.1f} | "
                  f"{t['backward']:.1f} | {t['update'] + t['predict']:.1f} | "
                  f"{t['wait_aggregate']:.1f} | "
                  f"{t['allreduce']:.1f} | {fmt(t['step'] - compute if t['step'] else None, '.1f', 'n/a')} |")
    png = f"{prefix}_timeline_{model}_{rate}.png"
    plot_timeline(png, d, model, rate, list(rows))
    return md + ["", f"![rank 0's spans, {model}, {rate}]({os.path.basename(png)})", ""]


def main():
    results, prefix = sys.argv[1], sys.argv[2]
    md = ["# PyTorch DDP on the pipesgd backend against DDP over gloo", "",
          f"Produced by `bench/torch_lab.sh run MODEL RATE` (with `SEED=S` for seeds other than 1) "
          f"and `bench/torch_lab.sh report`; raw outputs in `{results}/`. Every scheme is the "
          "same script, `examples/torch/train_fashion_mnist.py`, on an emulated lab of 4 "
          "namespace nodes at half a CPU each, links shaped both ways with tbf; full "
          "Fashion-MNIST, batch 64 per worker, lr 0.05, momentum 0.9; the test set every 50 "
          "global steps. Times are training seconds with the evaluations left out. \"x best "
          "DDP\" is the soonest of the three gloo schemes' time to the first target (0.85; 0.80 for "
          "the residual network, which ends near 0.84 under DDP) divided by the scheme's.",
          ""]
    notes = prefix + "_notes.md"
    if os.path.exists(notes):
        md += open(notes).read().rstrip().split("\n") + [""]
    for model in MODELS:
        for rate in RATES:
            dirs = seed_dirs(results, model, rate)
            if 1 in dirs:
                md += seed1_table(dirs[1], model, rate, prefix)
            md += seeds_table(dirs, model, rate)
            md += timeline_table(os.path.join(results, model, rate + "-timeline"), model, rate,
                                 prefix)
    open(prefix + ".md", "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
