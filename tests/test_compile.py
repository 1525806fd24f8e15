"""nanfast with torch.compile: check_all and stats on a compiled model, the ops traced inside a
compiled step without graph breaks (fullgraph=True) and giving eager's results; CUDA-graph capture of
the ops (skipped without a GPU). The ops themselves are compiled alone in tests/test_ops.py."""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import nanfast


class Net(torch.nn.Module):
    """log of its input: non-finite outputs for inputs <= 0, so a batch chooses clean or bad."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 8)
        self.outer = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(torch.log(x)))


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


CLEAN = torch.rand(6, 4) + 0.5
BAD = CLEAN.clone()
BAD[2, 1] = 0.0  # log(0) = -inf: infinities downstream, NaN where +inf and -inf meet


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_check_all_on_a_compiled_model_names_its_parameters():
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    compiled(CLEAN).sum().backward()
    eager = nanfast.check_all(model, grads=True)
    report = nanfast.check_all(compiled, grads=True)
    assert [e.name for e in report.entries] == ["inner.weight", "inner.bias", "outer.weight", "outer.bias"]
    assert report == eager  # the same tensors: the compiled model's parameters are the model's
    with torch.no_grad():
        model.outer.weight[1, 2] = math.nan
    with pytest.raises(nanfast.NonFiniteError, match=r"outer\.weight \[3, 8\] \(nan=1"):
        nanfast.check_all(compiled)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_stats_of_compiled_outputs_match_eager(backend):
    model = _model()
    compiled = torch.compile(model, backend=backend)
    for batch in (CLEAN, BAD):
        with torch.no_grad():
            expected, got = nanfast.stats(model(batch)), nanfast.stats(compiled(batch))
        assert got.counts.tolist() == expected.counts.tolist()
        torch.testing.assert_close(got.norm, expected.norm, rtol=1e-5, atol=0)
    assert nanfast.stats(compiled(BAD)).nonfinite.item() > 0


def checked_step(model: torch.nn.Module, x: torch.Tensor):
    """A training step's forward with its checks, all inside one compiled graph."""
    out = model(x)
    s = nanfast.stats([out, x])
    loss = torch.where(s.any_nonfinite, torch.zeros((), dtype=out.dtype), out.square().mean())
    return (loss, s.counts, s.norm, s.absmax, s.total_norm, nanfast.any_nonfinite([out]),
            torch.ops.nanfast.any_nonfinite([x]), torch.ops.nanfast.stats([out])[0])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_checks_compile_inside_a_step_without_graph_breaks(backend):
    model = _model()
    # fullgraph=True: a graph break anywhere in the step (the checks included) is an error.
    compiled = torch.compile(checked_step, backend=backend, fullgraph=True)
    for batch in (CLEAN, BAD):
        expected = checked_step(model, batch)
        got = compiled(model, batch)
        for g, e in zip(got, expected):
            if g.is_floating_point():
                torch.testing.assert_close(g, e, rtol=1e-5, atol=0, equal_nan=True)
            else:
                assert torch.equal(g, e)
    assert compiled(model, BAD)[5].item() and not compiled(model, CLEAN)[5].item()


def test_compiled_step_has_one_graph():
    explanation = torch._dynamo.explain(checked_step)(_model(), CLEAN)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ops_capture_in_a_cuda_graph():
    """No host sync and no allocation outside the caching allocator: the ops record into a CUDA graph,
    and each replay reads the inputs' current values."""
    x = torch.randn(1000, device="cuda")
    y = torch.randn(37, 5, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture, as torch.cuda.graphs asks
        nanfast.stats([x, y])
        nanfast.any_nonfinite([x, y])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s = nanfast.stats([x, y])
        found = nanfast.any_nonfinite([x, y])
        total = s.total_norm
    for planted in (None, (3, math.nan), (7, math.inf)):
        if planted is not None:
            x[planted[0]] = planted[1]
        graph.replay()
        eager = nanfast.stats([x, y])
        assert torch.equal(s.counts, eager.counts)
        assert torch.equal(s.norm, eager.norm) and torch.equal(total, eager.total_norm)
        assert found.item() == (planted is not None)


@pytest.mark.parametrize("profile", [False, True])
def test_watch_on_a_compiled_model_keeps_the_graph_whole(profile):
    """The hooks are idle inside the compiled region (no graph breaks); the fault inside it is caught at
    the gradients and the step is skipped, as in eager. A profiled watch's timing of its hooks read the
    clock there first, breaking the graph at every module (a probe, session 46)."""
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    w = nanfast.watch(compiled, optimizer, action="skip", profile=profile)
    changed = []
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        for batch in (CLEAN, BAD, CLEAN):
            optimizer.zero_grad()
            compiled(batch).sum().backward()
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            changed.append(not all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))
    w.remove()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert changed == [True, False, True]
    assert [(e.step, e.phase, e.name) for e in w.events] == [(1, "grad", "inner.weight")]
    # The input was dirty (log(0)) but never checked: the event says so rather than read as a clean batch.
    assert w.events[0].forward_unchecked and not w.events[0].dirty_input
    assert "its input and output were not checked, nor a compiled region's activations" in w.events[0].summary()
    assert nanfast.check_all(model, raise_on_nonfinite=False).ok


def test_on_event_locate_re_runs_a_bad_step_of_a_compiled_model():
    """The re-run's RNG states were taken by the model's forward pre-hook only, idle in a compiled forward:
    on_event="locate" with a rerun calling the uncompiled model (what docs/watch.md advises) never ran
    it, and `located` stayed None (a probe, session 46; NOTE: [A compiled step's RNG states])."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="aot_eager")
    current, reruns = {}, []

    def rerun():
        reruns.append(1)
        model(current["x"]).sum().backward()

    torch._dynamo.utils.counters.clear()
    w = nanfast.watch(compiled, optimizer, action="skip", on_event="locate", rerun=rerun)
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        for batch in (CLEAN, BAD, CLEAN):
            current["x"] = batch
            optimizer.zero_grad()
            compiled(batch).sum().backward()
            optimizer.step()
    w.remove()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    [event] = w.events
    assert (event.step, event.phase, len(reruns)) == (1, "grad", 1)
    assert event.located is not None and event.located.op == "aten.log.default"


def test_the_state_taken_for_a_re_run_keeps_no_gradients_alive():
    """The RNG states taken at a step's end for the next step's re-run (NOTE: [A compiled step's RNG
    states]) held the parameters' gradients: zero_grad could not free them, and with the forward compiled
    they lived through the next step (a review, session 46)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="aot_eager")
    w = nanfast.watch(compiled, optimizer, on_event="locate", rerun=lambda: None)
    grads = []
    for _ in range(2):
        optimizer.zero_grad()  # set_to_none: the last step's gradients go here
        gc.collect()
        assert [g() for g in grads] == [None] * len(grads)
        compiled(CLEAN).sum().backward()
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        optimizer.step()
    w.remove()


def test_a_compiled_model_watched_without_an_optimizer_says_what_is_not_checked():
    """Inference on a compiled model: its forwards run no hook, so a NaN output left no event and no
    warning (a probe, session 46). Said at watch(); with an optimizer its steps' pass still reads the
    gradients, and an uncompiled model is watched as ever: nothing to say."""
    model = _model()
    for compiled in (torch.compile(model, backend="aot_eager"), _compiled_in_place()):
        with pytest.warns(UserWarning, match="Net is compiled: its forwards run none of the watch's hooks"):
            nanfast.watch(compiled).remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nanfast.watch(model).remove()
        compiled = torch.compile(model, backend="aot_eager")
        nanfast.watch(compiled, torch.optim.SGD(model.parameters(), lr=0.1)).remove()


def _compiled_in_place() -> Net:
    model = _model()
    model.compile(backend="aot_eager")
    return model


class _GatedNorm(torch.nn.Module):
    """sqrt(h * h) where a gate zeroes a column: sqrt's backward at 0 is inf, times 0 NaN."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.register_buffer("gate", torch.tensor([1.0, 0.0, 1.0, 1.0]))

    def forward(self, x):
        h = self.fc(x) * self.gate
        return torch.sqrt(h * h).sum()


def test_locate_says_a_nan_may_come_from_a_compiled_backwards_kernels():
    """Only backward() under locate, the forward compiled by inductor: the NaN is made inside the fused
    backward kernels, which locate cannot see. It blamed the first op it saw for NaN "not made under
    locate (data, parameter or buffer)" (a probe, session 46); now it says the region was compiled."""
    torch.manual_seed(0)
    out = torch.compile(_GatedNorm(), backend="inductor")(torch.randn(16, 8))
    with pytest.raises(nanfast.NonFiniteError) as caught:
        with nanfast.locate():
            out.backward()
    text = str(caught.value)
    assert "CompiledFunctionBackward" in text and "torch.compile'd region, whose fused kernels locate does not see" in text


class _NormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.outer = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.norm(self.inner(torch.log(x)))))


def _train_compiled(optimizer, run, batches, go_on: bool) -> None:
    """One training step per batch through `run` (the compiled model). A stop (NonFiniteError, or with
    `go_on` a callable action's RuntimeError) ends the training, or with `go_on` is caught as a loop
    catches it, which goes on with the next batch."""
    for batch in batches:
        optimizer.zero_grad()
        try:
            run(batch).sum().backward()
            optimizer.step()
        except (nanfast.NonFiniteError, RuntimeError) as stop:
            if not go_on:
                if isinstance(stop, nanfast.NonFiniteError):
                    break
                raise


@pytest.mark.parametrize("action, sync", [("skip", "eager"), ("raise", "eager"), ("skip", "lagged"),
                                          ("rollback", "lagged")])
@pytest.mark.parametrize("how", ["compile(model)", "model.compile()"])
def test_a_bad_compiled_step_leaves_batchnorm_statistics_as_they_were(action, sync, how):
    """The buffer snapshot is taken by the model's forward pre-hook, idle inside a compiled forward: a
    skipped (or raised) bad batch left NaN running statistics (NOTE: [Buffers of compiled forwards]).
    Lagged, with a fused optimizer that skips on the device, the next step's snapshot was taken before
    the skip put the buffers back, from the bad values (a probe, session 48)."""
    def train(batches, watched):
        torch.manual_seed(0)
        model = _NormNet()
        if sync == "lagged":  # skips on the device: the buffers are put back after the optimizer step
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        w = nanfast.watch(model, optimizer, action=action, sync=sync) if watched else None
        if how == "model.compile()":
            model.compile(backend="aot_eager")
            run = model
        else:
            run = torch.compile(model, backend="aot_eager")
        _train_compiled(optimizer, run, batches, go_on=False)
        if w is not None:
            w.remove()  # a watch left installed made a later test's count of global hooks order-dependent
        return model, optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skip's warning
        model, optimizer = train([CLEAN, CLEAN * 2, BAD, CLEAN * 3], watched=True)
    expected, _ = train([CLEAN, CLEAN * 2] + ([CLEAN * 3] if action != "raise" else []), watched=False)
    for (name, buffer), want in zip(model.named_buffers(), expected.buffers()):
        assert torch.equal(buffer, want), name


@pytest.mark.parametrize("action", ["raise", "a callable raising"])
def test_caught_stops_of_consecutive_bad_compiled_steps_leave_batchnorm_statistics_as_they_were(action):
    """The next step's buffer snapshot (a compiled forward takes none) was taken after the step's read
    only when acting did not raise: after a caught stop, the next bad batch's statistics stayed (a
    review, session 48)."""
    def stop(event):
        raise RuntimeError("stop")

    def train(batches, watched):
        torch.manual_seed(0)
        model = _NormNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        w = nanfast.watch(model, optimizer, action="raise" if action == "raise" else stop) if watched else None
        _train_compiled(optimizer, torch.compile(model, backend="aot_eager"), batches, go_on=True)
        if w is not None:
            w.remove()
        return model

    model = train([CLEAN, CLEAN * 2, BAD, BAD * 2, CLEAN * 3], watched=True)
    expected = train([CLEAN, CLEAN * 2, CLEAN * 3], watched=False)
    for (name, buffer), want in zip(model.named_buffers(), expected.buffers()):
        assert torch.equal(buffer, want), name


def test_a_compiled_models_loss_passed_before_backward_is_read_with_its_step():
    """A compiled forward leaves the model's hooks idle, so every loss came "before any forward of its
    step": each was read alone as the step before's (two host reads a step), warned as misplaced, and
    kept out of the timeline (a review, session 48)."""
    torch.manual_seed(0)
    model = _NormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = nanfast.watch(model, opt, action="skip")
    run = torch.compile(model, backend="aot_eager")

    def step(batch, targets=None):
        opt.zero_grad()
        out = run(batch)
        loss = w.loss(out.sum() if targets is None else F.cross_entropy(out, targets, ignore_index=-100))
        loss.backward()
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing said of the loss's place
        for _ in range(4):
            step(CLEAN)
    with pytest.warns(RuntimeWarning, match="skipped"):
        step(CLEAN, torch.full((6,), -100))  # every target ignored: a NaN loss, zero gradients
    assert (w.last.phase, w.last.step, w.last.late_loss) == ("loss_value", 4, False)
    assert [record.step for record in w.history if record.loss is not None][:4] == [0, 1, 2, 3]  # in the timeline
    w.remove()


def test_past_the_recompile_limit_a_dirty_batch_is_not_read_as_a_submodules_fault():
    """dynamic=False and batches of many sizes: past torch.compile's recompile limit the forward runs
    uncompiled, its submodules' hooks work again and the model's own, compiled on their own, stay idle.
    A dirty batch was then named the first Linear's fault with forward_unchecked False, and the healthy
    run was told to watch a submodule (a probe, session 48)."""
    import torch._dynamo

    torch.manual_seed(0)
    model = _NormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, dynamic=False, backend="aot_eager")
        w = nanfast.watch(compiled, opt, action="skip")
        for n in range(4, 9):  # healthy, each batch a new size
            opt.zero_grad()
            compiled(torch.rand(n, 4) + 0.5).sum().backward()
            opt.step()
        said = [str(c.message) for c in caught if "its own forward did not" in str(c.message)]
        assert len(said) == 1 and "past torch.compile's recompile limit" in said[0]
        assert w.events == []
        x = torch.rand(20, 4) + 0.5
        x[3, 1] = float("nan")
        opt.zero_grad()
        compiled(x).sum().backward()
        opt.step()
    w.remove()
    event = w.events[-1]
    assert event.forward_unchecked and "its input and output were not checked" in event.summary()
    assert w.skipped_steps == 1


class _Root(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(h * h)  # |h|: finite, but its gradient at h = 0 is inf * 0 = NaN


class _RootNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 8)
        self.root = _Root()
        self.outer = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.root(self.inner(x)))


@pytest.mark.parametrize("compiled_autograd", [False, True])
def test_watch_under_compiled_autograd_checks_the_gradients_at_the_step(compiled_autograd):
    """The per-module gradient checks (C++ pre-hooks) stay out of a backward that compiled autograd
    traces, as the hooks do in a compiled forward: the backward-only fault is then caught in the
    parameters' gradients at the step instead of at the module that made it."""
    torch.manual_seed(0)
    model = _RootNet()
    with torch.no_grad():
        model.inner.weight[0] = 0.0
        model.inner.bias[0] = 0.0  # h[:, 0] = 0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, optimizer, action="warn") as w:
        loss = model(CLEAN).sum()
        ca = torch._dynamo.compiled_autograd
        enable = getattr(ca, "_enable", None) or ca.enable  # named `enable` before torch 2.6
        with enable(torch.compile(backend="eager")) if compiled_autograd else contextlib.nullcontext():
            loss.backward()
        with pytest.warns(RuntimeWarning, match="non-finite"):
            optimizer.step()
    first = w.events[0].first
    if compiled_autograd:
        assert (first.phase, first.name) == ("grad", "inner.weight")
    else:
        assert (first.phase, first.name) == ("backward", "root")
