"""Runs a test case on N real processes that form a torch.distributed group (the torch tier's
multi-process harness). Each rank is a fresh `python3` (spawn), so nothing is inherited but the
arguments; a rank's return value (anything picklable) or its exception text comes back.

The ranks meet through a file store (init_method()) unless a test asks for env://: a port picked
free by the parent can be taken by a parallel ctest before rank 0's TCPStore binds it, and the
other ranks then wait for a store that never answers (seen once in CI)."""
import multiprocessing as mp
import os
import socket
import tempfile
import traceback


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_method():
    """What a test passes to init_process_group: the run's file store, or env://."""
    return os.environ.get("PIPESGD_TEST_INIT_METHOD", "env://")


def _entry(fn, rank, world, port, store, args, queue):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "WORLD_SIZE": str(world)})
    if store:
        os.environ["PIPESGD_TEST_INIT_METHOD"] = "file://" + store
    try:
        import torch
        torch.set_num_threads(1)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # noqa: B902 (the parent reports it)
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn, world, *args, timeout=120, expect_exit=(), env_init=False):
    """fn(rank, world, *args) on `world` processes; returns {rank: ("ok", value) or ("error",
    text)}. Ranks in expect_exit may leave without answering (they kill themselves). env_init:
    the ranks meet through env:// (MASTER_ADDR, MASTER_PORT) instead of a file store."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    store_dir = tempfile.mkdtemp(prefix="pipesgd-torch-test-")
    store = "" if env_init else os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, store, args, queue))
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
        for name in os.listdir(store_dir):
            os.remove(os.path.join(store_dir, name))
        os.rmdir(store_dir)
    return results


def values(results, testcase):
    """The ranks' values, failing `testcase` with every failed rank's text."""
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    testcase.assertEqual(errors, {}, "\n".join(f"rank {r}: {t}" for r, t in errors.items()))
    return [results[r][1] for r in sorted(results)]
