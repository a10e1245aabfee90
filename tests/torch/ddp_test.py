"""DDP on the pipesgd backend: at every step of 200, from the same parameters, the same loss as
DDP over gloo and gradients within the bound of float32 addition in another order (the two
backends add the ranks' values in different orders; free-running trajectories then drift apart
once a ReLU flips, so a bound on them would come from one run's digits); pipesgd's codec and
PowerSGD hooks keep every replica bitwise identical and put the codec's bytes on the wire.

Run: PYTHONPATH=<build>/python python3 tests/torch/ddp_test.py
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import init_method, run_ranks, values  # noqa: E402

STEPS = 200


def _mlp(seed):
    import torch
    import torch.nn as nn
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128),
                         nn.ReLU(), nn.Linear(128, 10))


def _batches(rank, steps, batch=64):
    """Fixed pseudo-data: a linear teacher's labels, so the loss falls."""
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(784, 10, generator=torch.Generator().manual_seed(7))
    for _ in range(steps):
        x = torch.randn(batch, 784, generator=g)
        yield x, (x @ teacher).argmax(1)


def _train(model, group, steps, rank, hook=None):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, process_group=group)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in _batches(rank, steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return ddp, losses


def ddp_lockstep(rank, world, steps):
    """DDP over pipesgd (a) and over gloo (b) from the same parameters at every step: b takes a's
    parameters before each step, so the two never drift apart and every step compares the same
    computation. Returns, over all steps: losses bitwise equal or not, the largest gradient
    difference as a fraction of its bound, and how many gradient elements were bitwise equal."""
    import torch
    import torch.distributed as dist
    import pipesgd.torch  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("pipesgd", init_method=init_method(), rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    a = DDP(_mlp(1), process_group=dist.group.WORLD)
    b = DDP(_mlp(1), process_group=gloo)
    local = _mlp(1)  # no DDP: this rank's own gradient, for the bound
    opt = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9)
    # DDP divides each rank's gradient by N, then sums the N values: gloo and pipesgd add them in
    # different orders, and each order's float32 sum is within gamma_{N-1} = (N-1) u of the exact
    # sum of |values| (u = 2^-24), so the two differ by at most 2 (N-1) u sum_r |g_r / N|.
    gamma = 2 * (world - 1) * 2.0 ** -24 * 1.0001
    same_loss, worst, equal, total = True, 0.0, 0, 0
    for x, y in _batches(rank, steps):
        with torch.no_grad():
            for pa, pb, pl in zip(a.parameters(), b.parameters(), local.parameters()):
                pb.copy_(pa)
                pl.copy_(pa)
        for m in (a, b, local):
            m.zero_grad()
        la = torch.nn.functional.cross_entropy(a(x), y)
        la.backward()
        lb = torch.nn.functional.cross_entropy(b(x), y)
        lb.backward()
        torch.nn.functional.cross_entropy(local(x), y).backward()
        same_loss &= la.item() == lb.item()
        for pa, pb, pl in zip(a.parameters(), b.parameters(), local.parameters()):
            magnitude = (pl.grad / world).abs().double()
            dist.all_reduce(magnitude, group=gloo)
            diff = (pa.grad.double() - pb.grad.double()).abs()
            bound = gamma * magnitude + 1e-45  # an exact zero sum may differ by a denormal
            worst = max(worst, float((diff / bound).max()))
            equal += int((pa.grad == pb.grad).sum())
            total += pa.grad.numel()
        opt.step()
    dist.destroy_process_group()
    return same_loss, worst, equal, total


def _replicas_identical(ddp):
    """Every rank's parameters, bitwise, compared on every rank."""
    import torch
    import torch.distributed as dist
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).view(torch.int32)
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], e) for e in everyone)


def hooks(rank, world, steps):
    import torch.distributed as dist
    import pipesgd.torch as pt
    dist.init_process_group("pipesgd", init_method=init_method(), rank=rank, world_size=world)
    out = {}
    for codec, ef in (("none", False), ("trunc16", False), ("fp16", False), ("q8", True),
                      ("q4", True), ("sign1", True)):
        ddp, losses = _train(_mlp(1), None, steps, rank, (pt.CodecState(codec, ef), pt.codec_hook))
        s = pt.wire_stats()
        out[codec] = (losses[0], losses[-1], _replicas_identical(ddp), s.raw_payload_bytes,
                      s.payload_bytes, s.compressed)
    ddp, losses = _train(_mlp(1), None, steps, rank, (pt.PowerSgdState(rank=4), pt.powersgd_hook))
    s = pt.wire_stats()
    out["powersgd"] = (losses[0], losses[-1], _replicas_identical(ddp), s.raw_payload_bytes,
                       s.payload_bytes, s.compressed)
    dist.destroy_process_group()
    return out


class Ddp(unittest.TestCase):
    def test_every_step_matches_ddp_over_gloo_to_the_rounding_bound(self):
        world = 4
        got = values(run_ranks(ddp_lockstep, world, STEPS, timeout=600), self)
        for rank, (same_loss, worst, equal, total) in enumerate(got):
            self.assertTrue(same_loss, f"rank {rank}: a loss differs at equal parameters")
            self.assertLessEqual(worst, 1.0, f"rank {rank}: a gradient beyond the bound "
                                 f"({worst:.3f} of it)")
            print(f"rank {rank}: {equal} of {total} gradient elements bitwise equal to gloo's; "
                  f"the largest difference {worst:.3f} of the bound")

    def test_hooks_keep_replicas_identical_and_send_the_codecs_bytes(self):
        world = 3
        got = values(run_ranks(hooks, world, 30, timeout=600), self)
        # Payload bytes per float32 byte sent, from each codec's format (docs/compression.md),
        # as (lowest, highest) bounds of the ratio raw / payload.
        ratios = {"none": (1, 1), "trunc16": (2, 2), "fp16": (2, 2), "q8": (3.9, 4),
                  "q4": (7.5, 8), "sign1": (25, 32)}
        for rank, out in enumerate(got):
            for name, (first, last, identical, raw, payload, compressed) in out.items():
                self.assertTrue(identical, f"rank {rank} {name}: replicas differ")
                self.assertLess(last, first, f"rank {rank} {name}: the loss did not fall")
                if name in ratios:
                    lo, hi = ratios[name]
                    self.assertEqual(compressed, name != "none", name)
                    self.assertTrue(lo <= raw / payload <= hi,
                                    f"rank {rank} {name}: ratio {raw / payload}")
                else:
                    self.assertTrue(compressed, "powersgd")
                    self.assertGreater(raw / payload, 10, f"powersgd ratio {raw / payload}")


if __name__ == "__main__":
    unittest.main()
