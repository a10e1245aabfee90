#!/usr/bin/python3
"""pipesgd's Fashion-MNIST jobs in PyTorch DDP (gloo backend), the peer of
bench/time_to_accuracy_lab.sh.

Same models (--model mlp: 784-256-128-10 with ReLU, configs/fashion_mnist_mlp.pbtxt; --model cnn:
conv5x5-16 relu pool2, conv5x5-32 relu pool2, 1568-128 relu, 10, configs/fashion_mnist_cnn.pbtxt),
data (Fashion-MNIST IDX files, the first --train-limit / --test-limit samples, standardised with
mean 0.2860 and std 0.3530), batch size per worker, SGD learning rate and momentum (PyTorch's
convention, as pipesgd's), epochs. Each rank trains on its contiguous slice of every global batch
of a per-epoch shuffle (pipesgd's sampler draws a different permutation; the statistics are the
same).

The test set is evaluated every --eval-every-steps global steps and at each epoch's end (each
rank its shard, summed with all_reduce); rank 0 appends one JSON line per evaluation to
--metrics, with pipesgd's keys: step, epoch, epoch_end, wall_s (training time since the first
step, evaluations left out, as pipesgd's), eval_s, train_loss (mean over the steps since the
previous evaluation, over ranks), test_loss, test_accuracy, samples_per_s.

DDP's own settings: the defaults (25 MB buckets, gradients reduced during backward), or with
--fp16-hook its documented fp16 gradient compression (torch.distributed.algorithms.ddp_comm_hooks
.default_hooks.fp16_compress_hook), or with --post-local-sgd H its documented post-local SGD
(torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook with PostLocalSGDState, and
torch.distributed.optim.PostLocalSGDOptimizer with a PeriodicModelAverager of period H): the
gradients are averaged every step for the first --local-sgd-start steps, then each rank steps on
its own gradient and the parameters are averaged every H steps (the momentum buffers stay local,
as PyTorch does it). The hook's post-warm-up AllReduce inside each machine's subgroup is left
out (post_local_gradient_allreduce=False): one rank per machine makes it an AllReduce over one
rank, and PyTorch 1.13 makes that subgroup from the CUDA device count, which a CPU run lacks.
Between averagings the ranks' parameters differ, so an evaluation is on their mean (averaged
into a copy, the run's parameters untouched, its time left out like every evaluation's): the
model the run would give if it averaged there.

One rank per process, torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
Run with Debian's python3-torch: /usr/bin/python3 bench/peers/ddp_train.py --help
"""
import argparse
import gzip
import json
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn


def read_idx(path, limit):
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)
    return arr[:limit] if limit > 0 else arr


def build(model):
    if model == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128),
                             nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def evaluated(model, local_sgd):
    """The model to evaluate: the run's own, or under local SGD a copy holding the ranks' mean."""
    if not local_sgd:
        return model
    import copy
    mean = copy.deepcopy(model)
    flat = torch.cat([q.data.reshape(-1) for q in mean.parameters()])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for q in mean.parameters():
        q.data.copy_(flat[offset:offset + q.numel()].view_as(q))
        offset += q.numel()
    return mean


def main():
    p = argparse.ArgumentParser()
    d = "/usr/share/datasets/fashion-mnist/"
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--train-images", default=d + "train-images-idx3-ubyte.gz")
    p.add_argument("--train-labels", default=d + "train-labels-idx1-ubyte.gz")
    p.add_argument("--test-images", default=d + "t10k-images-idx3-ubyte.gz")
    p.add_argument("--test-labels", default=d + "t10k-labels-idx1-ubyte.gz")
    p.add_argument("--train-limit", type=int, default=0)
    p.add_argument("--test-limit", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--eval-every-steps", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fp16-hook", action="store_true", help="DDP's fp16_compress_hook")
    p.add_argument("--post-local-sgd", type=int, default=0, metavar="H",
                   help="PyTorch's post-local SGD, parameters averaged every H steps (H >= 2)")
    p.add_argument("--local-sgd-start", type=int, default=50, metavar="N",
                   help="with --post-local-sgd: gradients averaged every step for the first N")
    p.add_argument("--metrics", default="", help="rank 0 writes JSON lines here")
    args = p.parse_args()
    if args.post_local_sgd == 1 or args.post_local_sgd < 0:
        p.error(f"--post-local-sgd {args.post_local_sgd}: expected an averaging period H >= 2 "
                "(H = 1 is plain DDP)")
    if args.fp16_hook and args.post_local_sgd:
        p.error("--fp16-hook and --post-local-sgd: expected one DDP communication hook, not both")
    if args.local_sgd_start < 0:
        p.error(f"--local-sgd-start {args.local_sgd_start}: expected a step count >= 0")

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    def load(images, labels, limit):
        x = read_idx(images, limit).reshape(-1, 1, 28, 28).astype(np.float32) / 255.0
        x = (x - 0.2860) / 0.3530
        y = read_idx(labels, limit).astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)

    xtr, ytr = load(args.train_images, args.train_labels, args.train_limit)
    xte, yte = load(args.test_images, args.test_labels, args.test_limit)
    model = build(args.model)
    ddp = nn.parallel.DistributedDataParallel(model)
    if args.fp16_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    scheme = " + fp16 hook" if args.fp16_hook else ""
    if args.post_local_sgd:
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pls
        from torch.distributed.algorithms.model_averaging import averagers
        from torch.distributed.optim import PostLocalSGDOptimizer
        state = pls.PostLocalSGDState(process_group=None, subgroup=None,
                                      start_localSGD_iter=args.local_sgd_start,
                                      post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, pls.post_localSGD_hook)
        opt = PostLocalSGDOptimizer(optim=opt, averager=averagers.PeriodicModelAverager(
            period=args.post_local_sgd, warmup_steps=args.local_sgd_start))
        scheme = f" + post-local SGD, H = {args.post_local_sgd} after {args.local_sgd_start} steps"
    loss_fn = nn.CrossEntropyLoss()
    b = args.batch_size
    steps_per_epoch = len(xtr) // (b * world)
    total = steps_per_epoch * args.epochs
    params = sum(q.numel() for q in model.parameters())
    if rank == 0:
        print(f"ddp: {world} ranks, gloo{scheme}, "
              f"{args.model} {params} params, {steps_per_epoch} steps per epoch of global batch "
              f"{b * world}", flush=True)
    metrics = open(args.metrics, "w") if rank == 0 and args.metrics else None
    n = len(xte)
    lo, hi = n * rank // world, n * (rank + 1) // world

    dist.barrier()
    start = time.time()
    eval_s = 0.0
    loss_sum, loss_steps, last_eval_step, last_eval_wall = 0.0, 0, 0, 0.0
    step = 0
    acc = 0.0
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        perm = torch.randperm(len(xtr), generator=g)
        for s in range(steps_per_epoch):
            idx = perm[(s * world + rank) * b:(s * world + rank + 1) * b]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.item()
            loss_steps += 1
            step += 1
            epoch_end = s + 1 == steps_per_epoch
            if not (epoch_end or (args.eval_every_steps > 0 and step % args.eval_every_steps == 0)):
                continue
            wall = time.time() - start - eval_s
            t_eval = time.time()
            with torch.no_grad():
                out = evaluated(model, args.post_local_sgd)(xte[lo:hi])
                correct = (out.argmax(1) == yte[lo:hi]).sum().item()
                test_loss = nn.functional.cross_entropy(out, yte[lo:hi], reduction="sum").item()
            t = torch.tensor([float(correct), float(hi - lo), test_loss, loss_sum, float(loss_steps)],
                             dtype=torch.float64)
            dist.all_reduce(t)
            eval_s += time.time() - t_eval
            acc = t[0].item() / t[1].item()
            if rank == 0:
                line = {"step": step, "epoch": epoch + 1, "epoch_end": epoch_end, "wall_s": wall,
                        "eval_s": eval_s, "train_loss": t[3].item() / t[4].item(),
                        "test_loss": t[2].item() / t[1].item(), "test_accuracy": acc,
                        "samples_per_s": (step - last_eval_step) * b * world / max(wall - last_eval_wall, 1e-9)}
                where = f"epoch {epoch + 1}/{args.epochs}" + ("" if epoch_end else f" step {step}")
                print(f"ddp {where}: test_accuracy {acc:.4f} wall {wall:.1f} s "
                      f"{line['samples_per_s']:.0f} samples/s", flush=True)
                if metrics:
                    metrics.write(json.dumps(line) + "\n")
                    metrics.flush()
            loss_sum, loss_steps, last_eval_step, last_eval_wall = 0.0, 0, step, wall
    if rank == 0:
        print(f"ddp final test accuracy: {acc:.4f} ({total} steps, {time.time() - start:.1f} s)",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
