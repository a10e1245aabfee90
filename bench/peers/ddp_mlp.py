#!/usr/bin/python3
"""The pipesgd main job in PyTorch DDP (gloo backend), as the peer of bench/speedup_lab.sh.

Same model (784-256-128-10 MLP with ReLU), data (Fashion-MNIST IDX files, the first
--train-limit / --test-limit samples, standardised with mean 0.2860 and std 0.3530), batch
size per worker, SGD learning rate and momentum (PyTorch's convention, as pipesgd's), epochs.
Each rank trains on its contiguous slice of every global batch of a per-epoch shuffle (pipesgd's
sampler draws a different permutation; the statistics are the same). After every epoch the test
accuracy is summed over ranks with all_reduce; rank 0 appends one JSON line per epoch to
--metrics with the wall-clock time since training started.

One rank per process, torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
Run with Debian's python3-torch: /usr/bin/python3 bench/peers/ddp_mlp.py --help
"""
import argparse
import gzip
import json
import os
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


def main():
    p = argparse.ArgumentParser()
    d = "/usr/share/datasets/fashion-mnist/"
    p.add_argument("--train-images", default=d + "train-images-idx3-ubyte.gz")
    p.add_argument("--train-labels", default=d + "train-labels-idx1-ubyte.gz")
    p.add_argument("--test-images", default=d + "t10k-images-idx3-ubyte.gz")
    p.add_argument("--test-labels", default=d + "t10k-labels-idx1-ubyte.gz")
    p.add_argument("--train-limit", type=int, default=0)
    p.add_argument("--test-limit", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--metrics", default="", help="rank 0 writes JSON lines here")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    def load(images, labels, limit):
        x = read_idx(images, limit).reshape(-1, 784).astype(np.float32) / 255.0
        x = (x - 0.2860) / 0.3530
        y = read_idx(labels, limit).astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)

    xtr, ytr = load(args.train_images, args.train_labels, args.train_limit)
    xte, yte = load(args.test_images, args.test_labels, args.test_limit)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = nn.CrossEntropyLoss()
    b = args.batch_size
    steps_per_epoch = len(xtr) // (b * world)
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"ddp: {world} ranks, gloo, {params} params, {steps_per_epoch} steps per epoch of "
              f"global batch {b * world}", flush=True)
    metrics = open(args.metrics, "w") if rank == 0 and args.metrics else None
    dist.barrier()
    start = time.time()
    steps = 0
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        perm = torch.randperm(len(xtr), generator=g)
        t_epoch = time.time()
        loss_sum = 0.0
        for s in range(steps_per_epoch):
            idx = perm[(s * world + rank) * b:(s * world + rank + 1) * b]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.item()
            steps += 1
        train_s = time.time() - t_epoch
        # Test accuracy of this rank's shard, summed over ranks.
        n = len(xte)
        lo, hi = n * rank // world, n * (rank + 1) // world
        with torch.no_grad():
            correct = (model(xte[lo:hi]).argmax(1) == yte[lo:hi]).sum().item()
        t = torch.tensor([float(correct), float(hi - lo), loss_sum])
        dist.all_reduce(t)
        acc = t[0].item() / t[1].item()
        wall = time.time() - start
        if rank == 0:
            line = {"epoch": epoch + 1, "steps": steps, "test_accuracy": acc, "wall_s": wall,
                    "train_loss": t[2].item() / (world * steps_per_epoch),
                    "samples_per_s": steps_per_epoch * b * world / train_s}
            print(f"ddp epoch {epoch + 1}/{args.epochs}: test_accuracy {acc:.4f} wall {wall:.1f} s "
                  f"{line['samples_per_s']:.0f} samples/s", flush=True)
            if metrics:
                metrics.write(json.dumps(line) + "\n")
                metrics.flush()
    if rank == 0:
        print(f"ddp final test accuracy: {acc:.4f} ({steps} steps, {time.time() - start:.1f} s)",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
