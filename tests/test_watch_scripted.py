"""A TorchScript submodule (torch.jit.script) inside an eager model: it runs no Python hooks, so it is left
unhooked (its output is checked where it reaches the next hooked module), and its buffers, which the
watch cannot copy, are followed by their version counters. watch() raised on such a model (a probe,
session 47): register_forward_pre_hook on a ScriptModule, or a walk over its buffer dict."""

from __future__ import annotations

import warnings

import pytest
import torch

import nanfast


class Net(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script's deprecation warning
            self.inner = torch.jit.script(inner)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.inner(self.a(x))).mean()


@pytest.mark.parametrize("action", ["raise", "warn", "skip"])
def test_a_scripted_submodule_is_watched_around(action):
    torch.manual_seed(0)
    model = Net(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action=action) as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(3):
            opt.zero_grad()
            if step == 1:
                with torch.no_grad():
                    model.inner.weight[0, 0] = float("nan")
            try:
                model(torch.randn(3, 4)).backward()
                opt.step()
            except nanfast.NonFiniteError:
                break
        first = w.events[0]
        assert (first.step, first.phase, first.name) == (1, "param", "inner.weight")
        assert "inner" not in {place.name for place in first.later if place.phase == "forward"}  # unhooked


@pytest.mark.parametrize("action", ["skip", "raise"])
def test_a_scripted_batchnorms_statistics_are_put_back(action):
    """Its running statistics are updated inside the scripted forward without a version bump: copied at
    each step's start, like an eager module's floating-point buffers."""
    def run(batches, watched):
        torch.manual_seed(0)
        model = Net(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with (nanfast.watch(model, opt, action=action) if watched else warnings.catch_warnings()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for x in batches:
                opt.zero_grad()
                model(x).backward()
                try:
                    opt.step()
                except nanfast.NonFiniteError:
                    pass
        return {k: v for k, v in model.state_dict().items()}

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(3, 4, generator=g) for _ in range(4)]
    batches[2][0, 0] = float("inf")
    got, want = run(batches, True), run(batches[:2] + batches[3:], False)
    assert all(torch.equal(got[k], want[k]) for k in want)  # inner.1.running_mean and num_batches_tracked too


def test_rollback_is_refused_naming_the_scripted_submodule():
    model = Net(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    with pytest.raises(ValueError, match=r"rollback.*'inner\.1\.running_mean'"):
        nanfast.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), action="rollback")
