"""Pipe-SGD for PyTorch (pipesgd.torch.PipelinedOptimizer): the width-2 recurrence to the bit
against a reference written out step by step in one process; evaluation on the true weights;
replicas bitwise identical on 4 ranks with and without codecs; a checkpoint taken with an
AllReduce in flight resumes bitwise; the plain average over gloo gives the same bits as over
pipesgd; bad arguments named.

Run: PYTHONPATH=<build>/python python3 tests/torch/pipeline_test.py
"""
import io
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import init_method, run_ranks, values  # noqa: E402

LR, MOMENTUM = 0.05, 0.9


def _model(seed=3):
    import torch
    import torch.nn as nn
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))


def _batch(rank, step, batch=16):
    """Pseudo-data of (rank, step) alone, so a resumed run sees the same batches."""
    import torch
    g = torch.Generator().manual_seed(100003 * rank + step)
    teacher = torch.randn(784, 10, generator=torch.Generator().manual_seed(7))
    x = torch.randn(batch, 784, generator=g)
    return x, (x @ teacher).argmax(1)


def _flat(model):
    import torch
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _out(t):
    """A tensor as the parent can receive it (torch's queue would share its storage by a file
    descriptor that dies with the rank)."""
    return t.detach().numpy().copy()


def _grad_at(model, flat, rank, step):
    """This rank's gradient of `step` at the weights `flat` (the ranks' own computation)."""
    import torch
    with torch.no_grad():
        o = 0
        for p in model.parameters():
            p.copy_(flat[o:o + p.numel()].view_as(p))
            o += p.numel()
    model.zero_grad()
    x, y = _batch(rank, step)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


class _Sgd:
    """torch.optim.SGD on a flat copy of the weights: Apply(w, g) of the recurrence."""

    def __init__(self, flat):
        import torch
        self.w = flat.clone().requires_grad_(True)
        self.opt = torch.optim.SGD([self.w], lr=LR, momentum=MOMENTUM)

    def apply(self, g):
        self.w.grad = g.clone()
        self.opt.step()

    def copy(self):
        other = _Sgd(self.w.detach())
        other.opt.load_state_dict(self.opt.state_dict())
        return other


def reference(world, steps, warmup, compensation):
    """The recurrence of python/pipesgd/torch/pipeline.py written out, every rank in one
    process; G is the average as 2 ranks' ring computes it, (g_0 + g_1) / 2. Returns the true
    weights after each step and each rank's prediction after the last."""
    import torch
    model = _model()
    true = _Sgd(_flat(model))
    last_local, pending, out = None, None, []
    predictions = None
    for t in range(steps):
        w = true.w.detach().clone()
        if t < warmup:
            grads = [_grad_at(model, w, r, t) for r in range(world)]
            true.apply(sum(grads[1:], grads[0]) / world)
        else:
            points = []
            for r in range(world):
                if t == warmup or compensation == "none":
                    points.append(w)
                else:
                    ahead = true.copy()
                    ahead.apply(last_local[r] if compensation == "local_gradient"
                                else torch.zeros_like(w))
                    points.append(ahead.w.detach().clone())
            grads = [_grad_at(model, points[r], r, t) for r in range(world)]
            if pending is not None:
                true.apply(pending)
            pending = sum(grads[1:], grads[0]) / world
            last_local = grads
            if compensation != "none":
                predictions = []
                for r in range(world):
                    ahead = true.copy()
                    ahead.apply(grads[r] if compensation == "local_gradient"
                                else torch.zeros_like(w))
                    predictions.append(ahead.w.detach().clone())
        out.append(true.w.detach().clone())
    return out, predictions


def _optimizer(model, **kw):
    import torch
    from pipesgd.torch import PipelinedOptimizer
    return PipelinedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                              model, **kw)


def _steps(opt, model, rank, first, last):
    import torch
    for t in range(first, last):
        opt.zero_grad()
        x, y = _batch(rank, t)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def run_recurrence(rank, steps, warmup, compensation):
    """Per step: the weights seen inside true_weights(); at the end the prediction in the model."""
    model = _model(seed=3 + rank)  # rank 0's weights reach every rank at construction
    opt = _optimizer(model, width=2, sync_warmup_steps=warmup, compensation=compensation)
    seen = []
    for t in range(steps):
        _steps(opt, model, rank, t, t + 1)
        with opt.true_weights():
            seen.append(_out(_flat(model)))
    prediction = _out(_flat(model))
    opt.finish()
    return seen, prediction


def run_replicas(rank, kw, steps):
    """Digests of the true weights every step, and the true weights at the end."""
    model = _model()
    opt = _optimizer(model, **kw)
    digests = []
    for t in range(steps):
        _steps(opt, model, rank, t, t + 1)
        digests.append(opt.digest())
    with opt.true_weights():
        final = _flat(model)
    opt.finish()
    return digests, _out(final), opt.applied


CHECKPOINTS = {"plain": {}, "q4 with error feedback": {"compression": "q4", "error_feedback": True},
               "PowerSGD": {"powersgd_rank": 2}}


def run_checkpoint(rank, stop, steps, kw):
    """An uninterrupted run, and one saved after `stop` steps (its AllReduce in flight) and
    resumed by a fresh model and optimizer: both end with the same weights? With a codec or
    PowerSGD the ring's state (residuals, factors) must come back too. Also: what a state saved
    with these settings says when loaded into an optimizer with other ones."""
    import torch
    model = _model()
    opt = _optimizer(model, width=2, sync_warmup_steps=2, **kw)
    _steps(opt, model, rank, 0, stop)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)  # waits for the AllReduce in flight, applies nothing
    _steps(opt, model, rank, stop, steps)
    with opt.true_weights():
        uninterrupted = _flat(model)
    opt.finish()
    resumed_model = _model(seed=99)  # other weights: the checkpoint must replace them
    resumed = _optimizer(resumed_model, width=2, sync_warmup_steps=2, **kw)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved))
    _steps(resumed, resumed_model, rank, stop, steps)
    with resumed.true_weights():
        after = _flat(resumed_model)
    resumed.finish()
    # A state saved before the first step (the ring has no state yet) loads and trains on.
    fresh = _optimizer(_model(), width=2, sync_warmup_steps=2, **kw)
    fresh.load_state_dict(_optimizer(_model(), width=2, sync_warmup_steps=2, **kw).state_dict())
    _steps(fresh, fresh.model, rank, 0, 3)
    fresh.finish()
    other = _optimizer(_model(), width=2, sync_warmup_steps=2, compression="q8",
                       error_feedback=True)
    saved.seek(0)
    try:
        other.load_state_dict(torch.load(saved))
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return _out(uninterrupted), _out(after), refusal


def run_gloo_and_pipesgd(rank, gloo, steps):
    out = []
    for group in (None, gloo):
        model = _model()
        opt = _optimizer(model, width=2, sync_warmup_steps=2, process_group=group)
        _steps(opt, model, rank, 0, steps)
        opt.finish()
        out.append(_out(_flat(model)))
    return out


def run_bad_arguments(gloo):
    messages = []
    for kw in ({"width": 3}, {"compensation": "hessian"}, {"compression": "q3"},
               {"compression": "q8", "process_group": gloo}, {"error_feedback": True},
               {"powersgd_rank": 4, "compression": "q8"}, {"sync_warmup_steps": -1},
               {"width": True}, {"width": 2.0},
               {"compression": "q8", "error_feedback": "yes"}):
        try:
            _optimizer(_model(), **kw)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    import torch
    from pipesgd.torch import PipelinedOptimizer
    sgd = torch.optim.SGD(_model().parameters(), lr=0.1)
    for args in ((sgd, None), (_model(), sgd),
                 (torch.optim.LBFGS(_model().parameters()), _model())):
        try:
            PipelinedOptimizer(*args)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def run_frozen(rank):
    """A frozen layer outside the optimizer (initialised differently on each rank: rank 0's
    must win) and one inside it with weight decay (torch leaves a parameter without a gradient
    alone): are both the same on every rank, and the second unchanged?"""
    import torch
    model = _model(seed=3 + rank)
    first, second = model[1], model[3]
    first.weight.requires_grad_(False)
    second.bias.requires_grad_(False)
    bias_before = None
    opt = _optimizer(model, width=2, sync_warmup_steps=1)  # every parameter but first.weight
    opt.optimizer.param_groups[0]["weight_decay"] = 0.1
    bias_before = second.bias.detach().clone()
    _steps(opt, model, rank, 0, 5)
    opt.finish()
    moved = (second.bias.detach() - bias_before).abs().max().item()
    return _out(first.weight.detach()), moved, opt.digest()


def run_mismatch(rank):
    """Rank 1 asks for width 1, rank 0 for width 2: both must refuse, naming it."""
    try:
        _optimizer(_model(), width=2 if rank == 0 else 1, sync_warmup_steps=1)
        return None
    except ValueError as e:
        return str(e)


def run_groups_and_schedulers(rank):
    """A group added through the wrapper (trained, replicas equal), one added behind its back
    (refused by name), and an LR scheduler given the wrapper."""
    import torch
    model = torch.nn.Sequential(_model(), torch.nn.Linear(10, 10))
    opt = _optimizer(model[0], width=2, sync_warmup_steps=1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for t in range(4):
        opt.zero_grad()
        x, y = _batch(rank, t)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        scheduler.step()
    lr = opt.param_groups[0]["lr"]
    opt.add_param_group({"params": model[1].parameters()})
    before = model[1].weight.detach().clone()
    for t in range(4, 8):
        opt.zero_grad()
        x, y = _batch(rank, t)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.finish()
    trained = not torch.equal(before, model[1].weight.detach())
    opt.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    try:
        opt.step()
        refused = None
    except ValueError as e:
        refused = str(e)
    return lr, trained, opt.digest(), refused


def run_subgroups(rank):
    """Ranks {0, 1} and {2, 3} train apart, each pair on its own group (the second one without
    global rank 0)."""
    import torch.distributed as dist
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = _model(seed=3 + rank)
    opt = _optimizer(model, width=2, sync_warmup_steps=1, process_group=pairs[rank // 2])
    _steps(opt, model, rank, 0, 4)
    opt.finish()
    return opt.digest()


def run_timeline(rank):
    """Steps 3-6 of a width-2 run (warm-up 2) and steps 1-2 of DDP with pipesgd's q8 hook (its
    AllReduces untagged), each in a file rank 0 writes; bad arguments named."""
    import json
    import tempfile
    import torch
    import torch.nn as nn
    from pipesgd.torch import CodecState, Timeline, codec_hook
    out = {}
    # The ranks are children of one parent: the same path on both, and only rank 0 writes.
    base = os.path.join(tempfile.gettempdir(), f"pipesgd-timeline-{os.getppid()}")
    for name in ("pipelined", "ddp"):
        model = _model()
        timeline = Timeline(first_step=3 if name == "pipelined" else 1, steps=4 if name ==
                            "pipelined" else 2)
        if name == "pipelined":
            opt, net = _optimizer(model, width=2, sync_warmup_steps=2, timeline=timeline), model
        else:
            net = nn.parallel.DistributedDataParallel(model)
            net.register_comm_hook(CodecState(codec="q8"), codec_hook)
            opt = torch.optim.SGD(net.parameters(), lr=LR)
        for t in range(10 if name == "pipelined" else 4):
            timeline.at(t)
            opt.zero_grad()
            x, y = _batch(rank, t)
            with timeline.span("forward"):
                loss = torch.nn.functional.cross_entropy(net(x), y)
            with timeline.span("backward"):
                loss.backward()
            opt.step()
        if name == "pipelined":
            opt.finish()
        written = timeline.write(f"{base}.{name}.json")
        if rank == 0:
            with open(f"{base}.{name}.json") as f:
                out[name] = (written, json.load(f)["traceEvents"])
            os.remove(f"{base}.{name}.json")
    bad = []
    for kw in ({"first_step": -1}, {"first_step": 0, "steps": 0}, {"first_step": 1.5}):
        try:
            Timeline(**kw)
            bad.append(None)
        except ValueError as e:
            bad.append(str(e))
    import torch.distributed as dist
    other = dist.new_group(backend="gloo")
    for kw in ({"timeline": "yes"},
               {"timeline": Timeline(first_step=0), "process_group": other},  # default group's
               {"timeline": Timeline(first_step=0, process_group=other), "process_group": other}):
        try:
            _optimizer(_model(), **kw)
            bad.append(None)
        except ValueError as e:
            bad.append(str(e))
    out["bad"] = bad
    # The same group named two ways is the same group.
    _optimizer(_model(), timeline=Timeline(first_step=0), process_group=dist.group.WORLD)
    # Rank 0 cannot write: every rank hears it, none waits.
    try:
        timeline.write("/nonexistent-pipesgd-dir/timeline.json")
        out["bad_write"] = None
    except RuntimeError as e:
        out["bad_write"] = str(e)
    return out


RECURRENCE = {"steps": 9, "warmup": 3}
REPLICAS = ({"width": 2, "sync_warmup_steps": 3},
            {"width": 2, "sync_warmup_steps": 3, "compression": "q4", "error_feedback": True},
            {"width": 2, "sync_warmup_steps": 0, "powersgd_rank": 2},
            {"width": 1, "compression": "q8", "error_feedback": True})
REPLICA_STEPS = 12


def two_ranks(rank, world):
    """Every 2-rank case on one process group (a spawn of torch costs seconds)."""
    import torch.distributed as dist
    import pipesgd.torch  # noqa: F401
    dist.init_process_group("pipesgd", init_method=init_method(), rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    out = {"recurrence": {c: run_recurrence(rank, RECURRENCE["steps"], RECURRENCE["warmup"], c)
                          for c in ("local_gradient", "momentum", "none")},
           "checkpoint": {name: run_checkpoint(rank, 6, 11, kw)
                          for name, kw in CHECKPOINTS.items()},
           "gloo": run_gloo_and_pipesgd(rank, gloo, 8),
           "bad": run_bad_arguments(gloo),
           "frozen": run_frozen(rank),
           "mismatch": run_mismatch(rank),
           "groups": run_groups_and_schedulers(rank),
           "timeline": run_timeline(rank)}
    dist.destroy_process_group()
    return out


def four_ranks(rank, world):
    import torch.distributed as dist
    import pipesgd.torch  # noqa: F401
    dist.init_process_group("pipesgd", init_method=init_method(), rank=rank, world_size=world)
    out = [run_replicas(rank, kw, REPLICA_STEPS) for kw in REPLICAS]
    out.append(run_subgroups(rank))
    dist.destroy_process_group()
    return out


_RESULTS = {}


def results(world, testcase):
    """Each rank's results of two_ranks or four_ranks, run once for every test."""
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(two_ranks if world == 2 else four_ranks, world, timeout=300)
    return values(_RESULTS[world], testcase)


class PipelineTest(unittest.TestCase):
    def test_recurrence_to_the_bit_against_the_reference(self):
        import torch
        steps, warmup = RECURRENCE["steps"], RECURRENCE["warmup"]
        got = results(2, self)
        for compensation in ("local_gradient", "momentum", "none"):
            with self.subTest(compensation=compensation):
                want, predictions = reference(2, steps, warmup, compensation)
                for rank in range(2):
                    seen, prediction = got[rank]["recurrence"][compensation]
                    for t in range(steps):
                        self.assertTrue(torch.equal(torch.from_numpy(seen[t]), want[t]),
                                        f"rank {rank} step {t}: true weights differ from the "
                                        f"reference by "
                                        f"{(torch.from_numpy(seen[t]) - want[t]).abs().max()}")
                    if predictions is not None:  # the model holds e_p between steps
                        self.assertTrue(torch.equal(torch.from_numpy(prediction),
                                                    predictions[rank]))
                # The pipeline moves: the last true weights are not the step before's.
                self.assertFalse(torch.equal(want[-1], want[-2]))

    def test_replicas_bitwise_identical_on_four_ranks(self):
        got = results(4, self)
        for i, kw in enumerate(REPLICAS):
            with self.subTest(**kw):
                digests, final, applied = got[0][i]
                for rank in range(1, 4):
                    self.assertEqual(got[rank][i][0], digests, f"rank {rank}'s digests")
                    self.assertTrue((got[rank][i][1] == final).all())
                # Every step changes the weights but the first pipelined one, which applies
                # nothing (after a warm-up, its true weights are the last warm-up step's).
                pause = 1 if kw["width"] == 2 and kw["sync_warmup_steps"] > 0 else 0
                self.assertEqual(len(set(digests)), REPLICA_STEPS - pause)
                # Width 2 has one aggregate in flight after each step; finish() applied it.
                self.assertEqual(applied, REPLICA_STEPS)

    def test_checkpoint_with_an_allreduce_in_flight_resumes_bitwise(self):
        got = results(2, self)
        for name in CHECKPOINTS:
            with self.subTest(name):
                for rank in range(2):
                    uninterrupted, resumed, refusal = got[rank]["checkpoint"][name]
                    self.assertTrue((uninterrupted == resumed).all(),
                                    f"rank {rank}: differs by "
                                    f"{abs(uninterrupted - resumed).max()}")
                    if name != "plain":
                        self.assertIn("saved with compression", refusal)
                        self.assertIn("this optimizer has 'q8', True, 0", refusal)
                self.assertTrue((got[0]["checkpoint"][name][0] ==
                                 got[1]["checkpoint"][name][0]).all())

    def test_the_average_over_gloo_is_the_same_bits(self):
        for rank, r in enumerate(results(2, self)):
            on_pipesgd, on_gloo = r["gloo"]
            self.assertTrue((on_pipesgd == on_gloo).all(), f"rank {rank}")

    def test_bad_arguments_are_named(self):
        got = results(2, self)[0]["bad"]
        expect = ["width 3", "compensation 'hessian'", "compression 'q3'",
                  "need a process group of the pipesgd backend", "error_feedback needs",
                  "choose one", "sync_warmup_steps -1", "width True", "width 2.0",
                  "error_feedback 'yes'", "model: expected the torch.nn.Module",
                  "optimizer: expected a torch.optim optimizer", "optimizer LBFGS"]
        self.assertEqual(len(got), len(expect))
        for message, words in zip(got, expect):
            self.assertIsNotNone(message, words)
            self.assertIn(words, message)

    def test_frozen_parameters_are_rank_zeros_and_stay_frozen(self):
        got = results(2, self)
        (w0, moved0, d0), (w1, moved1, d1) = got[0]["frozen"], got[1]["frozen"]
        self.assertTrue((w0 == w1).all(), "the frozen layer outside the optimizer differs")
        self.assertEqual(d0, d1)
        self.assertEqual((moved0, moved1), (0.0, 0.0), "weight decay moved a frozen parameter")

    def test_ranks_with_other_settings_are_named(self):
        for rank, message in enumerate(r["mismatch"] for r in results(2, self)):
            self.assertIsNotNone(message, f"rank {rank} trained on")
            self.assertIn("width = 1 on rank 1, 2 on rank 0", message)

    def test_added_groups_and_lr_schedulers(self):
        got = results(2, self)
        for rank in range(2):
            lr, trained, digest, refused = got[rank]["groups"]
            self.assertEqual(lr, LR * 0.25)  # StepLR halved it twice in 4 steps
            self.assertTrue(trained, "the added group was not trained")
            self.assertEqual(digest, got[0]["groups"][2])
            self.assertIn("add_param_group", refused or "")

    def test_timeline_of_the_pipelined_steps_and_of_ddp(self):
        got = results(2, self)[0]["timeline"]
        written, events = got["pipelined"]
        spans = [e for e in events if e["ph"] == "X"]
        self.assertEqual(written, len(spans))
        self.assertEqual({e["pid"] for e in events}, {0, 1})

        def of(rank, name, step):
            found = [e for e in spans if (e["pid"], e["name"], e["args"]["step"]) ==
                     (rank, name, step)]
            self.assertEqual(len(found), 1, f"rank {rank} {name} step {step}: {found}")
            return found[0]["ts"], found[0]["ts"] + found[0]["dur"]
        self.assertEqual({e["args"]["step"] for e in spans}, {3, 4, 5, 6})
        for rank in range(2):
            for t in range(3, 7):
                for name in ("forward", "backward", "update", "wait_aggregate", "predict"):
                    self.assertEqual([e["tid"] for e in spans if (e["pid"], e["name"],
                                     e["args"]["step"]) == (rank, name, t)], [0])
                # The AllReduce of step t starts after its backward and, at width 2, ends
                # before step t + 1's wait for it does (1 us: the file's rounding).
                begin, end = of(rank, "allreduce", t)
                self.assertGreaterEqual(begin + 1, of(rank, "backward", t)[1])
                if t + 1 < 7:
                    self.assertLessEqual(end, of(rank, "wait_aggregate", t + 1)[1] + 1)
        written, events = got["ddp"]
        comm = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
        # DDP's hook calls are untagged: each is the step during which it started (one bucket).
        self.assertEqual(sorted((e["pid"], e["args"]["step"]) for e in comm if
                                e["name"] == "allreduce"), [(0, 1), (0, 2), (1, 1), (1, 2)])
        expect = ["first_step -1", "steps 0", "first_step 1.5", "timeline: expected",
                  "another process group", None]
        self.assertEqual(len(got["bad"]), len(expect))
        for message, words in zip(got["bad"], expect):
            if words is None:  # a timeline on the optimizer's own group
                self.assertIsNone(message)
            else:
                self.assertIn(words, message or "")
        for rank in range(2):
            self.assertIn("rank 0 cannot write /nonexistent-pipesgd-dir/timeline.json",
                          results(2, self)[rank]["timeline"]["bad_write"] or "")

    def test_a_subgroup_without_global_rank_zero(self):
        got = results(4, self)
        digests = [r[len(REPLICAS)] for r in got]
        self.assertEqual(digests[0], digests[1])
        self.assertEqual(digests[2], digests[3])
        self.assertNotEqual(digests[0], digests[2])  # the pairs trained on other data


if __name__ == "__main__":
    unittest.main()
