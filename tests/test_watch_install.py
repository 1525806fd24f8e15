"""A watch's install: a watch that fails to install leaves the model and optimizer as they were; the
number of its first step (first_step: a resumed run's, which the framework callbacks pass)."""

import pytest
import torch

import nanfast
from test_watch import MLP, batch, train_step
from test_watch_copies import NAN, watched


class NoHooksOptimizer(torch.optim.SGD):
    """A torch Optimizer subclass that never ran Optimizer.__init__ and holds no optimizer: it has no
    hook dicts, so the watch's install fails after the model's hooks went on."""

    def __init__(self):  # noqa: D107  (deliberately not calling super().__init__)
        pass


def test_a_watch_that_fails_to_install_leaves_the_model_as_it_was():
    model = MLP()
    before = {name: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for name, m in model.named_modules()}
    with pytest.raises(AttributeError):
        nanfast.watch(model, NoHooksOptimizer())
    assert {name: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for name, m in model.named_modules()} == before


def test_first_step_numbers_the_steps():
    model, opt, w = watched(action="skip", first_step=7)
    x, y = batch()
    train_step(model, opt, x, y)
    dirty = x.clone()
    dirty[0, 0] = NAN
    train_step(model, opt, dirty, y)
    assert [e.step for e in w.events] == [8] and w.step_count == 9
    assert [r.step for r in w.history] == [7, 8]
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="first_step must be an int >= 0"):
            nanfast.watch(MLP(), first_step=bad)


class Wrapper(torch.optim.Optimizer):
    """A whole Optimizer wrapping another as `.optimizer` (as a Lookahead does): the watch hooks it, the
    optimizer the loop steps, as before wrappers were looked through (accelerate's, which never ran
    Optimizer.__init__, is hooked through: test_integrations_transformers.py)."""

    def __init__(self, inner):
        super().__init__(inner.param_groups, {})
        self.optimizer = inner

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_a_wrapper_that_is_a_whole_optimizer_is_hooked_itself():
    model = MLP()
    wrapper = Wrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    w = nanfast.watch(model, wrapper, action="skip")
    assert w.optimizer is wrapper
    x, y = batch()
    dirty = x.clone()
    dirty[0, 0] = NAN
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        train_step(model, wrapper, dirty, y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert [e.step for e in w.events] == [0]
