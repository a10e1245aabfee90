#!/usr/bin/env python3
"""Report of bench/speedup_lab.sh: tables (markdown) and gnuplot PNGs from the raw outputs.

usage: bench/speedup_report.py RESULTS_DIR TARGET OUT_PREFIX
  RESULTS_DIR  docs/results/speedup_lab (one sub-directory per link rate)
  TARGET       test accuracy for the time-to-target columns (e.g. 0.78)
  OUT_PREFIX   writes OUT_PREFIX.md, OUT_PREFIX_accuracy_RATE.png, OUT_PREFIX_predicted.png
"""
import json
import os
import subprocess
import sys

results, target, prefix = sys.argv[1], float(sys.argv[2]), sys.argv[3]
RATES = [r for r in ["100mbit", "1gbit", "none"] if os.path.isdir(os.path.join(results, r))]
SCHEMES = ["ps_sync", "ps_async", "ring_k1", "ring_k2", "ring_k1_q8", "ring_k2_q8", "ddp"]
BASELINES = ["ps_sync", "ps_async", "ring_k1", "ddp"]
LABEL = {"ps_sync": "PS sync", "ps_async": "PS async", "ring_k1": "ring width 1",
         "ring_k2": "Pipe-SGD width 2", "ring_k1_q8": "ring width 1 + q8",
         "ring_k2_q8": "Pipe-SGD width 2 + q8", "ddp": "PyTorch DDP (gloo)"}
# Which model row predicts each scheme as run (chunk 1 MiB). DDP's gloo ring is predicted as
# a synchronous ring AllReduce (its own chunking and bucketing are not modelled).
MODEL_ROW = {"ps_sync": ("ps_sync", "none"), "ps_async": ("ps_async", "none"),
             "ring_k1": ("ring_sync", "none"), "ring_k2": ("pipe_k2", "none"),
             "ring_k1_q8": ("ring_sync", "q8"), "ring_k2_q8": ("pipe_k2", "q8"),
             "ddp": ("ring_sync", "none")}


def load_lines(path):
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if l.strip()]


def setup(rate):
    kv = {}
    for line in open(os.path.join(results, rate, "setup.txt")):
        for tok in line.split():
            k, _, v = tok.partition("=")
            kv[k] = v
    return kv


def merge_timelines(d, scheme, keep=range(20, 30)):
    """Merges the rank files of a scheme into SCHEME.timeline.json (steps `keep` only, to keep
    the repository small) and removes them. Returns the merged path."""
    files = sorted(f for f in os.listdir(d) if f.startswith(f"{scheme}.timeline.rank"))
    merged = os.path.join(d, f"{scheme}.timeline.json")
    if not files:
        return merged
    events = []
    for f in files:
        for e in json.load(open(os.path.join(d, f)))["traceEvents"]:
            if e.get("ph") != "X" or e["args"]["step"] in keep:
                events.append(e)
    json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, open(merged, "w"))
    for f in files:
        os.remove(os.path.join(d, f))
    return merged


def timeline_check(path):
    """Mean compute (forward + backward + update) and AllReduce per step, from rank 0's events."""
    if not os.path.exists(path):
        return None
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0]
    comp, ar = {}, {}
    for e in ev:
        s = e["args"]["step"]
        if e["name"] in ("forward", "backward", "update"):
            comp[s] = comp.get(s, 0) + e["dur"] / 1e6
        elif e["name"] == "allreduce":
            ar[s] = ar.get(s, 0) + e["dur"] / 1e6
    steps = sorted(set(comp) & set(ar))
    if not steps:
        return None
    c = sum(comp[s] for s in steps) / len(steps)
    a = sum(ar[s] for s in steps) / len(steps)
    return c, a, len(steps)


data = {}
for rate in RATES:
    d = os.path.join(results, rate)
    st = setup(rate)
    gb = int(st["batch"]) * 4
    model = json.load(open(os.path.join(d, "model.json")))
    pred = {(r["scheme"], r["codec"]): r["iteration_s"] for r in model["rows"]}
    probe = json.load(open(os.path.join(d, "probe.json")))
    rows = {}
    for s in SCHEMES:
        m = load_lines(os.path.join(d, "ddp.metrics.jsonl" if s == "ddp" else f"{s}/metrics.jsonl"))
        if not m:
            continue
        prev, t_train, n = 0, 0.0, 0
        for line in m:
            step = line.get("step", line.get("steps"))  # "steps" in the recorded runs
            dn = step - prev
            prev = step
            t_train += dn * gb / line["samples_per_s"]
            n += dn
        reach = next((l["wall_s"] for l in m if l["test_accuracy"] >= target), None)
        rows[s] = {"iter_s": t_train / n, "pred_s": pred[MODEL_ROW[s]], "steps": n,
                   "final": m[-1]["test_accuracy"], "wall": m[-1]["wall_s"], "reach": reach,
                   "curve": [(0.0, None)] + [(l["wall_s"], l["test_accuracy"]) for l in m]}
    tl = {}
    for s in ("ring_k1", "ring_k2", "ring_k1_q8", "ring_k2_q8"):
        rank0 = os.path.join(d, f"{s}.timeline.rank0.json")
        tl[s] = timeline_check(rank0 if os.path.exists(rank0) else os.path.join(d, f"{s}.timeline.json"))
        merge_timelines(d, s)
    data[rate] = {"setup": st, "rows": rows, "probe": probe, "model": model, "timeline": tl,
                  "best": json.load(open(os.path.join(d, "model_best.json")))["best"]}

md = []
md += ["# Speedup on a bandwidth-limited cluster: Pipe-SGD against its baselines", "",
       "The bandwidth-limited speedup experiment: every scheme on the Fashion-MNIST MLP (784-256-128-10, 235,146",
       "parameters, 940,584 gradient bytes) on the emulated lab, at several link rates, with the",
       "timing models' predictions (docs/timing_models.md) beside the measurements.", ""]
st0 = data[RATES[0]]["setup"] if RATES else {}
md += ["## Set-up", "",
       f"- Machine: one 2-core Debian 12 VM ({st0.get('kernel', '?')}); date {st0.get('date', '?')}.",
       "- Lab: 5 network namespaces on a bridge (`scripts/lab up 5`, LAB_PREFIX=psgd6,",
       "  LAB_SUBNET=10.82.0). Each link is shaped with tc tbf in both directions (the node's",
       "  egress and the bridge port toward it), so a node's up- and downlink are each RATE, like a",
       "  switch port; `none` is unshaped veth. Every node gets the same CPU share",
       f"  (`scripts/lab cpu {st0.get('cpu_share', '?')}`: 2 cores / 5 nodes), one rank per node.",
       "- Ring schemes and DDP: ranks 0-3 on nodes 1-4. Parameter server: the server (rank 0) on",
       "  node 0, workers (ranks 1-4) on nodes 1-4: 4 workers in every scheme, global batch",
       f"  {int(st0.get('batch', 16)) * 4}.",
       f"- Job: batch {st0.get('batch')} per worker, SGD lr 0.05, momentum 0.5, inputs standardised;",
       f"  **shortened to fit the machine**: the first {st0.get('train_limit')} training samples",
       f"  ({int(st0.get('train_limit', 0)) // (int(st0.get('batch', 16)) * 4)} steps per epoch),",
       f"  {st0.get('epochs')} epochs, test accuracy on the first {st0.get('test_limit')} test samples",
       "  after every epoch (the full job is 60,000 samples, 3 epochs, 10,000 test samples).",
       f"- Target accuracy for time-to-target: **{target}** (test accuracy after an epoch; time =",
       "  wall-clock since training started, evaluations included, data loading excluded).",
       "- TCP, chunk 1 MiB (the config's default); q8 = 8-bit quantization inside the ring with error",
       "  feedback. The parameter server sends float32 (it has no compression).",
       "- PyTorch DDP: Debian's python3-torch, gloo backend, `bench/peers/ddp_train.py`, one thread",
       "  per rank, the same model, data, batch, lr, momentum and epochs.",
       "- Iteration time measured = training time of the epochs (evaluation excluded) / steps.",
       "  Predicted = `pipesgd model --probe probe.json --chunk-bytes 1048576` with the probe run on",
       "  the same lab nodes just before (nodes 1-4).", "",
       "Command (each rate is one piece of a few minutes under `flock -x /tmp/pipesgd-cpu.lock`):", "",
       "```", "bench/speedup_lab.sh run 100mbit; bench/speedup_lab.sh run 1gbit; bench/speedup_lab.sh run none",
       "bench/speedup_lab.sh report", "```", ""]
missing = [r for r in ["100mbit", "1gbit", "none"] if r not in RATES]
if missing:
    md += [f"Not run in this session: {', '.join(missing)} (the shared machine's exclusive CPU lock was not "
           "free in time); `bench/speedup_lab.sh run RATE` then `report` adds it.", ""]

for rate in RATES:
    D = data[rate]
    p = D["probe"]
    md += [f"## Links {rate}", "",
           f"Probe (slowest ring link / slowest rank): latency {p['latency_s'] * 1e6:.1f} us, bandwidth "
           f"{p['bandwidth_Bps'] / 1e6:.2f} MB/s, per-chunk cost {p['chunk_overhead_s'] * 1e6:.1f} us, compute "
           f"{p['compute_s'] * 1e3:.2f} ms, update {p['update_s'] * 1e3:.2f} ms. The model's best choice: "
           f"**{D['best']['scheme']}**, compression {D['best']['codec']}, width {D['best']['width']}, chunk "
           f"{D['best']['chunk_bytes']:.0f} B: {D['best']['iteration_s'] * 1e3:.1f} ms per iteration.", "",
           "| scheme | iteration measured (ms) | predicted (ms) | error | time to target (s) | final accuracy | total wall (s) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for s in SCHEMES:
        r = D["rows"].get(s)
        if not r:
            continue
        err = (r["pred_s"] - r["iter_s"]) / r["iter_s"] * 100
        md.append(f"| {LABEL[s]} | {r['iter_s'] * 1e3:.1f} | {r['pred_s'] * 1e3:.1f} | {err:+.0f}% | "
                  f"{'%.1f' % r['reach'] if r['reach'] is not None else 'not reached'} | {r['final']:.4f} | {r['wall']:.1f} |")
    md += ["", "Speedup in time per iteration (baseline's / scheme's; the timing models' quantity):", "",
           "| scheme | " + " | ".join(f"vs {LABEL[b]}" for b in BASELINES) + " |",
           "|---|" + "---:|" * len(BASELINES)]
    for s in SCHEMES:
        r = D["rows"].get(s)
        if r:
            md.append(f"| {LABEL[s]} | " + " | ".join(
                f"{D['rows'][b]['iter_s'] / r['iter_s']:.2f}x" if b in D["rows"] else "-" for b in BASELINES) + " |")
    md += ["", f"Speedup in time to {target} test accuracy (baseline's time / scheme's time; `-`: one of them never reached it). "
           "Accuracy is measured after each epoch only, so a time to target is the end of the first epoch at or above the "
           "target: coarse (an epoch is a fifth of the run), and it also reflects how fast each scheme learns per step "
           "(staleness, DDP's different shuffle):", "",
           "| scheme | " + " | ".join(f"vs {LABEL[b]}" for b in BASELINES) + " |",
           "|---|" + "---:|" * len(BASELINES)]
    for s in SCHEMES:
        r = D["rows"].get(s)
        if not r:
            continue
        cells = []
        for b in BASELINES:
            rb = D["rows"].get(b)
            if rb and rb["reach"] and r["reach"]:
                cells.append(f"{rb['reach'] / r['reach']:.2f}x")
            else:
                cells.append("-")
        md.append(f"| {LABEL[s]} | " + " | ".join(cells) + " |")
    tl = D["timeline"]
    md += ["", "From the timelines (rank 0, steps 20-59 when the rank files are there, else the merged file's 20-29: mean per step of forward + backward + update, and of the AllReduce):", ""]
    for s, v in tl.items():
        if v and s in D["rows"]:
            c, a, n = v
            it = D["rows"][s]["iter_s"]
            md.append(f"- {LABEL[s]}: compute {c * 1e3:.2f} ms, AllReduce {a * 1e3:.2f} ms, iteration {it * 1e3:.2f} ms; "
                      f"max(compute, AllReduce) = {max(c, a) * 1e3:.2f} ms ({(it / max(c, a) - 1) * 100:+.0f}%), "
                      f"compute + AllReduce = {(c + a) * 1e3:.2f} ms")
    md += ["", f"![accuracy against wall-clock time, {rate}](speedup_lab_accuracy_{rate}.png)", ""]

# Targets.
md += ["## The issue's targets, checked", ""]
for rate in RATES:
    R = data[rate]["rows"]
    tl = data[rate]["timeline"].get("ring_k2")
    if tl and "ring_k2" in R:
        c, a, _ = tl
        it = R["ring_k2"]["iter_s"]
        ok = abs(it / max(c, a) - 1) <= 0.10
        md.append(f"- {rate}: width 2 iteration {it * 1e3:.1f} ms vs max(compute {c * 1e3:.1f}, AllReduce {a * 1e3:.1f}) "
                  f"= {max(c, a) * 1e3:.1f} ms: {(it / max(c, a) - 1) * 100:+.0f}%, **{'met' if ok else 'not met'}** (within 10%).")
    errs = [(s, (R[s]["pred_s"] - R[s]["iter_s"]) / R[s]["iter_s"]) for s in SCHEMES if s in R]
    bad = [f"{LABEL[s]} {e * 100:+.0f}%" for s, e in errs if abs(e) > 0.15]
    md.append(f"- {rate}: model within 15% of the measured iteration time for {len(errs) - len(bad)} of {len(errs)} schemes"
              + (f"; **not met** for: {', '.join(bad)}." if bad else ": **met**."))
    pipes = [s for s in SCHEMES if s.startswith("ring") and s in R and R[s]["reach"]]
    if pipes and "ddp" in R:
        best = min(pipes, key=lambda s: R[s]["reach"])
        if R["ddp"]["reach"]:
            sp = R["ddp"]["reach"] / R[best]["reach"]
            fastest = min((s for s in SCHEMES if s.startswith("ring") and s in R), key=lambda s: R[s]["iter_s"])
            md.append(f"- {rate}: best pipesgd scheme ({LABEL[best]}, {R[best]['reach']:.1f} s) vs DDP "
                      f"({R['ddp']['reach']:.1f} s) in time to {target}: **{sp:.2f}x**" + (" (target 2x at 100mbit: **" + ("met" if sp >= 2 else "not met") + "**)" if rate == "100mbit" else "")
                      + f"; in time per iteration, {LABEL[fastest]} vs DDP: {R['ddp']['iter_s'] / R[fastest]['iter_s']:.2f}x.")
        else:
            md.append(f"- {rate}: DDP did not reach {target}; best pipesgd scheme {LABEL[best]} reached it in {R[best]['reach']:.1f} s.")
    conv = [s for s in ("ps_sync", "ps_async", "ring_k1", "ddp") if s in R and R[s]["reach"]]
    if pipes and conv:
        slow = max(conv, key=lambda s: R[s]["reach"])
        best = min(pipes, key=lambda s: R[s]["reach"])
        sp = R[slow]["reach"] / R[best]["reach"]
        md.append(f"- {rate}: paper's \"up to 5.4x\": best pipesgd ({LABEL[best]}) vs the slowest conventional baseline "
                  f"({LABEL[slow]}) in time to {target}: **{sp:.2f}x** ({'met' if sp >= 5.4 else 'not met'}); Pipe-SGD width 2 "
                  f"without compression vs the same baseline: "
                  + (f"{R[slow]['reach'] / R['ring_k2']['reach']:.2f}x" if R.get('ring_k2', {}).get('reach') else "did not reach")
                  + (f"; width 2 vs width 1 per iteration: {R['ring_k1']['iter_s'] / R['ring_k2']['iter_s']:.2f}x." if 'ring_k1' in R and 'ring_k2' in R else "."))
    if "ring_k1" in R and "ring_k2" in R:
        dacc = (R["ring_k2"]["final"] - R["ring_k1"]["final"]) * 100
        md.append(f"- {rate}: final accuracy width 2 {R['ring_k2']['final']:.4f} vs width 1 {R['ring_k1']['final']:.4f}: "
                  f"{dacc:+.2f} points (**{'met' if dacc >= -0.3 else 'not met'}**, within 0.3 points).")
md += ["", "![measured against predicted iteration time](speedup_lab_predicted.png)", "",
       "Timelines of the width-1 and width-2 runs (Chrome trace-event JSON; open in https://ui.perfetto.dev):",
       "`docs/results/speedup_lab/RATE/SCHEME.timeline.json` for ring_k1, ring_k2, ring_k1_q8, ring_k2_q8 (all ranks",
       "merged, steps 20-29 kept).", ""]

# Plots.
for rate in RATES:
    R = data[rate]["rows"]
    d = os.path.join(results, rate)
    plots = []
    for s in SCHEMES:
        if s not in R:
            continue
        f = os.path.join(d, f"acc_{s}.dat")
        with open(f, "w") as out:
            for w, a in R[s]["curve"][1:]:
                out.write(f"{w} {a}\n")
        plots.append(f"'{f}' using 1:2 with linespoints title '{LABEL[s]}'")
    script = (f"set terminal pngcairo size 900,560\nset output '{prefix}_accuracy_{rate}.png'\n"
              f"set title 'Test accuracy against wall-clock time, links {rate}, 4 workers'\n"
              "set xlabel 'wall-clock time since training started (s)'\nset ylabel 'test accuracy'\n"
              f"set key bottom right\nset grid\nset arrow from graph 0, first {target} to graph 1, first {target} nohead dt 2\n"
              "plot " + ", ".join(plots) + "\n")
    subprocess.run(["gnuplot"], input=script.encode(), check=True)
pts = os.path.join(results, "predicted.dat")
with open(pts, "w") as out:
    for rate in RATES:
        for s, r in data[rate]["rows"].items():
            out.write(f"{r['iter_s'] * 1e3} {r['pred_s'] * 1e3} {rate}:{s}\n")
script = (f"set terminal pngcairo size 800,700\nset output '{prefix}_predicted.png'\n"
          "set title 'Iteration time: timing model against measurement (all schemes, all rates)'\n"
          "set xlabel 'measured (ms)'\nset ylabel 'predicted (ms)'\nset logscale xy\nset grid\nset key top left\n"
          f"plot '{pts}' using 1:2 with points pt 7 title 'scheme at a rate', x title 'predicted = measured', "
          "1.15*x dt 2 title '+15%', 0.85*x dt 2 title '-15%'\n")
subprocess.run(["gnuplot"], input=script.encode(), check=True)
json.dump({r: {"rows": {s: {k: v for k, v in row.items() if k != "curve"} for s, row in data[r]["rows"].items()},
               "timeline": data[r]["timeline"], "best": data[r]["best"]} for r in RATES},
          open(os.path.join(results, "summary.json"), "w"), indent=2)
open(prefix + ".md", "w").write("\n".join(md) + "\n")
print("wrote", prefix + ".md")
