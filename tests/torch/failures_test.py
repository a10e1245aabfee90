"""The pipesgd torch.distributed backend when things go wrong: a killed rank is named on every
survivor within the deadline; bad backend options, and ranks whose options differ, are named
before any collective; a deadline names the rank it waited for.

Run: PYTHONPATH=<build>/python python3 tests/torch/failures_test.py
"""
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import init_method, run_ranks, values  # noqa: E402


def killed_rank(rank, world, victim):
    import datetime
    import torch
    import torch.distributed as dist
    import pipesgd.torch  # noqa: F401
    dist.init_process_group("pipesgd", init_method=init_method(), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    x = torch.ones(1 << 16)
    dist.all_reduce(x)
    if rank == victim:
        os._exit(3)  # no goodbye: as a crash or a kill -9
    start = time.monotonic()
    try:
        for _ in range(3):
            dist.all_reduce(x)
        return "no error"
    except RuntimeError as e:
        return (time.monotonic() - start, str(e))


def bad_option(rank, world, options):
    import torch.distributed as dist
    import pipesgd.torch  # noqa: F401
    try:
        dist.init_process_group("pipesgd", init_method=init_method(), rank=rank, world_size=world,
                                pg_options=options(rank))
        return "connected"
    except ValueError as e:
        return str(e)


def env_option(rank, world, value):
    os.environ["PIPESGD_COMM"] = value
    import torch.distributed as dist
    import pipesgd.torch  # noqa: F401
    try:
        dist.init_process_group("pipesgd", init_method=init_method(), rank=rank, world_size=world)
        return "connected"
    except ValueError as e:
        return str(e)


def _transport_bogus(rank):
    return {"transport": "bogus"}


def _chunk_differs(rank):
    return {"chunk_bytes": 4096 if rank == 2 else 8192}


def _not_a_dict(rank):
    return ["transport=tcp"]


class Failures(unittest.TestCase):
    def test_a_killed_rank_is_named_on_every_survivor(self):
        results = run_ranks(killed_rank, 4, 2, expect_exit=(2,), timeout=90)
        for rank in (0, 1, 3):
            status, value = results[rank]
            self.assertEqual(status, "ok", value)
            self.assertIsInstance(value, tuple, f"rank {rank}: {value}")
            seconds, text = value
            self.assertIn("rank 2", text, f"rank {rank}")
            self.assertLess(seconds, 30, f"rank {rank}: {text}")

    def test_a_bad_option_is_named(self):
        got = values(run_ranks(bad_option, 2, _transport_bogus), self)
        for text in got:
            self.assertIn("comm.transport", text)
            self.assertIn("bogus", text)

    def test_ranks_whose_options_differ_fail_on_every_rank_naming_one(self):
        got = values(run_ranks(bad_option, 3, _chunk_differs), self)
        for rank, text in enumerate(got):
            self.assertIn("settings differ", text, f"rank {rank}")
            self.assertIn("chunk_bytes", text, f"rank {rank}")

    def test_options_must_be_a_dict(self):
        got = values(run_ranks(bad_option, 1, _not_a_dict), self)
        self.assertIn("pg_options must be a dict", got[0])

    def test_a_bad_environment_setting_is_named(self):
        got = values(run_ranks(env_option, 1, "streams=99"), self)
        self.assertIn("comm.streams", got[0])
        self.assertIn("99", got[0])
        got = values(run_ranks(env_option, 1, "transport"), self)
        self.assertIn("PIPESGD_COMM='transport'", got[0])


if __name__ == "__main__":
    unittest.main()
