"""watch(..., on_event="locate", rerun=...): a bad step is re-run under nanfast.locate and the finding
is attached to the event; the re-run leaves no trace and is not a step."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast


class Standardize(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(dim=-1, keepdim=True)
        return centered / centered.std(dim=-1, keepdim=True)  # no epsilon: a constant sample gives 0/0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.standardize = Standardize()
        self.hidden = torch.nn.Linear(6, 16)
        self.dropout = torch.nn.Dropout(0.5)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.dropout(torch.relu(self.hidden(self.standardize(x)))))


def _batches(steps: int, bad_step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    batches = []
    for step in range(steps):
        x = torch.randn(8, 6, generator=gen)
        if step == bad_step:
            x[5] = 2.0
        batches.append((x, torch.randint(0, 3, (8,), generator=gen)))
    return batches


def _rerunnable():
    """A model, its optimizer, the batch being trained (fill in "x" and "y") and a rerun of it."""
    torch.manual_seed(0)
    model = Net()
    current = {}

    def rerun():
        F.cross_entropy(model(current["x"]), current["y"]).backward()

    return model, torch.optim.SGD(model.parameters(), lr=0.1), current, rerun


def test_bad_step_is_located_and_skipped():
    model, optimizer, current, rerun = _rerunnable()
    w = nanfast.watch(model, optimizer, action="skip", on_event="locate", rerun=rerun)
    rng_after_bad_step = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step, (x, y) in enumerate(_batches(4, bad_step=2)):
            current.update(x=x, y=y)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            rng = torch.get_rng_state()
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            if step == 2:
                # The re-run put the RNG state (dropout's draws) and the grads back as they were.
                assert torch.equal(torch.get_rng_state(), rng)
                assert all(torch.equal(p.grad, torch.zeros_like(g)) for p, g in zip(model.parameters(), grads))
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
                rng_after_bad_step = rng
    w.remove()
    assert rng_after_bad_step is not None
    assert w.step_count == 4 and w.skipped_steps == 1  # the re-run is not a step
    [event] = w.events
    assert event.step == 2 and event.phase == "forward" and event.name == "standardize"
    finding = event.located
    assert finding is not None
    assert finding.op == "aten.div.Tensor" and finding.phase == "forward"
    assert finding.where.filename == __file__ and "centered.std" in open(__file__).read().splitlines()[finding.where.lineno - 1]
    assert "located: nanfast.locate: aten.div.Tensor" in event.summary()
    assert event.located_differs is None  # the div ran in Standardize.forward: the places agree


def test_locate_needs_rerun_and_eager_sync():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="rerun="):
        nanfast.watch(model, optimizer, on_event="locate")
    with pytest.raises(ValueError, match="sync='eager'"):
        nanfast.watch(model, optimizer, on_event="locate", rerun=lambda: None, sync="lagged")
    with pytest.raises(ValueError, match="on_event must be one of"):
        nanfast.watch(model, optimizer, on_event="print")


def test_a_watch_without_module_hooks_still_names_the_op_through_locate():
    """watch(modules=False) sees the bad value only where it reaches the model's output; the re-run under
    locate names the op and its line, which module hooks would have named as the module."""
    model, optimizer, current, rerun = _rerunnable()
    with warnings.catch_warnings(), nanfast.watch(model, optimizer, modules=False, action="skip",
                                                  on_event="locate", rerun=rerun) as w:
        warnings.simplefilter("ignore", RuntimeWarning)
        for x, y in _batches(3, bad_step=1):
            current.update(x=x, y=y)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    [event] = w.events
    assert (event.step, event.phase, event.name) == (1, "forward", "")  # the model's output: no module named
    finding = event.located
    assert finding is not None and finding.op == "aten.div.Tensor" and finding.phase == "forward"
    assert "centered.std" in open(__file__).read().splitlines()[finding.where.lineno - 1]
    assert w.skipped_steps == 1
