"""The "pipesgd" torch.distributed backend (docs/torch.md).

    import torch.distributed as dist
    import pipesgd.torch                      # registers the backend
    pipesgd.torch.launch_env()                # RANK etc. from srun or mpirun, where unset
    dist.init_process_group("pipesgd")        # env://, or any init_method / store

Backend options are pipesgd's comm.* settings (configs/pipesgd.proto), checked by the same rules
as a job's: as a dict given to init_process_group(pg_options={"transport": "ucx"}), or in the
PIPESGD_COMM environment variable ("transport=ucx,chunk_bytes=auto"; the dict wins). Every rank
must pass the same settings; a rank that does not is named on every rank before anything
connects.

Pipe-SGD for any model: PipelinedOptimizer (pipeline.py), used instead of DDP. A timeline of
the steps, in `pipesgd run --timeline`'s format: Timeline (timeline.py).
"""
import datetime
import os

import torch.distributed as dist

from pipesgd import _torch
from pipesgd._torch import ProcessGroupPipesgd  # noqa: F401 (re-exported)
from pipesgd.torch.hooks import (  # noqa: F401 (re-exported)
    CodecState, PowerSgdState, codec_hook, powersgd_hook, wire_stats)
from pipesgd.torch.pipeline import PipelinedOptimizer  # noqa: F401 (re-exported)
from pipesgd.torch.timeline import Timeline  # noqa: F401 (re-exported)

BACKEND = "pipesgd"


def _overrides(pg_options):
    """comm.* overrides ("comm.transport=ucx") from PIPESGD_COMM and the pg_options dict."""
    settings = {}
    env = os.environ.get("PIPESGD_COMM", "").strip()
    if env:
        for item in env.split(","):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(
                    f"PIPESGD_COMM={env!r}: {item!r} is not KEY=VALUE (expected comma-separated "
                    "comm settings, e.g. transport=ucx,chunk_bytes=auto)")
            settings[key.strip()] = value.strip()
    if pg_options is not None:
        if not isinstance(pg_options, dict):
            raise ValueError(
                f"pipesgd backend: pg_options must be a dict of comm settings (e.g. "
                f"{{'transport': 'ucx'}}), got {type(pg_options).__name__}")
        settings.update({str(k): v for k, v in pg_options.items()})
    out = []
    for key, value in settings.items():
        field = key if key.startswith("comm.") else "comm." + key
        if isinstance(value, bool):
            value = "true" if value else "false"
        out.append(f"{field}={value}")
    return out


def _create(backend_opts, pg_options):
    timeout = backend_opts.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return ProcessGroupPipesgd(backend_opts.store, backend_opts.group_rank,
                               backend_opts.group_size, seconds, _overrides(pg_options))


def launch_env():
    """Sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, where unset, from Slurm's
    srun (SLURM_PROCID, SLURM_NTASKS, the first node of SLURM_JOB_NODELIST) or Open MPI's mpirun
    (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK), as pipesgd's own workers read them, so that
    init_process_group's env:// works under every launcher. Returns (rank, world_size)."""
    launcher = _torch._launch_env()
    for key, value in launcher.items():
        os.environ.setdefault(key, str(value))
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


if not hasattr(dist.Backend, BACKEND.upper()):
    dist.Backend.register_backend(BACKEND, _create, extended_api=True)
