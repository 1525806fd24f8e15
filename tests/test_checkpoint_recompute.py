"""Activation checkpointing (torch.utils.checkpoint, use_reentrant=False) re-runs forward ops inside
backward: locate labels them as recomputed, not as backward ops of the node that needed their values,
and the watch neither counts the re-run modules as second calls nor checks them again."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import nanfast

_SOURCE = pathlib.Path(__file__).read_text().splitlines()


def line(marker: str) -> int:
    [hit] = [i for i, text in enumerate(_SOURCE, 1) if text.endswith(f"# <{marker}>")]
    return hit


def block(x):
    y = torch.log(x)  # <checkpointed-log>
    return y * y  # its backward needs log(x): the recomputation runs log again


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_locate_labels_the_recomputed_op(use_reentrant):
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    with nanfast.locate(action="record") as region:
        checkpoint(block, x, use_reentrant=use_reentrant).sum().backward()
    forward, recomputed = region.findings[:2]
    assert (forward.op, forward.phase) == ("aten.log.default", "forward")
    assert (recomputed.op, recomputed.phase, recomputed.node) == ("aten.log.default", "recompute", None)
    assert recomputed.where.lineno == line("checkpointed-log") and recomputed.where.filename == __file__
    assert "recomputed in backward (activation checkpointing)" in recomputed.summary()
    assert all(f.phase != "backward" or f.node != "MulBackward0" for f in region.findings)


def test_locate_entered_for_backward_only_finds_the_fault_in_the_recomputation():
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    loss = checkpoint(block, x, use_reentrant=False).sum()
    with pytest.raises(nanfast.NonFiniteError, match="recomputed in backward") as raised:
        with nanfast.locate():
            loss.backward()
    finding = raised.value.report
    assert (finding.op, finding.phase) == ("aten.log.default", "recompute")
    assert finding.where.lineno == line("checkpointed-log")


class Checkpointed(torch.nn.Module):
    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.stem = torch.nn.Linear(4, 4)  # the checkpointed block's input requires grad (use_reentrant=True needs it)
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(checkpoint(self.inner, self.stem(x), use_reentrant=self.use_reentrant))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_watch_does_not_count_the_recomputation_as_a_second_call(use_reentrant):
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.inner[0].weight.fill_(1e38)  # inner.0's output overflows
    with nanfast.watch(model, opt, params=False) as w, pytest.raises(nanfast.NonFiniteError):
        opt.zero_grad()
        F.mse_loss(model(torch.ones(2, 4) * 10), torch.zeros(2, 1)).backward()
        opt.step()
    places = w.last.places
    assert (places[0].phase, places[0].name, places[0].call) == ("forward", "inner.0", 1)
    assert all(p.call == 1 for p in places), [p.describe() for p in places]
    assert not any("call 2" in p.where() for p in places)
    assert sum(p.phase == "forward" and p.name == "inner.0" for p in places) == 1  # not checked again
    # the gradients inside the block are still checked module by module (with use_reentrant=True, on
    # the graph the recomputation builds)
    assert any(p.phase == "backward" and p.name == "inner.1" for p in places)


class SqrtShift(torch.nn.Module):
    """Finite forward; the gradient of sqrt(x - min) is +inf at the minimum: a backward fault."""

    def forward(self, x):
        return torch.sqrt(x - x.min().detach())


class CheckpointsBlock(torch.nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.inp, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        self.block = torch.nn.Sequential(SqrtShift(), torch.nn.Linear(8, 8))
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = self.inp(x)
        h = self.block(h) if self.use_reentrant is None else checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        return self.head(h)


@pytest.mark.parametrize("use_reentrant", [None, False, True], ids=["plain", "checkpointed", "reentrant"])
def test_the_gradient_out_of_a_checkpointed_blocks_first_module_is_checked(use_reentrant):
    """With use_reentrant=True the block's input is a detached leaf, with no grad_fn to hook: the fault
    in the backward of block.0 was named at inp.weight's gradient (a probe, session 44)."""
    torch.manual_seed(0)
    model = CheckpointsBlock(use_reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action="warn") as w, pytest.warns(RuntimeWarning):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert [(e.first.phase, e.first.name) for e in w.events] == [("backward", "block.0")]
