"""The pipesgd torch.distributed backend's collectives on real processes over loopback: exact
integer sums on the ring for 2 to 5 ranks and sizes up to 2^24 float32 elements, averages
bitwise the same on every rank, every dtype the backend takes, broadcast / all_gather /
reduce_scatter / barrier, async Work objects, and the rank count of the default group.

Run: PYTHONPATH=<build>/python python3 tests/torch/collectives_test.py [-k NAME]
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import init_method, run_ranks, values  # noqa: E402

SIZES = [0, 1, 7, 1000, (1 << 20) + 3]


def _init(rank, world, options=None):
    import torch.distributed as dist
    import pipesgd.torch  # noqa: F401 (registers the backend)
    dist.init_process_group("pipesgd", init_method=init_method(), rank=rank, world_size=world,
                            pg_options=options)
    return dist


def ring_sums(rank, world, sizes, options):
    """Float32 integers whose sums stay below 2^24: exact. Returns the first wrong element."""
    import torch
    dist = _init(rank, world, options)
    for n in sizes:
        i = torch.arange(n, dtype=torch.int64)
        x = ((i % 4093) * (rank + 1)).to(torch.float32)
        want = ((i % 4093) * (world * (world + 1) // 2)).to(torch.float32)
        dist.all_reduce(x)
        if not torch.equal(x, want):
            bad = int((x != want).nonzero()[0])
            return f"size {n}: element {bad} is {x[bad].item()}, expected {want[bad].item()}"
        y = ((i % 4093) * (rank + 1)).to(torch.float32)
        dist.all_reduce(y, op=dist.ReduceOp.AVG)
        # The block's owner divides the exact float32 sum once; the all-gather copies its bits.
        if not torch.equal(y, want / world):
            return f"size {n}: the average differs from the float32 sum / {world}"
    dist.destroy_process_group()
    return "ok"


def every_dtype_and_op(rank, world):
    import torch
    dist = _init(rank, world)
    out = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64):
        t = torch.tensor([rank + 1, 2 * rank, 7], dtype=dtype)
        dist.all_reduce(t)
        out[f"sum {dtype}"] = t.tolist()
    for op in ("MIN", "MAX", "PRODUCT"):
        t = torch.tensor([rank + 1, -rank, 3], dtype=torch.int64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[op] = t.tolist()
    t = torch.tensor([1 << rank], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.BOR)
    out["BOR"] = t.tolist()
    d = torch.tensor([0.1 * (rank + 1)], dtype=torch.float64)
    dist.all_reduce(d, op=dist.ReduceOp.AVG)
    out["avg float64"] = d.tolist()
    errors = []
    for bad in (lambda: dist.all_reduce(torch.tensor([1]), op=dist.ReduceOp.AVG),
                lambda: dist.all_reduce(torch.ones(4, 4).t()),
                lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)):
        try:
            bad()
            errors.append("accepted")
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
    out["errors"] = errors
    dist.barrier()
    dist.destroy_process_group()
    return out


def moves(rank, world):
    """broadcast, all_gather, reduce_scatter and barrier; float32 bit patterns that are
    signalling NaNs and int64 values arrive bitwise."""
    import warnings
    import torch
    warnings.simplefilter("ignore", UserWarning)  # the private _*_base calls are tested on purpose
    dist = _init(rank, world)
    out = {}
    for root in range(world):
        bits = torch.tensor([0x7F800001, -1, root, rank], dtype=torch.int32)
        f = bits.view(torch.float32).clone()
        dist.broadcast(f, src=root)
        out[f"broadcast {root}"] = f.view(torch.int32).tolist()
    big = torch.arange(3 << 20, dtype=torch.int64) * (rank + 1)
    dist.broadcast(big, src=world - 1)
    out["broadcast int64 exact"] = bool(torch.equal(big, torch.arange(3 << 20, dtype=torch.int64) * world))
    mine = torch.tensor([rank, 10 * rank, 100 * rank], dtype=torch.int64)
    gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, mine)
    out["all_gather"] = [g.tolist() for g in gathered]
    flat = torch.zeros(3 * world, dtype=torch.int64)
    dist._all_gather_base(flat, mine)
    out["all_gather_base"] = flat.tolist()
    inputs = [torch.full((2,), float(rank + 10 * r)) for r in range(world)]
    part = torch.zeros(2)
    dist.reduce_scatter(part, inputs)
    out["reduce_scatter"] = part.tolist()
    whole = torch.cat(inputs)
    part2 = torch.zeros(2)
    dist._reduce_scatter_base(part2, whole)
    out["reduce_scatter_base"] = part2.tolist()
    work = dist.all_reduce(torch.ones(5), async_op=True)
    work.wait()
    out["async"] = work.is_completed()
    fut = dist.all_reduce(torch.ones(3), async_op=True).get_future()
    out["future"] = fut.wait()[0].tolist()
    dist.barrier()
    out["backend"] = dist.get_backend()
    dist.destroy_process_group()
    return out


class Collectives(unittest.TestCase):
    def test_exact_sums_on_two_to_five_ranks(self):
        for world in (2, 3, 4, 5):
            with self.subTest(world=world):
                got = values(run_ranks(ring_sums, world, SIZES, None), self)
                self.assertEqual(got, ["ok"] * world)

    def test_exact_sums_up_to_two_to_the_24(self):
        sizes = [1 << 24]
        got = values(run_ranks(ring_sums, 3, sizes, {"chunk_bytes": "auto"}, timeout=300), self)
        self.assertEqual(got, ["ok"] * 3)

    def test_exact_sums_over_ucx(self):
        from pipesgd import _torch
        if "ucx" not in _torch.transports():
            self.skipTest("this build has no UCX transport")
        for world in (2, 3, 4, 5):
            with self.subTest(world=world):
                got = values(run_ranks(ring_sums, world, SIZES, {"transport": "ucx"}), self)
                self.assertEqual(got, ["ok"] * world)

    def test_every_dtype_and_op(self):
        world = 3
        got = values(run_ranks(every_dtype_and_op, world), self)
        for out in got:
            for key in ("sum torch.float16", "sum torch.bfloat16", "sum torch.float64",
                        "sum torch.int32", "sum torch.int64"):
                self.assertEqual(out[key], [6, 6, 21], key)
            self.assertEqual(out["MIN"], [1, -2, 3])
            self.assertEqual(out["MAX"], [3, 0, 3])
            self.assertEqual(out["PRODUCT"], [6, 0, 27])
            self.assertEqual(out["BOR"], [7])
            # 0.1 + 0.2 + 0.30000000000000004 folded in rank order, then / 3, as float64.
            self.assertEqual(out["avg float64"], [((0.1 + 0.2) + 0.30000000000000004) / 3])
            self.assertIn("AVG needs a floating-point tensor", out["errors"][0])
            self.assertIn("contiguous", out["errors"][1])
            self.assertIn("bitwise ops need an integer or bool tensor", out["errors"][2])
        # Every rank the same values (the error texts name their own rank).
        self.assertEqual(len({repr({k: v for k, v in o.items() if k != "errors"}) for o in got}),
                         1, "ranks differ")

    def test_moves_are_bitwise(self):
        world = 4
        # Through env:// (MASTER_ADDR, MASTER_PORT), as torchrun and pipesgd run start ranks.
        got = values(run_ranks(moves, world, env_init=True), self)
        for rank, out in enumerate(got):
            for root in range(world):
                self.assertEqual(out[f"broadcast {root}"], [0x7F800001, -1, root, root])
            self.assertTrue(out["broadcast int64 exact"])
            self.assertEqual(out["all_gather"], [[r, 10 * r, 100 * r] for r in range(world)])
            self.assertEqual(out["all_gather_base"],
                             [v for r in range(world) for v in (r, 10 * r, 100 * r)])
            # Rank `rank` keeps part `rank` of the sum over ranks q of (q + 10 * rank).
            want = float(sum(q + 10 * rank for q in range(world)))
            self.assertEqual(out["reduce_scatter"], [want, want])
            self.assertEqual(out["reduce_scatter_base"], [want, want])
            self.assertTrue(out["async"])
            self.assertEqual(out["future"], [4.0, 4.0, 4.0])
            self.assertEqual(out["backend"].lower(), "pipesgd")


if __name__ == "__main__":
    unittest.main()
