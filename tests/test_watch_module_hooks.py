"""The hooks the watch puts on submodules: two functions of the extension, the same for every module and
watch, acting for the modules in their table only (NOTE: [Module hooks without a Python frame] in
csrc/python/hooked_modules.cpp). Copies of watched modules: tests/test_watch_copies.py; torch.compile:
tests/test_compile.py."""

from __future__ import annotations

import copy
import gc
import sys
import weakref

import pytest
import torch
from torch import nn

import nanfast
from nanfast import _C


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()


def _hook_count(module: nn.Module) -> int:
    return len(module._forward_pre_hooks) + len(module._forward_hooks)


def test_two_watches_on_one_model_share_one_pair_of_hooks_per_module_and_each_sees_every_call():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = nanfast.watch(model, opt, action="skip")
    with pytest.warns(UserWarning, match="already watched"):
        second = nanfast.watch(model, opt, action="skip")
    assert [_hook_count(m) for m in model] == [2, 2, 2]
    model[2].weight.data.fill_(3e38)  # finite, but its products overflow: inf first at the second Linear
    x = torch.full((3, 4), 5.0)
    with pytest.warns(RuntimeWarning, match="skipped"):
        _step(model, opt, x)
        first.remove()
        assert [_hook_count(m) for m in model] == [2, 2, 2]  # still the second watch's
        _step(model, opt, x)
    assert [e.step for e in first.events] == [0] and [e.step for e in second.events] == [0, 1]
    for event in first.events + second.events:
        assert (event.phase, event.name) == ("forward", "2")
    second.remove()
    assert [_hook_count(m) for m in model] == [0, 0, 0]
    assert not any(_C.module_hooked(m) for m in model)


def test_the_table_holds_no_module_alive_and_lets_a_freed_ones_entry_go():
    """A head swapped out and dropped is freed, and its entry (which holds the watch's ModuleHooks) goes
    with it, so no module made later at its address could be taken for it."""
    model = _model()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with nanfast.watch(model, opt) as w:
        _step(model, opt, torch.randn(3, 4))
        hooks = w._hooks
        held = sys.getrefcount(hooks)
        old = model[2]
        model[2] = nn.Linear(8, 2)
        _step(model, opt, torch.randn(3, 4))  # the next step's start hooks the new head
        assert _C.module_hooked(old) and _C.module_hooked(model[2])
        with_old = sys.getrefcount(hooks)  # (outside the assert: pytest's rewrite holds its operands)
        assert with_old == held + 1
        gone = weakref.ref(old)
        del old
        gc.collect()
        assert gone() is None
        without = sys.getrefcount(hooks)
        assert without == held
        assert not _C.module_hooked(nn.Linear(8, 2))
        _step(model, opt, torch.randn(3, 4))
    assert w.events == []


def test_a_profiled_watch_counts_its_module_hooks_time():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, profile=True) as w:
        for _ in range(3):
            _step(model, opt, torch.randn(3, 4))
        seconds = w._hooks.seconds
        assert seconds > 0
        assert w.costs()["hooks"] > seconds  # with the model's own hooks, timed in Python
    unprofiled = nanfast.watch(model, opt)
    _step(model, opt, torch.randn(3, 4))
    assert unprofiled._hooks.seconds == 0
    unprofiled.remove()


@pytest.mark.parametrize("strict", [False, True])
def test_an_export_of_a_watched_model_records_nothing_and_traces_no_check(strict):
    """torch.export without Dynamo (strict=False) runs the hooks, which read torch.compiler's flag and do
    nothing; with Dynamo, it traces their stand-ins."""
    model = _model()
    with nanfast.watch(model) as w:
        exported = torch.export.export(model, (torch.randn(3, 4),), strict=strict)
        assert w._step.slots == [] and w.events == []
        assert not any("nanfast" in str(node.target) for node in exported.graph.nodes)
        x = torch.randn(3, 4)
        assert torch.equal(exported.module()(x), model(x))


def test_a_copy_of_a_watched_model_watched_on_its_own_runs_each_hook_once():
    """A deep copy carries the extension's hooks, inert; a watch of the copy takes them off before putting
    its own on. Had they stayed, each of the copy's module calls would have run its watch twice."""
    model = _model()
    watched = nanfast.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    copied = copy.deepcopy(model)
    assert [_hook_count(m) for m in copied] == [2, 2, 2]  # inert: the copy is in no table
    opt = torch.optim.SGD(copied.parameters(), lr=0.1)
    with nanfast.watch(copied, opt, action="skip") as w:
        assert [_hook_count(m) for m in copied] == [2, 2, 2]
        copied[2].weight.data.fill_(3e38)
        with pytest.warns(RuntimeWarning, match="skipped"):
            _step(copied, opt, torch.full((3, 4), 5.0))
    assert [(e.phase, e.name, e.first.call) for e in w.events] == [("forward", "2", 1)]
    assert watched.events == [] and watched._step.slots == []
    watched.remove()
