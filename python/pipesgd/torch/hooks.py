"""pipesgd's codecs and PowerSGD as DDP communication hooks (docs/torch.md).

    from pipesgd.torch import CodecState, codec_hook
    ddp.register_comm_hook(CodecState(codec="q8", error_feedback=True), codec_hook)

Each bucket goes through pipesgd's ring on the process group's connections with the codec inside
the ring (every hop decodes, adds in float32 and re-encodes; error feedback at every encode,
kept per bucket across steps), averaged, so every rank ends with bitwise the same bucket. The
process group must be the "pipesgd" backend's.
"""
import torch
import torch.distributed as dist

CODECS = ("none", "trunc16", "fp16", "q8", "q4", "sign1")


def _backend_of(group):
    """pipesgd's backend object behind `group`, or None for another backend."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if hasattr(pg, "_allreduce_codec"):
        return pg
    if hasattr(pg, "_get_backend"):  # torch >= 2.0 wraps backends; 1.13 does not
        try:
            inner = pg._get_backend(torch.device("cpu"))
        except RuntimeError:
            return None
        return inner if hasattr(inner, "_allreduce_codec") else None
    return None


def _pipesgd_group(group):
    pg = _backend_of(group)
    if pg is None:
        named = group if group is not None else dist.distributed_c10d._get_default_group()
        raise ValueError(
            f"pipesgd's DDP hooks need a process group of the pipesgd backend "
            f"(init_process_group('pipesgd')), got {type(named).__name__}")
    return pg


class CodecState:
    """codec: one of none, trunc16, fp16, q8, q4, sign1. error_feedback: keep what each encode
    lost and add it to the next step's (q4 and sign1 need it to train well)."""

    def __init__(self, codec="q8", error_feedback=False, process_group=None):
        if codec not in CODECS:
            raise ValueError(f"codec {codec!r}: expected one of {', '.join(CODECS)}")
        self.codec = codec
        self.error_feedback = bool(error_feedback)
        self.process_group = _pipesgd_group(process_group)


def codec_hook(state, bucket):
    work = state.process_group._allreduce_codec(bucket.buffer(), bucket.index(), state.codec,
                                                state.error_feedback)
    return work.get_future().then(lambda fut: fut.value()[0])


class PowerSgdState:
    """PowerSGD (Vogels et al. 2019) on pipesgd's ring, as PyTorch's powerSGD_hook computes it:
    each weight matrix (a parameter with 2 or more dimensions, viewed as rows x rest) travels as
    two rank-`rank` factors with error feedback and warm start; biases travel as float32. The
    first `start_iter` steps are plain averages (PyTorch's start_powerSGD_iter)."""

    def __init__(self, rank=4, start_iter=0, process_group=None):
        if not 1 <= int(rank) <= 64:
            raise ValueError(f"PowerSGD rank {rank}: expected an integer in [1, 64]")
        if int(start_iter) < 0:
            raise ValueError(f"start_iter {start_iter}: expected >= 0")
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.iteration = 0
        self.process_group = _pipesgd_group(process_group)


def _matrices(bucket):
    out, offset = [], 0
    for grad in bucket.gradients():
        n = grad.numel()
        if grad.dim() >= 2 and n > 0:
            rows = grad.shape[0]
            out.append([offset, rows, n // rows])
        offset += n
    return out


def powersgd_hook(state, bucket):
    compress = state.iteration >= state.start_iter
    if bucket.is_last():
        state.iteration += 1
    work = state.process_group._allreduce_powersgd(bucket.buffer(), bucket.index(),
                                                   _matrices(bucket), state.rank, compress)
    return work.get_future().then(lambda fut: fut.value()[0])


def wire_stats(process_group=None):
    """What the last hook call sent: bytes_sent (headers included), payload_bytes,
    raw_payload_bytes (the same payloads as float32) and compressed."""
    return _pipesgd_group(process_group)._last_hook_stats()
