#!/usr/bin/python3
"""Train a PyTorch model on Fashion-MNIST with DDP on pipesgd's torch.distributed backend (or on
gloo, to compare): the example to copy (docs/torch.md).

With pipesgd built with PyTorch, one rank per process, four ways to start four ranks:

    export PYTHONPATH=<build>/python
    pipesgd run -np 4 -- /usr/bin/python3 examples/torch/train_fashion_mnist.py --model mlp \\
        --backend pipesgd --compression q8 --error-feedback --out runs/torch_q8
    torchrun --nproc_per_node 4 examples/torch/train_fashion_mnist.py --backend pipesgd
    srun -n 4 /usr/bin/python3 examples/torch/train_fashion_mnist.py --backend pipesgd
    mpirun -np 4 -x PYTHONPATH /usr/bin/python3 examples/torch/train_fashion_mnist.py \\
        --backend pipesgd

Gradient compression, one at a time: --compression CODEC [--error-feedback] (pipesgd's codecs
inside the ring), --powersgd-rank R (pipesgd's PowerSGD), or PyTorch's own DDP hooks with
--hook fp16 / --hook powersgd --powersgd-rank R (on either backend). pipesgd's comm settings
come from PIPESGD_COMM (e.g. PIPESGD_COMM=transport=ucx,chunk_bytes=auto).

Each rank trains on its contiguous slice of every global batch (--batch per worker) of a
per-epoch shuffle seeded by --seed. The test set is evaluated every --eval-every global steps
and at each epoch's end; with --out DIR rank 0 writes DIR/metrics.jsonl and DIR/summary.json in
pipesgd's own schema, so `pipesgd report runs/torch_q8 runs/native_q8` compares the two.
--timeline FILE writes a Chrome trace of --timeline-steps steps (20) of every rank
(pipesgd.torch.Timeline: forward, backward, the optimizer's parts and the backend's collectives;
open it in ui.perfetto.dev).
"""
import argparse
import contextlib
import gzip
import json
import os
import shlex
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

PROG = os.path.basename(sys.argv[0])
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
         "t10k-labels-idx1-ubyte")
WARMUP_STEPS = 10  # left out of steady_step_s, as pipesgd's jobs do


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def build(model):
    # mlp and cnn are configs/fashion_mnist_mlp.pbtxt's and fashion_mnist_cnn.pbtxt's models.
    if model == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128),
                             nn.ReLU(), nn.Linear(128, 10))
    if model == "cnn":
        return nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(),
                             nn.Linear(128, 10))
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn", "resnet"], default="mlp")
    p.add_argument("--batch", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=0,
                   help="global steps between evaluations (0: only at epoch ends)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--backend", choices=["gloo", "pipesgd"], default="pipesgd")
    p.add_argument("--hook", choices=["none", "fp16", "powersgd"], default="none",
                   help="PyTorch's own DDP communication hooks")
    p.add_argument("--width", type=int, choices=[1, 2], default=1,
                   help="1: DDP; 2: Pipe-SGD (pipesgd.torch.PipelinedOptimizer, no DDP)")
    p.add_argument("--sync-warmup-steps", type=int, default=None,
                   help="--width 2: synchronous steps before the pipeline starts (50)")
    p.add_argument("--staleness-compensation", default=None,
                   choices=["local_gradient", "momentum", "none"],
                   help="--width 2: where each gradient is computed (docs/staleness.md; "
                        "local_gradient)")
    p.add_argument("--compression", default="none",
                   choices=["none", "trunc16", "fp16", "q8", "q4", "sign1"],
                   help="pipesgd's codec hook (--backend pipesgd)")
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--powersgd-rank", type=int, default=0,
                   help="pipesgd's PowerSGD (--backend pipesgd), or with --hook powersgd PyTorch's")
    p.add_argument("--out", default="", help="rank 0 writes metrics.jsonl and summary.json here")
    p.add_argument("--train-limit", type=int, default=0, help="first N samples (0: all)")
    p.add_argument("--test-limit", type=int, default=0, help="first N samples (0: all)")
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist/")
    p.add_argument("--timeline", default="",
                   help="FILE: a Chrome trace of --timeline-steps steps, every rank's (rank 0 "
                        "writes it; the format of pipesgd run --timeline)")
    p.add_argument("--timeline-first-step", default="auto",
                   help="the first step recorded (auto: the first steady one, after "
                        "--sync-warmup-steps at --width 2, plus 10)")
    p.add_argument("--timeline-steps", type=int, default=20)
    a = p.parse_args()
    # Checked before any rank connects, so every rank stops with the same message.
    if a.width == 1:
        for flag, value in (("--sync-warmup-steps", a.sync_warmup_steps),
                            ("--staleness-compensation", a.staleness_compensation)):
            if value is not None:
                p.error(f"{flag} {value}: a setting of --width 2 (Pipe-SGD); this run is "
                        "--width 1")
    a.sync_warmup_steps = 50 if a.sync_warmup_steps is None else a.sync_warmup_steps
    a.staleness_compensation = a.staleness_compensation or "local_gradient"
    if a.width == 2 and a.hook != "none":
        p.error(f"--width 2 --hook {a.hook}: Pipe-SGD replaces DDP, so PyTorch's DDP hooks do not "
                "apply; pipesgd's own compress the pipelined AllReduce (--compression CODEC "
                "--error-feedback, or --powersgd-rank R)")
    for name, value, low in (("--batch", a.batch, 1), ("--epochs", a.epochs, 1),
                             ("--sync-warmup-steps", a.sync_warmup_steps, 0),
                             ("--eval-every", a.eval_every, 0), ("--train-limit", a.train_limit, 0),
                             ("--test-limit", a.test_limit, 0)):
        if value < low:
            p.error(f"{name} {value}: expected an integer >= {low}")
    if a.timeline_first_step != "auto":
        given = a.timeline_first_step
        try:
            a.timeline_first_step = int(given)
        except ValueError:
            a.timeline_first_step = -1
        if a.timeline_first_step < 0:
            p.error(f"--timeline-first-step {given}: expected auto or an integer >= 0")
    if a.timeline_steps < 1:
        p.error(f"--timeline-steps {a.timeline_steps}: expected an integer >= 1")
    if not a.lr > 0 or not 0 <= a.momentum < 1:
        p.error(f"--lr {a.lr} --momentum {a.momentum}: expected lr > 0 and momentum in [0, 1)")
    if a.compression != "none" and a.backend != "pipesgd":
        p.error(f"--compression {a.compression} needs --backend pipesgd (pipesgd's codec hook)")
    if a.compression != "none" and a.hook != "none":
        p.error(f"--compression {a.compression} and --hook {a.hook} both compress the gradients; "
                "choose one")
    if a.error_feedback and a.compression == "none":
        p.error("--error-feedback needs --compression other than none (PowerSGD keeps its own)")
    if not 0 <= a.powersgd_rank <= 64:
        p.error(f"--powersgd-rank {a.powersgd_rank}: expected an integer in [0, 64] (0: off)")
    if a.hook == "powersgd" and a.powersgd_rank == 0:
        p.error("--hook powersgd needs its rank: --powersgd-rank R with R >= 1 (e.g. 4)")
    if a.powersgd_rank and a.hook == "fp16":
        p.error("--powersgd-rank and --hook fp16 both compress the gradients; choose one")
    if a.powersgd_rank and a.hook == "none":
        if a.compression != "none":
            p.error(f"--powersgd-rank and --compression {a.compression} both compress the "
                    "gradients; choose one")
        if a.backend != "pipesgd":
            p.error("--powersgd-rank without --hook powersgd is pipesgd's PowerSGD and needs "
                    "--backend pipesgd; for PyTorch's PowerSGD add --hook powersgd")
    return a


def launcher_name():
    # pipesgd's own names (transport/launch_env.cc), read before launch_env() sets RANK.
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return "RANK/WORLD_SIZE"
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        return "Open MPI"
    return "Slurm" if "SLURM_PROCID" in os.environ else "none"


def import_pipesgd(backend, launcher, width, timeline):
    """pipesgd.torch, or None where gloo can do without it (RANK etc. already set, DDP)."""
    try:
        import pipesgd.torch
        return pipesgd.torch
    except ImportError as e:
        if (backend == "gloo" and launcher in ("RANK/WORLD_SIZE", "none") and width == 1
                and not timeline):
            return None
        need = ("--backend pipesgd" if backend == "pipesgd" else "--width 2" if width == 2
                else "--timeline" if timeline else f"reading {launcher}'s ranks")
        sys.exit(f"{PROG}: {need} needs pipesgd.torch, which cannot be imported ({e}); set "
                 "PYTHONPATH=<build>/python (a pipesgd build configured with PyTorch)")


def read_idx(path, limit):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)
    return arr[:limit] if limit > 0 else arr


def load_data(args):
    paths = []
    for name in FILES:
        found = [os.path.join(args.data_dir, name + s) for s in (".gz", "")]
        found = [f for f in found if os.path.exists(f)]
        if not found:
            sys.exit(f"{PROG}: {os.path.join(args.data_dir, name + '.gz')}: not found; install "
                     "Debian's dataset-fashion-mnist package, or pass --data-dir DIR holding "
                     "Fashion-MNIST's IDX files (gzipped or not)")
        paths.append(found[0])

    def load(images, labels, limit):
        # Standardised with the training set's pixel mean and std, as pipesgd's configs do.
        x = read_idx(images, limit).reshape(-1, 1, 28, 28).astype(np.float32) / 255.0
        y = read_idx(labels, limit).astype(np.int64)
        return torch.from_numpy((x - 0.2860) / 0.3530), torch.from_numpy(y)
    return load(paths[0], paths[1], args.train_limit) + load(paths[2], paths[3], args.test_limit)


def evaluate(model, x, y):
    """(correct, samples, summed loss) of this rank's shard, in eval mode for batch norm."""
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), 1000):  # bounds the activations of the residual network
            out = model(x[i:i + 1000])
            correct += (out.argmax(1) == y[i:i + 1000]).sum().item()
            loss += nn.functional.cross_entropy(out, y[i:i + 1000], reduction="sum").item()
    model.train()
    return correct, len(x), loss


def address_toward(master):
    """This rank's address on the route toward the master (no packet is sent), or "" if none."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in master else socket.AF_INET,
                           socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return s.getsockname()[0]
    except (OSError, ValueError):
        return ""


def counting(hook, count):
    # wire_stats() is the last hook call's: a step's bytes are known only with one bucket.
    def counted(state, bucket):  # DDP checks the parameter is named "bucket"
        count["calls"] += 1
        if bucket.is_last():
            count["buckets"], count["calls"] = count["calls"], 0
        return hook(state, bucket)
    return counted


def distribute(args, model, pt, count, timeline):
    """(the module to call, its optimizer, the gradients' codec, their compression ratio):
    DDP with a hook at --width 1, pipesgd's PipelinedOptimizer instead of DDP at --width 2."""
    if args.width == 2:
        opt = pt.PipelinedOptimizer(
            torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum), model,
            width=2, sync_warmup_steps=args.sync_warmup_steps,
            compensation=args.staleness_compensation, compression=args.compression,
            error_feedback=args.error_feedback, powersgd_rank=args.powersgd_rank,
            timeline=timeline)
        if args.powersgd_rank:
            return model, opt, f"pipesgd's PowerSGD rank {args.powersgd_rank}", None
        if args.compression != "none":
            ef = " + error feedback" if args.error_feedback else ""
            return model, opt, f"pipesgd's {args.compression}{ef}", None
        return model, opt, "none", 1.0
    ddp = nn.parallel.DistributedDataParallel(model)
    if args.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        codec, ratio = "fp16 (PyTorch's fp16_compress_hook)", 2.0
    elif args.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2,
                                            matrix_approximation_rank=args.powersgd_rank)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        codec, ratio = f"PyTorch's PowerSGD rank {args.powersgd_rank}", None
    elif args.powersgd_rank:
        ddp.register_comm_hook(pt.PowerSgdState(rank=args.powersgd_rank, start_iter=0),
                               counting(pt.powersgd_hook, count))
        codec, ratio = f"pipesgd's PowerSGD rank {args.powersgd_rank}", None
    elif args.compression != "none":
        state = pt.CodecState(codec=args.compression, error_feedback=args.error_feedback)
        ddp.register_comm_hook(state, counting(pt.codec_hook, count))
        codec = f"pipesgd's {args.compression}{' + error feedback' if args.error_feedback else ''}"
        ratio = None
    else:
        codec, ratio = "none", 1.0
    return ddp, torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum), codec, ratio


# One function from set-up to summary, longer than this project's functions usually are: it is
# the training loop a user copies and reads top to bottom, as a PyTorch example is read.
def main():
    t0 = time.time()
    args = parse_args()
    torch.set_num_threads(1)  # one thread per rank, as pipesgd's workers compute
    xtr, ytr, xte, yte = load_data(args)
    launcher = launcher_name()
    pt = import_pipesgd(args.backend, launcher, args.width, args.timeline)
    if pt is not None:
        pt.launch_env()
    if launcher == "none":  # a single process, started by hand
        for key, value in (("RANK", 0), ("WORLD_SIZE", 1), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", 29500)):
            os.environ.setdefault(key, str(value))
    dist.init_process_group(args.backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    b = args.batch
    steps_per_epoch = len(xtr) // (b * world)
    # Where every rank runs, for summary.json (a launcher's placement is checked from it).
    placement = [None] * world
    dist.all_gather_object(placement, (socket.gethostname(),
                                       address_toward(os.environ.get("MASTER_ADDR", ""))))
    if steps_per_epoch == 0:
        sys.exit(f"{PROG}: {len(xtr)} training samples (--train-limit {args.train_limit}) are "
                 f"fewer than one global batch of {b * world} (--batch {b} x {world} ranks)")

    torch.manual_seed(args.seed)
    model = build(args.model)
    params = sum(q.numel() for q in model.parameters())
    count = {"calls": 0, "buckets": 1 if args.width == 2 else 0}
    pipesgd_hook = args.compression != "none" or (args.powersgd_rank > 0 and args.hook == "none")
    pipelined = args.width == 2
    timeline = None
    if args.timeline:
        first, n = args.timeline_first_step, args.timeline_steps
        if first == "auto":
            first = (args.sync_warmup_steps if pipelined else 0) + 10
        total = steps_per_epoch * args.epochs
        if first >= total and args.timeline_first_step != "auto":
            sys.exit(f"{PROG}: --timeline-first-step {first}: this run has only {total} steps "
                     f"({steps_per_epoch} per epoch x {args.epochs} epochs)")
        if first + n > total and args.timeline_first_step == "auto":
            first = max(total - n, 0)  # a short run: its last steps
            if rank == 0 and pipelined and first < args.sync_warmup_steps:
                print(f"{PROG}: the timeline (steps {first}-{first + n - 1} of {total}) starts "
                      f"in the {args.sync_warmup_steps} synchronous warm-up steps", flush=True)
        timeline = pt.Timeline(first_step=first, steps=n)
    net, opt, codec, ratio = distribute(args, model, pt, count, timeline)
    describe = ""
    if args.backend == "pipesgd":
        pg = dist.distributed_c10d._get_default_group()
        if not hasattr(pg, "describe") and hasattr(pg, "_get_backend"):
            pg = pg._get_backend(torch.device("cpu"))  # torch's wrapper around our backend
        describe = pg.describe() if hasattr(pg, "describe") else ""
    transport = describe.split(",")[0].split()[0] if describe else args.backend

    loss_fn = nn.CrossEntropyLoss()
    lo, hi = len(xte) * rank // world, len(xte) * (rank + 1) // world
    metrics = None
    if rank == 0:
        print(f"{PROG}: {world} ranks on {args.backend}{' (' + describe + ')' if describe else ''}"
              f", {args.model} {params} params, compression {codec}, {steps_per_epoch} steps "
              f"per epoch of global batch {b * world}", flush=True)
        if pipelined:
            total = steps_per_epoch * args.epochs
            print(f"{PROG}: Pipe-SGD width 2 ({args.staleness_compensation}) after "
                  f"{args.sync_warmup_steps} synchronous steps"
                  + (f"; all {total} steps of this run are synchronous"
                     if total <= args.sync_warmup_steps else ""), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            metrics = open(os.path.join(args.out, "metrics.jsonl"), "w")

    dist.barrier()
    start, eval_s = time.perf_counter(), 0.0
    step, evaluations, steady_from = 0, 0, None
    loss_sum, loss_steps, last_eval_step, last_eval_wall = 0.0, 0, 0, 0.0
    wire_window, wire_total, wire_known, wire_known_total = 0, 0, True, True
    acc = test_loss = 0.0
    replica_checks, replicas_identical = 0, True
    for epoch in range(args.epochs):
        # The same permutation on every rank; each takes its contiguous slice of a global batch.
        perm = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(
            args.seed * 1000 + epoch))
        for s in range(steps_per_epoch):
            idx = perm[(s * world + rank) * b:(s * world + rank + 1) * b]
            if timeline:
                timeline.at(step)
            span = timeline.span if timeline else lambda name: contextlib.nullcontext()
            opt.zero_grad(set_to_none=True)
            with span("forward"):
                loss = loss_fn(net(xtr[idx]), ytr[idx])
            with span("backward"):
                loss.backward()  # with DDP, returns once DDP has every bucket's average
            if pipelined:
                opt.step()  # its own spans: update, wait_aggregate, predict
            else:
                with span("update"):
                    opt.step()
            loss_sum += loss.item()
            loss_steps += 1
            step += 1
            if pipesgd_hook:
                stats = pt.wire_stats()
                if stats.payload_bytes:
                    ratio = stats.raw_payload_bytes / stats.payload_bytes
                if count["buckets"] == 1:
                    wire_window += stats.bytes_sent
                    wire_total += stats.bytes_sent
                else:
                    wire_known = wire_known_total = False
            if step == WARMUP_STEPS:
                steady_from = time.perf_counter() - start - eval_s
            epoch_end = s + 1 == steps_per_epoch
            if not (epoch_end or (args.eval_every > 0 and step % args.eval_every == 0)):
                continue
            wall = time.perf_counter() - start - eval_s
            t_eval = time.perf_counter()
            with opt.true_weights() if pipelined else contextlib.nullcontext():
                correct, n, summed = evaluate(model, xte[lo:hi], yte[lo:hi])
            if pipelined:  # the replicas' true weights, compared at every evaluation
                digests = [None] * world
                dist.all_gather_object(digests, opt.digest())
                replica_checks += 1
                if len(set(digests)) != 1:
                    replicas_identical = False
                    if rank == 0:
                        print(f"{PROG}: step {step}: the replicas differ (digests {digests})",
                              file=sys.stderr, flush=True)
            t = torch.tensor([correct, n, summed, loss_sum, loss_steps], dtype=torch.float64)
            dist.all_reduce(t)
            eval_s += time.perf_counter() - t_eval
            evaluations += 1
            acc, test_loss = t[0].item() / t[1].item(), t[2].item() / t[1].item()
            window = step - last_eval_step
            wire_step = wire_window / window if pipesgd_hook and wire_known else None
            if rank == 0:
                line = {"step": step, "epoch": epoch + 1, "epoch_end": epoch_end, "wall_s": wall,
                        "eval_s": eval_s, "train_loss": t[3].item() / t[4].item(),
                        "test_loss": test_loss, "test_accuracy": acc,
                        "samples_per_s": window * b * world / max(wall - last_eval_wall, 1e-9),
                        "wire_bytes_per_step": wire_step, "compression_ratio": ratio}
                wire = f" wire {wire_step / 1e6:.3f} MB/step" if wire_step is not None else ""
                print(f"step {step} epoch {epoch + 1}/{args.epochs}: test_accuracy {acc:.4f} "
                      f"test_loss {test_loss:.4f} wall {wall:.1f} s "
                      f"{line['samples_per_s']:.0f} samples/s{wire}", flush=True)
                if metrics:
                    metrics.write(json.dumps(line) + "\n")
                    metrics.flush()
            loss_sum, loss_steps, last_eval_step, last_eval_wall = 0.0, 0, step, wall
            wire_window, wire_known = 0, True
    train_s = time.perf_counter() - start - eval_s
    if timeline:
        timeline.stop()  # finish() and the summary's collectives are no step's
    if pipelined:
        opt.finish()  # no AllReduce left in flight when the group goes
    if timeline:
        spans = timeline.write(args.timeline)
        if rank == 0:
            print(f"{PROG}: timeline of steps {timeline.first_step}-"
                  f"{timeline.first_step + timeline.steps - 1}: {spans} spans in {args.timeline}",
                  flush=True)
    steady = max(step - WARMUP_STEPS, 0)

    if rank == 0:
        print(f"final test accuracy: {acc:.4f} ({step} steps, {train_s:.1f} s of training)",
              flush=True)
    if metrics:
        metrics.close()
        version = pt._torch.version() if pt is not None else "unknown"
        summary = {
            "mode": "TORCH_PIPE_SGD" if pipelined else "TORCH_DDP", "final_test_accuracy": acc, "final_test_loss": test_loss,
            "steps": step, "evaluations": evaluations, "world_size": world, "workers": world,
            "global_batch": b * world,
            # No target in this example: pipesgd's convention for "none".
            "target_accuracy": 0.0, "reached_target": False, "steps_to_target": -1,
            "time_to_target_s": -1.0,
            "wall_s": time.time() - t0, "train_wall_s": train_s, "eval_s": eval_s,
            "steady_step_s": (train_s - steady_from) / steady if steady else 0.0,
            "steady_steps": steady, "transport": transport, "kernels": "torch",
            "wire_bytes": wire_total if pipesgd_hook and wire_known_total else None,
            "version": version,
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "host": socket.gethostname(), "hosts": [h for h, _ in placement],
            "launcher": launcher,
            "command_line": os.environ.get("PIPESGD_COMMAND_LINE")
            or shlex.join([sys.executable] + sys.argv),
            "details": {"torch": torch.__version__, "backend": args.backend,
                        "backend_describe": describe, "hook": args.hook, "gradients": codec,
                        "model": args.model, "parameters": params,
                        "rank_addresses": [a for _, a in placement],
                        "buckets": count["buckets"] if pipesgd_hook else None,
                        "replica_checks": replica_checks if pipelined else None,
                        "replicas_identical": replicas_identical if pipelined else None,
                        "wait_aggregate_s": opt.wait_s if pipelined else None},
            "config": {
                "comm": {"compression": "fp16" if args.hook == "fp16" else args.compression,
                         "error_feedback": args.error_feedback,
                         "powersgd_rank": args.powersgd_rank, "transport": transport},
                "train": {"pipeline_width": args.width, "batch_size": b,
                          "sync_warmup_steps": args.sync_warmup_steps if pipelined else 0,
                          "staleness_compensation": args.staleness_compensation.upper()
                          if pipelined else "NONE",
                          "learning_rate": args.lr, "momentum": args.momentum,
                          "seed": args.seed, "epochs": args.epochs,
                          "eval_every_steps": args.eval_every},
                "data": {"dir": args.data_dir, "train_limit": args.train_limit,
                         "test_limit": args.test_limit}}}
        path = os.path.join(args.out, "summary.json")
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps(summary, indent=2) + "\n")
        os.replace(path + ".tmp", path)  # a reader never sees half a file
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
