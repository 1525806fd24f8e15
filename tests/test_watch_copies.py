"""Copies of a watched model (NOTE: [Copies of a watched model]): an EMA or teacher copy made with
copy.deepcopy, torch's AveragedModel or timm's ModelEmaV3 after watch(), and torch.save(model), work;
what a copy computes is never recorded as the watched model's; the watched model stays watched."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import nanfast
from test_watch import MLP, batch, train_step

NAN = float("nan")


def watched(**options):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, nanfast.watch(model, opt, **options)


def poisoned(module):
    """A copy's first Linear weight made NaN: anything it computes is NaN."""
    with torch.no_grad():
        module.l1.weight[0, 0] = NAN
    return module


def test_a_deepcopy_made_after_watch_is_not_recorded_as_the_watched_model():
    """A teacher's NaN forward inside a step is not the watched model's: no event, no raise (before, the
    deepcopy raised TypeError, and a copy's forward was recorded as the watched model's, call 2)."""
    model, opt, w = watched()
    x, y = batch()
    teacher = poisoned(copy.deepcopy(model))
    for _ in range(3):
        opt.zero_grad()
        with torch.no_grad():
            target = teacher(x)
        assert torch.isnan(target).any()
        F.mse_loss(model(x), y).backward()
        opt.step()  # action="raise": would raise on an event
    assert w.events == [] and w.step_count == 3


def test_a_shallow_copy_of_a_module_shares_its_hooks_but_is_not_recorded():
    model, opt, w = watched()
    x, y = batch()
    shallow = copy.copy(model.l2)
    assert shallow._forward_hooks is model.l2._forward_hooks
    opt.zero_grad()
    assert torch.isnan(shallow(torch.full((5, 16), NAN))).all()
    F.mse_loss(model(x), y).backward()
    opt.step()
    assert w.events == []


def test_the_watched_model_is_still_watched_after_a_deepcopy():
    model, opt, w = watched(action="skip")
    teacher = copy.deepcopy(model)
    x, y = batch()
    train_step(model, opt, x, y)
    train_step(teacher, torch.optim.SGD(teacher.parameters(), lr=0.1), x, y)  # a step of the copy's own
    assert w.events == []
    dirty = x.clone()
    dirty[0, 0] = NAN
    train_step(model, opt, dirty, y)
    assert [(e.step, e.first.phase) for e in w.events] == [(1, "input")]


def test_torch_averagedmodel_and_timm_model_ema_after_watch():
    """torch's AveragedModel and timm's ModelEmaV3 deep-copy the model they are given."""
    timm_utils = pytest.importorskip("timm.utils")
    model, opt, w = watched()
    averaged = torch.optim.swa_utils.AveragedModel(model)
    ema = timm_utils.ModelEmaV3(model, decay=0.9)
    x, y = batch()
    for _ in range(3):
        train_step(model, opt, x, y)
        averaged.update_parameters(model)
        ema.update(model)
    assert w.events == []
    for copied in (averaged.module, ema.module):
        assert all(torch.isfinite(p).all() for p in copied.parameters())
        assert not torch.equal(copied.l1.weight, model.l1.weight)  # averaged, not the same tensors
        poisoned(copied)
        with torch.no_grad():
            copied(x)
    train_step(model, opt, x, y)
    assert w.events == [] and w.step_count == 4


def test_a_watched_model_saved_whole_loads_as_an_unwatched_model():
    model, opt, w = watched()
    x, y = batch()
    train_step(model, opt, x, y)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # TypeError before: the hooks pickled the watch
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), model(x))
    poisoned(loaded)
    assert torch.isnan(loaded(x)).any()  # its inert hooks do nothing, and raise nothing
    train_step(model, opt, x, y)
    assert w.events == [] and w.step_count == 2


def test_remove_takes_the_watched_models_hooks_off_and_leaves_a_copys_inert_ones():
    model, opt, w = watched()
    hooks_before = {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()}
    copied = copy.deepcopy(model)
    w.remove()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert {name: (len(m._forward_pre_hooks), len(m._forward_hooks))
            for name, m in copied.named_modules()} == hooks_before
    x, _ = batch()
    assert torch.equal(copied(x), model(x))

