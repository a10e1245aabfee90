"""Runs a test case on N real processes that form a torch.distributed group (the torch tier's
multi-process harness). Each rank is a fresh `python3` (spawn), so nothing is inherited but the
arguments; a rank's return value (anything picklable) or its exception text comes back."""
import multiprocessing as mp
import os
import socket
import traceback


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, args, queue):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "WORLD_SIZE": str(world)})
    try:
        import torch
        torch.set_num_threads(1)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # noqa: B902 (the parent reports it)
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn, world, *args, timeout=120, expect_exit=()):
    """fn(rank, world, *args) on `world` processes; returns {rank: ("ok", value) or ("error",
    text)}. Ranks in expect_exit may leave without answering (they kill themselves)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        want = world - len(expect_exit)
        while len(results) < want:
            rank, status, value = queue.get(timeout=timeout)
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def values(results, testcase):
    """The ranks' values, failing `testcase` with every failed rank's text."""
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    testcase.assertEqual(errors, {}, "\n".join(f"rank {r}: {t}" for r, t in errors.items()))
    return [results[r][1] for r in sorted(results)]
