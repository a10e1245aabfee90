"""A timeline of a PyTorch job's steps, in the Chrome trace-event format of `pipesgd run
--timeline` (docs/running.md), so the same readers and https://ui.perfetto.dev show both:

    dist.init_process_group("pipesgd")
    timeline = pipesgd.torch.Timeline(first_step=60, steps=20)
    opt = pipesgd.torch.PipelinedOptimizer(opt, model, width=2, timeline=timeline)
    for step, (x, y) in enumerate(batches):   # one global count of steps
        timeline.at(step)
        opt.zero_grad()
        with timeline.span("forward"):
            loss = loss_fn(model(x), y)
        with timeline.span("backward"):
            loss.backward()
        opt.step()                      # its own spans: update, wait_aggregate, predict
    timeline.stop()                     # what follows is no step's
    opt.finish()
    timeline.write("job.timeline.json") # a collective: rank 0 writes every rank's spans

Per rank (pid), the compute track (tid 0) holds the spans this thread records and the
communication track (tid 1) the collectives of the pipesgd backend's communication thread, from
their start there to their end (a call queued behind another starts when that one ends). The
optimizer tags each AllReduce with the timeline's step; another collective (a DDP hook's
bucket, an evaluation's) belongs to the step during which it started. Under another backend
(gloo) the communication track is empty: its collectives run on its own threads, unrecorded.
The window is recorded once: at() past its end, or stop(), closes it. Times are the Unix
epoch's, so ranks on one host, or on NTP-synchronised hosts, line up.
"""
import contextlib
import json
import pickle
import time

import torch
import torch.distributed as dist

from pipesgd.torch.hooks import _backend_of

_COMPUTE, _COMM = 0, 1
_END = -2  # the step of the window's end in _starts: what starts after it is no step's


def _now():
    """The backend's clock: std::chrono::steady_clock is CLOCK_MONOTONIC on Linux."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class Timeline:
    """Records steps [first_step, first_step + steps) of this rank; `at(step)` says which step
    the caller is on. Needs the process group to exist (init_process_group)."""

    def __init__(self, first_step, steps=20, process_group=None):
        if type(first_step) is not int or first_step < 0:
            raise ValueError(f"first_step {first_step!r}: expected an integer >= 0")
        if type(steps) is not int or steps < 1:
            raise ValueError(f"steps {steps!r}: expected an integer >= 1")
        self.first_step = first_step
        self.steps = steps
        self.group = process_group
        self._backend = _backend_of(process_group)
        self._epoch = time.time() - _now()  # the file takes epoch times
        self._step = -1
        self._closed = False  # the window was passed: nothing more is recorded
        self._starts = {}     # step -> when at(step) was called; _END -> when the window closed
        self._events = []     # (tid, name, step, begin_s, end_s)
        self._held = []       # the gather's tensors (_gather says why)
        if self._backend is not None:
            self._backend._take_spans()  # what ran before this timeline is not its

    @property
    def recording(self):
        return not self._closed and self.first_step <= self._step < self.first_step + self.steps

    @property
    def step(self):
        """The caller's current step; -1 before the first at() and once the window closed."""
        return -1 if self._closed else self._step

    def at(self, step):
        """The caller starts step `step`."""
        if not self._closed:
            if step >= self.first_step + self.steps or (self._starts and step < self._step):
                self.stop()  # past the window, or counting again (a new epoch's count, a resume)
            else:
                self._step = step
                if self.recording:
                    self._starts[step] = _now()
        # Also after the window: its last AllReduces end during the next steps.
        self._collect()

    def stop(self):
        """The current step ends here and the window closes: spans and collectives that start
        later are no step's (the window's AllReduces still in flight keep their steps)."""
        if not self._closed:
            self._starts[_END] = _now()
            self._closed = True

    @contextlib.contextmanager
    def span(self, name):
        """A span of this thread (the compute track) in the current step, if it is recorded."""
        if not self.recording:
            yield
            return
        step, begin = self._step, _now()
        try:
            yield
        finally:
            self._events.append((_COMPUTE, name, step, begin, _now()))

    def write(self, path):
        """Every rank's spans into `path`, written by the group's rank 0; every rank must call
        it (a collective), and every rank raises if rank 0 could not write. Returns the number
        of spans written (0 on the other ranks)."""
        self.stop()
        self._collect()
        every = self._gather((dist.get_rank(), self._events))
        written, error = 0, ""
        if dist.get_rank(self.group) == 0:
            try:
                written = self._write_file(path, every)
            except OSError as e:
                error = f"pipesgd.torch.Timeline.write: rank 0 cannot write {path}: {e}"
        # The outcome, on every rank: none waits for a file that will not come.
        failed = self._gather(error)
        if any(failed):
            raise RuntimeError(next(e for e in failed if e))
        return written

    def _write_file(self, path, every):
        out = []
        for rank, events in every:
            out += [{"ph": "M", "pid": rank, "tid": 0, "name": "process_name",
                     "args": {"name": f"rank {rank}"}},
                    {"ph": "M", "pid": rank, "tid": _COMPUTE, "name": "thread_name",
                     "args": {"name": "compute"}},
                    {"ph": "M", "pid": rank, "tid": _COMM, "name": "thread_name",
                     "args": {"name": "communication"}}]
            for tid, name, step, begin, end in events:
                out.append({"ph": "X", "pid": rank, "tid": tid, "name": name,
                            "cat": "compute" if tid == _COMPUTE else "comm",
                            "ts": round((begin + self._epoch) * 1e6, 3),
                            "dur": round((end - begin) * 1e6, 3),
                            "args": {"step": step, "chunk": -1}})
        with open(path, "w") as f:
            json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)
        return sum(1 for e in out if e["ph"] == "X")

    def _gather(self, obj):
        """Every rank's `obj`, as all_gather_object gives them, but with the tensors kept alive
        by this object. Under gloo, torch 1.13's worker thread can drop the last reference to a
        collective's tensors after the collective completed; freeing a tensor Python made takes
        the GIL there, and a destroy_process_group() right after (holding the GIL while it joins
        that thread) deadlocked: seen on the lab (DDP over gloo, after all_gather_object). With
        the references held here the thread only counts one down."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        world = dist.get_world_size(self.group)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        size = torch.tensor([data.numel()], dtype=torch.int64)
        dist.all_gather(sizes, size, group=self.group)
        longest = int(max(t.item() for t in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(out, padded, group=self.group)
        self._held += [sizes, size, padded, out]
        return [pickle.loads(t[:int(n.item())].numpy().tobytes()) for t, n in zip(out, sizes)]

    def _collect(self):
        """The backend's finished collectives, kept where they belong to a recorded step: the
        tagged ones by their tag, the others by the latest step start before theirs."""
        if self._backend is None:
            return
        last = self.first_step + self.steps
        for name, step, begin, end in self._backend._take_spans():
            if step < 0:
                started = [(t, s) for s, t in self._starts.items() if t <= begin]
                step = max(started)[1] if started else -1
            if self.first_step <= step < last:
                self._events.append((_COMM, name, step, begin, end))
