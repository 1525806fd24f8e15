"""watch(fuse=True) (NOTE: [Fused records]): the forward's and the backward's checks
in the step's pass; the same events as the default watch on real faults, a few fused calls per step
whatever the model, no host read before the step's one, and the memory bound on deferred tensors."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast
from nanfast.cli import watch_workloads
from op_recorder import OpRecorder

# Each test runs with the recorder's counts on the host and as tensors, as on a GPU (conftest.py).
pytestmark = pytest.mark.usefixtures("recorder_counts")

NAN, INF = float("nan"), float("inf")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.act = torch.nn.Tanh()
        self.fc2 = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.norm(self.fc2(self.act(self.fc1(x)))))


class SqrtOfNegative(torch.autograd.Function):
    """Finite forward, NaN gradient: a backward-only fault."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.tensor(-1.0).sqrt()


class BackwardFault(torch.nn.Module):
    def forward(self, x):
        return SqrtOfNegative.apply(x)


def faults():
    """(name, model maker, batch maker): faults a user meets, each in a different phase."""
    def net():
        torch.manual_seed(0)
        return Net()

    def weight_nan():
        model = net()
        with torch.no_grad():
            model.fc2.weight[3, 2] = NAN
        return model

    def backward_nan():
        model = net()
        model.fc2 = torch.nn.Sequential(model.fc2, BackwardFault())
        return model

    def overflow():  # finite weights whose products overflow float32 in the second layer
        model = net()
        with torch.no_grad():
            model.fc1.weight.mul_(1e20)
            model.fc2.weight.mul_(1e20)
        return model

    clean = lambda: torch.randn(8, 6)  # noqa: E731

    def dirty():
        x = torch.randn(8, 6)
        x[2, 1] = -INF
        return x

    return [("weight", weight_nan, clean), ("backward", backward_nan, clean), ("overflow", overflow, clean),
            ("input", net, dirty)]


def first_event(fuse, make_model, make_batch):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    seen = []
    with nanfast.watch(model, opt, fuse=fuse, action=seen.append) as w:
        for _ in range(2):
            opt.zero_grad()
            w.loss(F.cross_entropy(model(make_batch()), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))).backward()
            opt.step()
    return [(e.step, [(p.phase, p.name, p.nan, p.posinf, p.neginf) for p in (e.first, *e.later)]) for e in seen]


@pytest.mark.parametrize("name,make_model,make_batch", faults(), ids=[f[0] for f in faults()])
def test_the_same_events_as_the_default_watch(name, make_model, make_batch):
    fused, default = first_event(True, make_model, make_batch), first_event(False, make_model, make_batch)
    assert fused and fused == default


@pytest.mark.parametrize("workload", ["mlp", "transformer-small"])
def test_two_calls_per_step_whatever_the_model(workload, monkeypatch):
    monkeypatch.setattr(watch_workloads, "MLP", dict(watch_workloads.MLP, batch=4))
    [(_, model, batch)] = watch_workloads.make_workloads("cpu", [workload])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanfast.watch(model, opt, fuse=True, profile=True) as w:
        for _ in range(3):
            x, y = batch()
            opt.zero_grad()
            with OpRecorder() as ops:
                out = model(x)
                loss = w.loss(F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten()))
                loss.backward()
            assert ops.host_syncs == 0  # forward and backward: nothing read on the host, nothing called
            assert ops.counts["nanfast.stats.default"] == 0
            with OpRecorder() as ops:
                opt.step()
            # The pass over the gradients with the forward's and backward's checks in it, the summary;
            # then the one read.
            assert ops.counts["nanfast.stats.default"] == 1 and ops.counts["nanfast.step_summary.default"] == 1
            assert ops.host_syncs == 1
    assert w.costs()["calls"] == 1 * 3 and w.events == []


def test_the_pass_checks_the_deferred_records_in_its_call():
    recorder = nanfast._C.WatchRecorder(torch.device("cpu"), True, 1 << 20)
    recorder.record([torch.tensor([1.0, NAN])], 0)
    recorder.record([torch.tensor([-INF]), torch.ones(3)], 1)
    grads = [torch.tensor([INF, 2.0]), torch.zeros(5)]
    counts, norm, absmax = recorder.stats_with_deferred(grads, torch.device("cpu"))
    assert counts.tolist() == [[0, 1, 0], [0, 0, 0]] and norm.tolist() == [2.0, 0.0]  # the pass's own rows
    assert recorder.costs()[3] == 0  # the call is the pass's (its caller counts it)
    recorded, _, slots, _, _ = recorder.take()  # nothing left to check
    assert slots == [(0, 1), (1, 2)] and torch.cat(recorded).tolist() == [[1, 0, 0], [0, 0, 1], [0, 0, 0]]
    assert recorder.costs()[3] == 0
    with pytest.raises(RuntimeError, match="is not the recorder's"):
        recorder.stats_with_deferred(grads, torch.device("meta"))


def test_deferred_tensors_are_checked_when_they_reach_the_bound():
    recorder = nanfast._C.WatchRecorder(torch.device("cpu"), True, 4000)  # a 4000-byte bound
    for slot in range(5):
        recorder.record([torch.full((250,), float(slot))], slot)  # 1000 bytes each
    assert recorder.costs()[3] == 1  # the fourth record reached the bound: one call for four
    counts, _, slots, _, _ = recorder.take()  # the fifth, at the take
    assert recorder.costs()[3] == 2 and slots == [(s, 1) for s in range(5)] and torch.cat(counts).sum() == 0
    recorder.record([torch.tensor([NAN, INF])], 7)
    counts, _, slots, _, _ = recorder.take()
    assert slots == [(7, 1)] and torch.cat(counts).tolist() == [[1, 1, 0]]


def test_deferred_tensors_something_else_keeps_alive_are_not_counted_until_it_lets_go():
    """A storage another tensor shares (a view, as autograd's saved outputs are) is not the records'
    alone: past the bound they wait, until it goes (NOTE: [Deferred bytes that only the records keep
    alive])."""
    recorder = nanfast._C.WatchRecorder(torch.device("cpu"), True, 4000)
    tensors = [torch.full((250,), float(slot)) for slot in range(5)]  # 1000 bytes each
    views = [t[:] for t in tensors]
    for slot, t in enumerate(tensors):
        recorder.record([t], slot)
    assert recorder.costs()[3] == 0  # 5000 bytes deferred, none held by the records alone
    del views
    recorder.record([torch.zeros(1)], 5)
    assert recorder.costs()[3] == 1  # counted once the views let go, though the list holds them still
    counts, _, slots, _, _ = recorder.take()
    assert slots == [(s, 1) for s in range(6)] and torch.cat(counts).sum() == 0


def test_a_small_view_that_keeps_a_large_storage_alive_is_weighed_by_its_storage():
    """A record of one element of an 8000-byte tensor nothing else holds keeps those 8000 bytes: over a
    4000-byte bound, it is read at once (weighed by its own 4 bytes, it waited for the take)."""
    recorder = nanfast._C.WatchRecorder(torch.device("cpu"), True, 4000)
    recorder.record([torch.full((2000,), NAN)[:1]], 0)
    assert recorder.costs()[3] == 1
    counts, _, slots, _, _ = recorder.take()
    assert slots == [(0, 1)] and torch.cat(counts).tolist() == [[1, 0, 0]]


class _Chain(torch.nn.Module):
    """Linear and GELU in turn: autograd saves every output but the last for backward (GELU its input,
    Linear its input); with `side`, each block also makes an output that nothing keeps but the watch."""

    def __init__(self, side: bool):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(128, 128) for _ in range(8))
        self.act = torch.nn.GELU()
        self.side = torch.nn.Linear(128, 128) if side else None

    def forward(self, x):
        for block in self.blocks:
            if self.side is not None:
                self.side(x)  # recorded by the watch, then dropped
            x = self.act(block(x))
        return x


def _python_object_counted_while_cpp_holds() -> bool:
    """Whether this torch counts a tensor's Python object's reference while C++ holds the tensor (since
    pytorch/pytorch#167564): a C++ holder then adds one to the object's own count."""
    t = torch.ones(1)
    before = sys.getrefcount(t)
    recorder = nanfast._C.WatchRecorder(torch.device("cpu"), False, 1 << 40)
    recorder.record([t], 0)
    return sys.getrefcount(t) > before


@pytest.mark.parametrize("side", [False, True], ids=["saved by autograd", "dropped"])
def test_the_bound_counts_the_bytes_only_the_deferred_records_keep_alive(side, monkeypatch):
    """NOTE: [Deferred bytes that only the records keep alive]: a forward's records that autograd saves for
    backward keep nothing alive, so they wait for the pass however many bytes they are (ResNet-18
    224x224's were read in 9 calls a step, counted by every deferred byte); outputs that nothing else
    holds are still read at the bound (64 KiB here), and in backward what autograd lets go. The calls'
    rows are summed where they lie (NOTE: [Records taken as views]): no cat joins them."""
    if not side and not _python_object_counted_while_cpp_holds():
        pytest.skip("an older torch: a tensor autograd saved as itself counts as the records' (see the NOTE)")
    monkeypatch.setattr(nanfast.watcher, "FUSE_BYTES", 64 << 10)
    torch.manual_seed(0)
    model = _Chain(side)
    x = torch.randn(64, 128)
    with nanfast.watch(model, fuse=True) as w:
        for _ in range(2):
            with OpRecorder() as forward:
                out = model(x)
            with OpRecorder() as rest:
                w.loss(out.square().mean()).backward()
                w.step()
            # saved: 16 records of 32 KiB, read at the pass (by every byte: 8 calls in forward); dropped:
            # 8 side outputs of 32 KiB that only the records hold, read two by two
            assert forward.counts["nanfast.stats.default"] == (4 if side else 0)
            # in backward, what autograd releases and the gradients are the records' alone: flushed too
            assert rest.counts["nanfast.stats.default"] > 1
            assert "aten.cat.default" not in forward.counts and "aten.cat.default" not in rest.counts
        assert w.events == []


def test_fused_by_default_where_the_results_live_on_an_accelerator():
    """NOTE: [Fused records by default on accelerators]: the default is by device, an explicit value wins."""
    from nanfast.watcher.options import fused_records

    assert fused_records(None, torch.device("cuda", 0)) is True
    assert fused_records(None, torch.device("cpu")) is False and fused_records(None, torch.device("meta")) is False
    assert fused_records(False, torch.device("cuda")) is False and fused_records(True, torch.device("cpu")) is True
    with pytest.raises(TypeError, match="fuse must be True, False or None"):
        fused_records("yes", torch.device("cpu"))
    model = Net()
    with nanfast.watch(model) as w:
        assert w.fuse is False  # a CPU model: each check at once, while the tensor is in cache
    with nanfast.watch(model, fuse=True) as w:
        assert w.fuse is True


# Besides its calls, what a fused step adds on the host, per device, and the most times each may appear:
# views (no launch) of the one call's results, three of the pass's own rows and on a device one of the
# records' rows (NOTE: [Records taken as views]), and the read: the flag's item() (on CUDA after the
# summary's non-blocking copy into pinned memory; on a CPU the records' counts, kept as numbers, packed
# into one tensor).
ADDED_OPS = {"cpu": {"aten.slice.Tensor": 3, "aten.select.int": 1, "aten._local_scalar_dense.default": 1,
                     "aten.empty.memory_format": 1},
             "cuda": {"aten.slice.Tensor": 4, "aten.select.int": 1, "aten._local_scalar_dense.default": 1,
                      "aten.empty.memory_format": 1, "aten.copy_.default": 1}}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_a_fused_healthy_step_adds_only_its_calls_and_the_read(device, recorder_counts):
    """On a GPU every op on the step's host path is a launch or a copy, and the host is what bounds a
    small step (benchmarks/results/cuda-h200.md). A fused watch's healthy step adds to the unwatched
    step's ops its two calls (the pass, with every record in it, and the summary), views and the read:
    no cat of the records, no tensor made from host values, no copy of its counts. (On the H200 before
    NOTE: [Records taken as views], a view per record and a cat: 18 slices and a cat per step.) A CPU
    recorder keeping its counts as tensors makes a GPU's views, without its copy of the summary."""
    [(_, model, batch)] = watch_workloads.make_workloads(device, ["mlp"])
    x, y = batch()
    x, y = x[:4], y[:4]

    def ops_of_a_step(model, opt):
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        with OpRecorder() as ops:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return ops.counts

    plain = copy.deepcopy(model)
    plain_ops = ops_of_a_step(plain, torch.optim.SGD(plain.parameters(), lr=1e-3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanfast.watch(model, opt, fuse=True) as w:
        watched_ops = ops_of_a_step(model, opt)
    added = {name: n - plain_ops[name] for name, n in watched_ops.items() if n != plain_ops[name]}
    calls = {name: added.pop(name, 0) for name in ("nanfast.stats.default", "nanfast.step_summary.default")}
    assert calls == {"nanfast.stats.default": 1, "nanfast.step_summary.default": 1}
    allowed = ADDED_OPS["cuda" if recorder_counts else device]
    assert all(0 < n <= allowed.get(name, 0) for name, n in added.items()), str(sorted(added.items()))
    assert added.get("aten._local_scalar_dense.default") == 1 and w.events == []


def test_deferred_to_the_pass_the_same_events_in_inference_and_across_microbatches():
    """The forward's checks wait for the step's pass, or, without one, for the step's end: an inference
    forward is its own step, read when it returns; the checks of several microbatches' forwards are
    told apart as the default watch tells them."""
    def inference_events(fuse):
        torch.manual_seed(0)
        model = Net()
        with torch.no_grad():
            model.fc2.weight[0, 0] = NAN
        with warnings.catch_warnings(), nanfast.watch(model, fuse=fuse, action="warn") as w, torch.no_grad():
            warnings.simplefilter("ignore")
            model(torch.randn(4, 6))
            first = [(e.step, e.phase, e.name) for e in w.events]
            model(torch.randn(4, 6))
        return first, [(e.step, e.phase, e.name) for e in w.events]

    def microbatch_events(fuse):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        dirty = torch.randn(4, 6)
        dirty[1, 3] = INF
        with warnings.catch_warnings(), nanfast.watch(model, opt, fuse=fuse, action="warn") as w:
            warnings.simplefilter("ignore")
            for x in (torch.randn(4, 6), dirty):
                model(x).square().mean().backward()
            opt.step()
        return [(e.step, e.phase, e.name, e.first.microbatch) for e in w.events]

    first, both = inference_events(True)
    assert first == [(0, "forward", "fc2")] and both == [(0, "forward", "fc2"), (1, "forward", "fc2")]
    assert (first, both) == inference_events(False)
    assert microbatch_events(True) == microbatch_events(False) == [(0, "input", "input", 1)]


@pytest.mark.parametrize("fuse", [False, True])
def test_modules_false_hooks_the_model_alone_and_still_catches_every_fault(fuse):
    """watch(modules=False), the cheapest watch on a GPU step: no hook on any submodule, and each of the
    faults is still reported, where it reaches what the model itself shows (its input, its output, the
    parameters and their gradients, by name); the module that made it is not named."""
    expected = {"weight": ("param", "fc2.weight"), "backward": ("grad", "fc1.weight"),
                "overflow": ("forward", ""), "input": ("input", "input")}
    for name, make_model, make_batch in faults():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        seen = []
        with nanfast.watch(model, opt, modules=False, fuse=fuse, action=seen.append):
            assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules() if m is not model)
            opt.zero_grad()
            F.cross_entropy(model(make_batch()), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])).backward()
            opt.step()
        assert [(e.first.phase, e.first.name) for e in seen] == [expected[name]], name
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    model = faults()[0][1]()  # a NaN weight: clean without it
    with torch.no_grad():
        model.fc2.weight.zero_()
    with nanfast.watch(model, torch.optim.SGD(model.parameters(), lr=1e-3), modules=False) as w:
        F.cross_entropy(model(torch.randn(8, 6)), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])).backward()
        w.optimizer.step()
    assert w.events == [] and w.step_count == 1
