"""Pipe-SGD for any PyTorch model: the AllReduce of step t runs on the process group's
communication thread while step t+1 computes (docs/torch.md, "Pipe-SGD for PyTorch").

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = pipesgd.torch.PipelinedOptimizer(opt, model, width=2)   # instead of DDP
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    with opt.true_weights():                                      # evaluate what was trained
        evaluate(model)
    opt.finish()                                                  # apply what is in flight

The recurrence is pipesgd's own width 2 (docs/staleness.md), with w[t] the true weights before
step t, g_p[t] rank p's gradient and G[t] the average over the ranks:

    synchronous warm-up, t < S:  g_p[t] at w[t];             w[t+1] = Apply(w[t], G[t])
    pipelined, t >= S:           g_p[t] at e_p[t];           w[t+1] = Apply(w[t], G[t-1])
                                 (step S applies nothing, as step 0 does: w[S+1] = w[S])
    e_p[t] = Apply(w[t], g_p[t-1])   LOCAL_GRADIENT: the update in flight, with this rank's own
                                     gradient standing in for the average not yet known
           = Apply(w[t], 0)          MOMENTUM: only what the optimizer already knows
           = w[t]                    NONE: plain Pipe-SGD

Apply is the wrapped optimizer's own step(), so the prediction is its arithmetic to the bit,
for SGD with momentum as for any torch optimizer (its state is set aside and put back around
the prediction). Every rank applies the same aggregates in the same order, so the true weights
stay bitwise identical on every rank; the model's parameters hold e_p[t] between steps, and
true_weights() swaps the true ones in. Buffers (batch norm's running statistics) are rank 0's,
as DDP's broadcast_buffers gives them: broadcast at construction, in true_weights() and in
finish().
"""
import collections
import contextlib
import hashlib
import itertools
import time
import warnings

import torch
import torch.distributed as dist

from pipesgd.torch.hooks import CODECS, _backend_of
from pipesgd.torch.timeline import Timeline

COMPENSATIONS = ("local_gradient", "momentum", "none")
# Hook buckets are keyed by DDP's bucket index (0, 1, ...); each optimizer takes a key of its
# own far above them, so its error-feedback residuals and PowerSGD factors are its own.
_KEYS = itertools.count(1 << 40)


def _check_arguments(optimizer, model, width, sync_warmup_steps, compensation, compression,
                     error_feedback, powersgd_rank):
    def integer(x):  # an int, not a bool or a float
        return type(x) is int
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer,
                                                                     PipelinedOptimizer):
        raise ValueError(f"optimizer: expected a torch.optim optimizer (the first argument), got "
                         f"{type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("optimizer LBFGS: its step() evaluates the loss again through a closure, "
                         "which a pipelined step cannot; use a first-order optimizer (SGD, Adam)")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: expected the torch.nn.Module being trained (the second "
                         f"argument), got {type(model).__name__}")
    if not integer(width) or width not in (1, 2):
        raise ValueError(f"width {width!r}: expected 1 (synchronous) or 2 (Pipe-SGD)")
    if not integer(sync_warmup_steps) or sync_warmup_steps < 0:
        raise ValueError(f"sync_warmup_steps {sync_warmup_steps!r}: expected an integer >= 0")
    if compensation not in COMPENSATIONS:
        raise ValueError(f"compensation {compensation!r}: expected one of "
                         f"{', '.join(COMPENSATIONS)}")
    if compression not in CODECS:
        raise ValueError(f"compression {compression!r}: expected one of {', '.join(CODECS)}")
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback {error_feedback!r}: expected True or False")
    if not integer(powersgd_rank) or not 0 <= powersgd_rank <= 64:
        raise ValueError(f"powersgd_rank {powersgd_rank!r}: expected an integer in [0, 64] "
                         "(0: off)")
    if powersgd_rank and compression != "none":
        raise ValueError(f"powersgd_rank {powersgd_rank} and compression {compression!r} both "
                         "compress the gradients; choose one")
    if error_feedback and compression == "none":
        raise ValueError("error_feedback needs a compression other than 'none' (PowerSGD "
                         "keeps its own)")


class PipelinedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer` (any torch.optim optimizer over float32 CPU parameters) for
    data-parallel training of `model` on `process_group` (default: the default group), without
    DDP. width 1: synchronous, every step's gradient averaged before it is applied (as DDP);
    width 2: Pipe-SGD. compression: one of pipesgd's codecs inside the ring ("q4", with
    error_feedback=True, trains like "none"), or powersgd_rank R >= 1 for pipesgd's PowerSGD;
    both need the pipesgd backend, the plain average runs on any backend. Gradients under
    comm.min_bytes (64 KiB) travel uncompressed. It is a torch Optimizer (for LR schedulers):
    its param_groups and state are the wrapped optimizer's. timeline: a Timeline (timeline.py)
    that gets step()'s spans (update, wait_aggregate, predict) and the step of each AllReduce."""

    def __init__(self, optimizer, model, width=2, sync_warmup_steps=50,
                 compensation="local_gradient", compression="none", error_feedback=False,
                 powersgd_rank=0, process_group=None, timeline=None):
        # Not torch.optim.Optimizer.__init__: the wrapped optimizer keeps the groups and state.
        _check_arguments(optimizer, model, width, sync_warmup_steps, compensation, compression,
                         error_feedback, powersgd_rank)
        if timeline is not None and not isinstance(timeline, Timeline):
            raise ValueError(f"timeline: expected a pipesgd.torch.Timeline or None, got "
                             f"{type(timeline).__name__}")
        default = dist.distributed_c10d._get_default_group
        if timeline is not None and ((timeline.group or default()) is not
                                     (process_group or default())):
            raise ValueError("timeline: made for another process group than the optimizer's "
                             "(its communication track would miss the optimizer's AllReduces); "
                             "pass the same process_group to both")
        self.timeline = timeline
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.model = model
        self.width = width
        self.sync_warmup_steps = sync_warmup_steps
        self.compensation = compensation
        self.compression = compression
        self.error_feedback = error_feedback
        self.powersgd_rank = powersgd_rank
        self.group = process_group
        self._backend = _backend_of(process_group)
        if self._backend is None and (compression != "none" or powersgd_rank):
            raise ValueError(
                f"compression {compression!r} / powersgd_rank {powersgd_rank} need a process "
                "group of the pipesgd backend (init_process_group('pipesgd')); another backend "
                "gets the plain average only")
        self._world = dist.get_world_size(process_group)
        # The group's rank 0, as a global rank (what broadcast's src names).
        self._root = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        self._inflight = collections.deque()    # (work, buffer) of the AllReduces in flight
        self._pending = None                    # an aggregate known but not yet applied
        self._true = None                       # w[t] while a prediction sits in the params
        self.steps = 0                          # step() calls so far
        self.applied = 0                        # aggregates applied so far
        self.wait_s = 0.0                       # time step() waited for an AllReduce
        self._layout()
        self._agree()
        self._sync_model()

    # -- what a torch optimizer offers -------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def add_param_group(self, param_group):
        """Adds a group to the wrapped optimizer (e.g. layers unfrozen later): what is in flight
        is applied first (as finish() does), then every rank takes rank 0's new parameters.
        Every rank must call it at the same step."""
        self.finish()
        self.optimizer.add_param_group(param_group)
        self._layout()
        self._agree()
        self._sync_model()

    def zero_grad(self, set_to_none=False):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """Takes this rank's gradients (p.grad; None counts as zeros) as g_p[t]."""
        if closure is not None:
            raise ValueError("PipelinedOptimizer.step: a closure is not supported (the gradient "
                             "is computed once per step, at the predicted weights)")
        self._gather_local()
        if self.width == 1 or self.steps < self.sync_warmup_steps:
            self._settle_and_apply()  # after a load_state_dict taken mid-pipeline
            self._launch(self._local)
            self._settle_and_apply()
        else:
            if self._true is not None:
                self._write_params(self._true)  # back to w[t]
            self._launch(self._local)  # queued behind the one in flight
            self._settle_and_apply(keep=1)  # w[t+1] = Apply(w[t], G[t-1])
            self._predict()  # e_p[t+1], computed at while G[t] travels
        self.steps += 1

    # -- evaluation, the end, checkpoints -----------------------------------------------------
    @contextlib.contextmanager
    def true_weights(self):
        """The true weights w (the same bits on every rank) and rank 0's buffers in the model
        for the block; the prediction comes back after. Every rank must enter it (a
        collective)."""
        self._sync_buffers()
        if self._true is None:
            yield
            return
        prediction = self._flat_params()
        self._write_params(self._true)
        try:
            yield
        finally:
            self._write_params(prediction)

    def finish(self):
        """Waits for the AllReduce in flight and applies it: the model then holds every step's
        update and rank 0's buffers. A later step() starts the pipeline again (it applies
        nothing, as the first pipelined step does)."""
        if self._true is not None:
            self._write_params(self._true)
            self._true = None
        self._settle_and_apply()
        self._sync_buffers()

    def digest(self):
        """A hash of the true weights (equal on every rank, step after step)."""
        w = self._true if self._true is not None else self._flat_params()
        h = hashlib.sha256(w.numpy().tobytes())
        for p in self._others:  # frozen parameters outside the optimizer
            h.update(p.detach().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def state_dict(self):
        """Everything a rank holds between steps, so that load_state_dict resumes bitwise: the
        AllReduce in flight (waited for, kept as the pending aggregate), and what the ring
        carries from step to step for this rank (a codec's error-feedback residual, PowerSGD's
        factors and residual). Each rank saves its own: the residuals are the rank's."""
        if self._inflight:
            self._pending = self._wait()
        ring = self._backend._hook_state(self._key) if self._backend is not None else []
        return {"version": 2, "width": self.width, "steps": self.steps, "applied": self.applied,
                "compression": self.compression, "error_feedback": self.error_feedback,
                "powersgd_rank": self.powersgd_rank,
                "params": self._flat_params(),
                "true_weights": None if self._true is None else self._true.clone(),
                "pending": None if self._pending is None else self._pending.clone(),
                "ring_state": ring,
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        n = self._offsets[-1]
        version = state.get("version")
        if version not in (1, 2) or state.get("width") != self.width:
            raise ValueError(f"PipelinedOptimizer.load_state_dict: version {version} width "
                             f"{state.get('width')}; expected version 1 or 2, width {self.width}")
        for key in ("params", "true_weights", "pending"):
            t = state[key]
            if t is not None and (t.dtype != torch.float32 or t.numel() != n):
                raise ValueError(f"PipelinedOptimizer.load_state_dict: {key} has "
                                 f"{t.numel()} {t.dtype} values; expected {n} float32")
        ring = self._ring_state(state, n)
        while self._inflight:
            self._wait()
        self.optimizer.load_state_dict(state["optimizer"])
        self._write_params(state["params"])
        self._true = None if state["true_weights"] is None else state["true_weights"].clone()
        self._pending = None if state["pending"] is None else state["pending"].clone()
        self.steps, self.applied = int(state["steps"]), int(state["applied"])
        if self._backend is not None:
            self._backend._restore_hook_state(self._key, ring)

    def _ring_state(self, state, n):
        """The saved ring state, checked against this optimizer's compression."""
        if state["version"] == 1:  # saved before the ring's state was
            if self.error_feedback or self.powersgd_rank:
                warnings.warn("PipelinedOptimizer.load_state_dict: a version 1 state holds no "
                              "error-feedback residuals or PowerSGD factors; they restart at "
                              "zero")
            return []
        saved = tuple(state[k] for k in ("compression", "error_feedback", "powersgd_rank"))
        mine = (self.compression, self.error_feedback, self.powersgd_rank)
        if saved != mine:
            raise ValueError(f"PipelinedOptimizer.load_state_dict: saved with compression "
                             f"{saved[0]!r}, error_feedback {saved[1]}, powersgd_rank {saved[2]}; "
                             f"this optimizer has {mine[0]!r}, {mine[1]}, {mine[2]}")
        ring = list(state["ring_state"])
        if (len(ring) > 2 or any(t.dtype != torch.float32 or t.dim() != 1 or t.numel() > n
                                 for t in ring)):
            raise ValueError(f"PipelinedOptimizer.load_state_dict: ring_state of "
                             f"{[(t.dtype, tuple(t.shape)) for t in ring]}; expected at most two "
                             f"1-d float32 tensors of at most {n} values")
        return ring

    # -- the parts -----------------------------------------------------------------------------
    def _layout(self):
        """The flat layout of the optimizer's parameters, and the buffers that hold them."""
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._ids = [id(p) for p in self._params]
        if len(set(self._ids)) != len(self._params):
            raise ValueError("the optimizer lists a parameter twice")
        for i, p in enumerate(self._params):
            if p.dtype != torch.float32 or p.device.type != "cpu" or p.is_sparse:
                raise ValueError(f"parameter {i} ({tuple(p.shape)}): {p.dtype} on {p.device}"
                                 f"{' (sparse)' if p.is_sparse else ''}; expected dense float32 "
                                 "on the CPU (CUDA parameters: not yet)")
        # The model's parameters outside the optimizer (frozen ones): never updated, but every
        # rank must hold rank 0's, as under DDP.
        mine = set(self._ids)
        self._others = [p for p in self.model.parameters() if id(p) not in mine]
        self._sizes = [p.numel() for p in self._params]
        self._offsets = [0] + list(itertools.accumulate(self._sizes))
        n = self._offsets[-1]
        self._matrices = [[o, p.shape[0], p.numel() // p.shape[0]]
                          for o, p in zip(self._offsets, self._params)
                          if p.dim() >= 2 and p.numel() > 0]
        self._key = next(_KEYS)  # a new layout, a new ring state (residuals, PowerSGD factors)
        self._local = torch.zeros(n)            # g_p[t]: this rank's gradient of the last step
        self._send = [torch.zeros(n), torch.zeros(n)]  # AllReduced in place, alternately

    def _agree(self):
        """Every rank has the same settings and parameter shapes, or every rank raises naming
        the ranks that differ (a mismatch would train on, with replicas that drift apart)."""
        mine = {"width": self.width, "sync_warmup_steps": self.sync_warmup_steps,
                "compensation": self.compensation, "compression": self.compression,
                "error_feedback": self.error_feedback, "powersgd_rank": self.powersgd_rank,
                "parameter shapes": [tuple(p.shape) for p in self._params]}
        every = [None] * self._world
        dist.all_gather_object(every, mine, group=self.group)
        differ = [f"{key} = {theirs[key]!r} on rank {r}, {every[0][key]!r} on rank 0"
                  for r, theirs in enumerate(every) for key in mine if theirs[key] != every[0][key]]
        if differ:
            raise ValueError("PipelinedOptimizer: the ranks disagree: " + "; ".join(differ[:4]) +
                             "; every rank must wrap the same model with the same settings")

    def _flat_params(self):
        return torch.cat([p.detach().reshape(-1) for p in self._params])

    def _write_params(self, flat):
        self._write(self._params, flat)

    def _gather_local(self):
        if [id(p) for g in self.optimizer.param_groups for p in g["params"]] != self._ids:
            raise ValueError("the wrapped optimizer's parameters changed after wrapping; add "
                             "groups with PipelinedOptimizer.add_param_group, on every rank")
        for i, (p, o, k) in enumerate(zip(self._params, self._offsets, self._sizes)):
            if p.grad is None:  # counts as zero: the average needs one from every rank
                self._local[o:o + k].zero_()
            elif p.grad.is_sparse:
                raise ValueError(f"parameter {i} ({tuple(p.shape)}) has a sparse gradient; "
                                 "expected dense gradients (nn.Embedding(sparse=False))")
            else:
                self._local[o:o + k].copy_(p.grad.reshape(-1))

    def _launch(self, gradient):
        """Starts the average of `gradient` (copied), behind any AllReduce in flight."""
        buf = self._send[self.steps % 2]
        buf.copy_(gradient)
        tag = self.timeline.step if self.timeline is not None else self.steps  # its caller's count
        if self.powersgd_rank:
            work = self._backend._allreduce_powersgd(buf, self._key, self._matrices,
                                                     self.powersgd_rank, True, tag)
        elif self._backend is not None:
            work = self._backend._allreduce_codec(buf, self._key, self.compression,
                                                  self.error_feedback, tag)
        else:
            work = dist.all_reduce(buf, group=self.group, async_op=True)
        self._inflight.append((work, buf))

    def _wait(self):
        """The oldest AllReduce in flight, finished: its average."""
        work, buf = self._inflight.popleft()
        start = time.perf_counter()
        with self._span("wait_aggregate"):
            work.wait()
        self.wait_s += time.perf_counter() - start
        if self._backend is None:
            buf.div_(self._world)  # gloo has no AVG: a sum, averaged here
        return buf

    def _settle_and_apply(self, keep=0):
        """Applies the oldest aggregate not yet applied (the pending one, or the oldest
        AllReduce in flight while more than `keep` are), if any."""
        if self._pending is not None:
            aggregate, self._pending = self._pending, None
        elif len(self._inflight) > keep:
            aggregate = self._wait()
        else:
            return
        with self._span("update"):
            self._optimizer_step(aggregate)
        self.applied += 1

    def _optimizer_step(self, flat_gradient):
        """The wrapped optimizer's step with `flat_gradient` as every parameter's gradient; the
        user's gradient tensors are put back after."""
        saved = [p.grad for p in self._params]
        for p, o, k in zip(self._params, self._offsets, self._sizes):
            # A frozen parameter is skipped, as torch's optimizers skip one without a gradient.
            p.grad = flat_gradient[o:o + k].view_as(p) if p.requires_grad else None
        try:
            self.optimizer.step()
        finally:
            for p, g in zip(self._params, saved):
                p.grad = g

    def _span(self, name):
        return self.timeline.span(name) if self.timeline is not None else contextlib.nullcontext()

    def _predict(self):
        if self.compensation == "none":
            self._true = None
            return
        with self._span("predict"):
            self._predict_now()

    def _predict_now(self):
        self._true = self._flat_params()
        # The optimizer's state is set aside and put back: a prediction must leave no trace.
        state = self.optimizer.state
        kept = {p: state[p] for p in self._params if p in state}
        for p, s in kept.items():
            state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        try:
            self._optimizer_step(self._local if self.compensation == "local_gradient"
                                 else torch.zeros_like(self._local))
        finally:
            for p in self._params:
                if p in kept:
                    state[p] = kept[p]
                else:
                    state.pop(p, None)

    def _sync_model(self):
        """Rank 0's parameters (the optimizer's, and the model's others) and buffers on every
        rank, as DDP does at construction."""
        self._broadcast(self._params, torch.float32)
        self._broadcast(self._others, torch.float64)
        self._sync_buffers()

    def _sync_buffers(self):
        self._broadcast([b for b in self.model.buffers()], torch.float64)

    def _broadcast(self, tensors, dtype):
        """Rank 0's values of `tensors`, through one flat `dtype` tensor (float64 holds every
        float32, float16 and integer below 2^53 exactly)."""
        tensors = [t for t in tensors if t.numel() > 0]
        if tensors:
            flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
            dist.broadcast(flat, self._root, group=self.group)
            self._write(tensors, flat)

    @staticmethod
    def _write(tensors, flat):
        with torch.no_grad():
            o = 0
            for t in tensors:
                t.copy_(flat[o:o + t.numel()].view_as(t).to(t.dtype))
                o += t.numel()
