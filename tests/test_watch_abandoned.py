"""A batch the loop abandons after its backward (its own NaN guard: the gradients cleared, `continue`,
no optimizer step) is read at the next forward as a batch of its own (see NOTE: [A batch the loop
abandons] in nanfast/watcher/forwards.py), so that the next, healthy batch's step is neither skipped nor
blamed; gradient accumulation, SAM's two passes and a gradient penalty stay one step."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast
from test_watch_state import count_syncs


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.GELU(), torch.nn.Linear(8, 2))


def _batches(bad: int = 2, n: int = 5):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]
    if bad is not None:
        batches[bad][0][0, 0] = float("nan")
    return batches


def _guarded_run(batches, watch_options=None):
    """A loop whose own guard drops a batch whose gradient norm is not finite (zero_grad's default sets
    the gradients to None), without calling w.step()."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)  # a lagged watch skips on the device
    caught = []
    with (nanfast.watch(model, opt, **watch_options) if watch_options is not None
          else warnings.catch_warnings()) as w:
        for x, y in batches:
            opt.zero_grad()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                F.mse_loss(model(x), y).backward()
            caught += [str(s.message) for s in seen if "nanfast" in str(s.message)]
            if not torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)):
                opt.zero_grad()
                continue
            opt.step()
        w_state = (list(w.events), w.step_count, w.skipped_steps) if watch_options is not None else None
    return model.state_dict(), opt.state_dict()["state"], w_state, caught


@pytest.mark.parametrize("options", [dict(), dict(sync="lagged")], ids=["eager", "lagged"])
def test_a_skip_watch_leaves_the_run_as_if_the_abandoned_batch_never_came(options):
    """Before: the dropped batch's checks stayed in the step that batch 3's optimizer.step() ended, and the
    skip dropped healthy batch 3's update and put back its BatchNorm statistics."""
    batches = _batches()
    model, state, (events, step_count, skipped), caught = _guarded_run(batches, dict(action="skip", **options))
    ref_model, ref_state, _, _ = _guarded_run(batches[:2] + batches[3:])
    assert [(e.step, e.first.phase, e.abandoned, e.evaluation) for e in events] == [(2, "input", True, False)]
    assert "(a batch the loop dropped: its gradients were cleared without an optimizer step)" in events[0].summary()
    assert step_count == 4 and skipped == 0  # the optimizer's steps; nothing of the watch's skipped
    assert [c for c in caught if "no optimizer step to skip" in c] and "the loop dropped the batch itself" in caught[0]
    assert all(torch.equal(model[k], ref_model[k]) for k in ref_model)  # BatchNorm's statistics put back too
    assert all(torch.equal(state[i][k], ref_state[i][k]) for i in ref_state for k in ref_state[i])


def test_a_raise_watch_raises_at_the_next_forward_naming_the_dropped_batch():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches()
    with nanfast.watch(model, opt) as w:
        for i, (x, y) in enumerate(batches):
            opt.zero_grad()
            if i == 3:
                with pytest.raises(nanfast.NonFiniteError) as raised:
                    model(x)
                break
            F.mse_loss(model(x), y).backward()
            if i == 2:
                opt.zero_grad()
                continue
            opt.step()
        assert raised.value.report.abandoned and raised.value.report.step == 2
        assert raised.value.report.first.phase == "input"
        assert w.step_count == 2


def test_a_non_finite_parameter_is_named_in_the_dropped_batch():
    """The forward found a NaN weight (the loop wrote it between steps): the abandoned batch's read names
    the parameter, and a skip watch raises, since no skip can repair it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), (x2, _) = _batches(bad=None, n=2)
    with torch.no_grad():
        model[3].weight[0, 0] = float("nan")
    with nanfast.watch(model, opt, action="skip") as w:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.zero_grad()  # the loop's guard
        with pytest.raises(nanfast.NonFiniteError, match="cannot be skipped once the parameters are non-finite"):
            model(x2)
        [event] = w.events
        assert (event.abandoned, event.first.phase, event.first.name) == (True, "param", "3.weight")


@pytest.mark.parametrize("kind", ["accumulation", "sam", "gradient penalty", "two forwards, one backward"])
def test_steps_of_several_forwards_stay_one_step(kind):
    """A NaN in the first forward of such a step is the step's: its optimizer step is the one skipped."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x1, y1), (x2, y2) = _batches(bad=0, n=2)
    before = [p.detach().clone() for p in model.parameters()]
    with nanfast.watch(model, opt, action="skip") as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.zero_grad()
        if kind == "accumulation":
            F.mse_loss(model(x1), y1).backward()
            F.mse_loss(model(x2), y2).backward()
        elif kind == "sam":  # the first pass's gradients perturb the weights, then are dropped
            F.mse_loss(model(x1), y1).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.nan_to_num(p.grad).sign())
            opt.zero_grad()
            F.mse_loss(model(x2), y2).backward()
        elif kind == "gradient penalty":
            xi = x1.clone().requires_grad_()
            (g,) = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
            (F.mse_loss(model(x2), y2) + g.pow(2).mean()).backward()
        else:
            (F.mse_loss(model(x1), y1) + F.mse_loss(model(x2), y2)).backward()
        opt.step()
        assert [(e.step, e.abandoned) for e in w.events] == [(0, False)] and w.skipped_steps == 1
    if kind != "sam":  # SAM's perturbation is the loop's own write, not the skipped update
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_fused_watch_leaves_the_dropped_batch_in_the_next_step():
    """fuse=True defers its checks: knowing that the dropped batch was bad would cost a read at every such
    forward, so its checks stay in the next step, as documented (w.step() in the guard ends it)."""
    _, _, (events, step_count, skipped), _ = _guarded_run(_batches(), dict(action="skip", fuse=True))
    assert [(e.step, e.abandoned) for e in events] == [(2, False)] and (step_count, skipped) == (4, 1)


@pytest.mark.parametrize("loop", ["pgd", "gan discriminator"])
def test_healthy_loops_that_drop_gradients_read_once_per_step(loop):
    """PGD adversarial training's attack passes (zero_grad, backward, the input's gradient), and a GAN's
    discriminator run unfrozen in its generator's step, then zeroed: taken for abandoned batches, each added
    a host read to a healthy step (a review, session 47)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.nn.Linear(4, 4)
    batches = _batches(bad=None, n=4)
    w = nanfast.watch(model, opt, action="skip")

    def step(x, y):
        if loop == "pgd":
            delta = torch.zeros_like(x, requires_grad=True)
            for _ in range(3):
                opt.zero_grad()
                F.mse_loss(model(x + delta), y).backward()
                delta = (delta + 0.01 * delta.grad.sign()).detach().requires_grad_()
            opt.zero_grad()
            F.mse_loss(model(x + delta), y).backward()
        else:
            opt.zero_grad()
            model(x).mean().backward()
            opt.step()
            model(generator(x)).mean().backward()  # the generator's step: the discriminator's gradients made
            return
        opt.step()

    syncs = [count_syncs(lambda: step(x, y)) for x, y in batches]
    assert syncs == [1] * len(batches) and w.events == []
    w.remove()


def test_a_healthy_abandoned_batch_is_silent():
    batches = _batches(bad=None)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action="raise") as w, warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (x, y) in enumerate(batches):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            if i % 2:  # dropped for a reason of the loop's own
                opt.zero_grad()
                continue
            opt.step()
        assert w.events == [] and w.step_count == 3


def test_a_forward_with_the_optimizers_parameters_frozen_drops_no_gradients():
    """A GAN's discriminator run in its generator's step with its parameters frozen (Lightning's
    toggle_optimizer): that backward made none of its gradients, so nothing was abandoned; the
    discriminator's own step holds that forward's checks, as before."""
    model = _model()
    generator = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action="skip") as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step, (x, _) in enumerate(_batches(bad=None, n=3)):
            z = torch.randn(6, 4)
            if step == 1:
                z[0, 0] = float("nan")
            model.requires_grad_(False)  # the generator's step
            model(generator(z)).mean().backward()
            model.requires_grad_(True)
            opt.zero_grad()  # the discriminator's step
            model(x).mean().backward()
            opt.step()
        assert [(e.step, e.abandoned) for e in w.events] == [(1, False)] and w.skipped_steps == 1


def test_a_parameter_the_loops_perturbation_made_non_finite_is_not_blamed_on_the_previous_step():
    """SAM perturbs the weights by the first pass's gradients: a dirty batch's NaN gradients made them NaN
    within the step, and the event said the step "began with" them, "made by the previous optimizer step"
    (a probe, session 47)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = _batches(bad=0, n=1)
    with nanfast.watch(model, opt, action="warn") as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * p.grad)  # NaN where the gradient is
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        [event] = w.events
    assert event.first.phase == "param" and event.params_rewritten
    assert "the loop wrote the parameters between this step's forwards" in event.summary()
    assert "began with" not in event.summary()
