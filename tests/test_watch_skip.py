"""watch(action="skip") means "as if the batch never happened": parameters, module buffers (BatchNorm's
running statistics) and optimizer state, first step included, for every torch optimizer and each of its
implementations; action="raise" before the step leaves the model as the step found it; closure-based
optimizers are refused rather than silently not skipped."""

import copy
import gc
import inspect
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import nanfast
from op_recorder import OpRecorder

# Each test runs with the recorder's counts on the host and as tensors, as on a GPU (conftest.py).
pytestmark = pytest.mark.usefixtures("recorder_counts")

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _one_thread(restore_num_threads):
    """Tiny models: a second intra-op thread only waits for its wake-up on a shared machine (a BatchNorm
    of 6x16 took 11 ms with 2 threads, 18 us with 1, while other jobs ran)."""
    torch.set_num_threads(1)


class BNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.act = torch.nn.ReLU()
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(self.act(self.bn(self.l1(x))))


class LNNet(torch.nn.Module):
    """No buffers: what a skip must undo is the optimizer's alone."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.norm(self.l1(x))))


def batch(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def dirty(seed):
    x, y = batch(seed)
    x[1, 3] = NAN
    return x, y


def train_step(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def full_state(model, opt):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()},
            copy.deepcopy(opt.state_dict()))


def assert_same_state(got, want):
    """Bit for bit: parameters, buffers, and the optimizer's state_dict (state and param groups)."""
    (params, buffers, osd), (params_w, buffers_w, osd_w) = got, want
    for kind, a, b in (("param", params, params_w), ("buffer", buffers, buffers_w)):
        assert a.keys() == b.keys()
        for n in a:
            assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), (kind, n, a[n], b[n])
    assert osd["param_groups"] == osd_w["param_groups"]
    assert osd["state"].keys() == osd_w["state"].keys(), (osd["state"].keys(), osd_w["state"].keys())
    for i, entry in osd["state"].items():
        assert entry.keys() == osd_w["state"][i].keys(), (i, entry.keys(), osd_w["state"][i].keys())
        for k, v in entry.items():
            w = osd_w["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k, v, w)


def run(make_model, make_opt, batches, bad=(), **watch_options):
    """Trains on `batches` (those at the indices `bad` are dirty, under a skipping watch); returns the
    final state, and the states just before and just after each bad step."""
    torch.manual_seed(0)
    model = make_model()
    opt = make_opt(model.parameters())
    w = nanfast.watch(model, opt, action="skip", **watch_options) if bad else None
    around = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(batches):
            if i in bad:
                around.append(full_state(model, opt))
            train_step(model, opt, x, y)
            if i in bad:
                around.append(full_state(model, opt))
        if w is not None:
            w.flush()
            w.remove()
    if w is not None:
        assert w.skipped_steps == len(bad) and [e.phase for e in w.events] == ["input"] * len(bad), w.events
        assert sum("skipped the optimizer step" in str(c.message) for c in caught) == len(bad)
    return full_state(model, opt), around


def check_skip_is_as_if_never_seen(make_model, make_opt, bad, n_good=4, **watch_options):
    """A run with dirty batches at the indices `bad` (skipped) ends as a run without them, bit for bit;
    each skipped step leaves the state as it found it (a lagged one too, on the device, before its read)."""
    good = iter([batch(s) for s in range(n_good)])
    with_bad = [dirty(99 + i) if i in bad else next(good) for i in range(n_good + len(bad))]
    final, around = run(make_model, make_opt, with_bad, bad, **watch_options)
    for before, after in zip(around[::2], around[1::2]):
        assert_same_state(after, before)
    reference, _ = run(make_model, make_opt, [batch(s) for s in range(n_good)])
    assert_same_state(final, reference)


# ---- module buffers (BatchNorm) ----


def test_skip_restores_the_batchnorm_statistics_the_bad_forward_wrote():
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    check_skip_is_as_if_never_seen(BNNet, sgd, bad=(2,))
    torch.manual_seed(0)
    model = BNNet()
    opt = sgd(model.parameters())
    with nanfast.watch(model, opt, action="skip"), pytest.warns(RuntimeWarning, match="skipped"):
        train_step(model, opt, *batch(0))
        train_step(model, opt, *dirty(1))
    assert torch.isfinite(model.bn.running_mean).all() and torch.isfinite(model.bn.running_var).all()
    assert model.bn.num_batches_tracked.item() == 1
    assert torch.isfinite(model.eval()(batch(2)[0])).all()


@pytest.mark.parametrize("lagged", [False, True])
def test_skip_restores_buffers_of_a_head_swapped_in_after_watch(lagged):
    """Fine-tuning swaps the head for a new one (here with its own BatchNorm, and a buffer registered on
    an old module) after the watch began: a skipped step leaves their statistics as they were too."""
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=lagged)  # lagged: skipped on the device
    registrations = len(torch.nn.modules.module._global_module_registration_hooks)
    with nanfast.watch(model, opt, action="skip", sync="lagged" if lagged else "eager") as w:
        train_step(model, opt, *batch(0))
        model.l2 = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
        model.l1.register_buffer("seen", torch.zeros(3))
        opt.add_param_group({"params": list(model.l2.parameters())})
        train_step(model, opt, *batch(1))
        model.l1.seen.add_(1.0)  # changed in place between steps: the next step copies it
        before = full_state(model, opt)
        with pytest.warns(RuntimeWarning, match="skipped"):
            train_step(model, opt, *dirty(2))
            w.flush()
        assert_same_state(full_state(model, opt), before)
    assert w.skipped_steps == 1
    assert len(torch.nn.modules.module._global_module_registration_hooks) == registrations  # removed with the watch


def test_modules_built_elsewhere_and_re_assigned_buffers_do_not_make_the_buffers_listed_again():
    model = EMANet()  # re-assigns its buffer `ema` at every forward
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action="skip") as w:
        for seed in range(3):
            torch.nn.CrossEntropyLoss(weight=torch.ones(4))  # a loss made at every step registers a buffer
            train_step(model, opt, *batch(seed))
            assert not w._model_changed
        model.bn.register_buffer("extra", torch.zeros(1))
        assert w._model_changed


class _Stop(Exception):
    pass


def _stop(event):
    raise _Stop(event.summary())


@pytest.mark.parametrize("action, raised", [("raise", nanfast.NonFiniteError), (_stop, _Stop)],
                         ids=["raise", "a callable raising"])
def test_caught_raise_leaves_the_model_as_the_step_found_it(action, raised):
    """A callable action raising its own exception stops the step as "raise" does; it left the bad
    forward's BatchNorm statistics in the model (a probe, session 48)."""
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    w = nanfast.watch(model, opt, action=action)
    train_step(model, opt, *batch(0))
    before = full_state(model, opt)
    with pytest.raises(raised):
        train_step(model, opt, *dirty(1))
    assert_same_state(full_state(model, opt), before)
    train_step(model, opt, *batch(1))
    w.remove()

    torch.manual_seed(0)
    reference = BNNet()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    train_step(reference, ref_opt, *batch(0))
    train_step(reference, ref_opt, *batch(1))
    assert_same_state(full_state(model, opt), full_state(reference, ref_opt))


def test_lagged_skip_restores_buffers_on_the_device_without_a_host_read():
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    w = nanfast.watch(model, opt, action="skip", sync="lagged")
    train_step(model, opt, *batch(0))  # the first step creates the optimizer state: read at once
    before = full_state(model, opt)
    with OpRecorder() as ops:
        train_step(model, opt, *dirty(1))
    assert ops.host_syncs == 0
    assert_same_state(full_state(model, opt), before)
    with pytest.warns(RuntimeWarning, match="skipped"):
        train_step(model, opt, *batch(2))
    assert w.skipped_steps == 1
    w.remove()


def test_skip_adds_no_host_read_and_copies_only_the_buffers():
    torch.manual_seed(0)
    model = BNNet()
    model.register_buffer("mask", torch.ones(1000, dtype=torch.bool))  # constant: not copied after step 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with nanfast.watch(model, opt, action="skip") as w:
        syncs = []
        for s in range(3):
            with OpRecorder() as ops:
                train_step(model, opt, *batch(s))
            syncs.append(ops.host_syncs)
        assert syncs == [1, 1, 1]
        bn = model.bn
        # The BatchNorm's statistics and count, and the mask: at most 64 KB, copied whatever its dtype
        assert w._undo.bytes_per_step == (bn.running_mean.numel() + bn.running_var.numel()) * 4 + 8 + 1000
    model.register_buffer("mask", torch.ones(100_000, dtype=torch.bool))
    with nanfast.watch(model, opt, action="skip") as w:
        for s in range(3):
            train_step(model, opt, *batch(s))
        assert w._undo.bytes_per_step == (bn.running_mean.numel() + bn.running_var.numel()) * 4 + 8  # not the mask


class CountsLargeBatches(torch.nn.Module):
    """Changes an integer buffer in place only for batches of more than 6 rows (one too large to be
    copied at every step: a small one is, see the test above)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.register_buffer("large_batches", torch.zeros(10_000, dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        if x.shape[0] > 6:
            self.large_batches += 1
        self.ema = 0.9 * self.ema + 0.1 * x.mean(0)  # re-assigned, not written in place
        return self.lin(x)


def test_a_buffer_first_changed_by_the_bad_step_cannot_be_skipped_and_says_so():
    model = CountsLargeBatches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action="skip") as w:
        train_step(model, opt, *batch(0))
        ema = model.ema.clone()
        x, y = batch(1, n=8)
        x[0, 0] = NAN
        with pytest.raises(nanfast.NonFiniteError, match=r"cannot be skipped: .*\['large_batches'\]"):
            train_step(model, opt, x, y)
        assert torch.equal(model.ema, ema)  # the re-assigned buffer is put back
        opt.zero_grad()
        train_step(model, opt, *batch(2, n=8))  # now seen changing: copied from here on
        count, ema = model.large_batches.clone(), model.ema.clone()
        with pytest.warns(RuntimeWarning, match="skipped"):
            train_step(model, opt, x, y)
        assert torch.equal(model.large_batches, count) and torch.equal(model.ema, ema)
        assert w.skipped_steps == 1

    model = CountsLargeBatches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt):  # action="raise" names it too
        train_step(model, opt, *batch(0))
        with pytest.raises(nanfast.NonFiniteError, match=r"the buffers \['large_batches'\] in place, which could not"):
            train_step(model, opt, x, y)


class EMANet(BNNet):
    """BNNet that also keeps an average of its inputs, re-assigned (not written in place) at every forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        self.ema = 0.9 * self.ema + 0.1 * x.mean(0)
        return super().forward(x)


def test_lagged_skip_selects_re_assigned_buffers_on_the_device():
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)
    check_skip_is_as_if_never_seen(EMANet, adamw, bad=(0, 3), sync="lagged")
    torch.manual_seed(0)
    model = EMANet()
    opt = adamw(model.parameters())
    w = nanfast.watch(model, opt, action="skip", sync="lagged")
    syncs = []
    with pytest.warns(RuntimeWarning, match="step 2: .*skipped"):  # read at step 3
        for s in range(4):
            with OpRecorder() as ops:
                train_step(model, opt, *(dirty(s) if s == 2 else batch(s)))
            syncs.append(ops.host_syncs)
    assert syncs == [1, 0, 0, 0]  # only the first step, which creates the optimizer state, is read at once
    assert w.skipped_steps == 1
    w.remove()


# ---- every torch optimizer, every implementation, first step included ----

_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd-momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "sgd-dampening": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=1e-2)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adam-amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True)),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2)),
    "radam": (torch.optim.RAdam, dict(lr=1e-2)),
    "asgd": (torch.optim.ASGD, dict(lr=1e-2, t0=1)),
    "rprop": (torch.optim.Rprop, dict(lr=1e-2)),
    "adadelta": (torch.optim.Adadelta, dict(lr=1.0)),
    "adafactor": (torch.optim.Adafactor, dict(lr=1e-2)),
}
if hasattr(torch.optim, "Muon"):  # torch >= 2.9; matrices only
    _OPTIMIZERS["muon"] = (lambda ps, **kw: torch.optim.Muon([p for p in ps if p.ndim == 2], **kw), dict(lr=1e-2))
_FUSED = {name for name, (cls, _) in _OPTIMIZERS.items() if "fused" in inspect.signature(cls).parameters}
_ONE_IMPL = {"muon"}  # no foreach/fused switch
_IMPLS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "forloop": dict(foreach=False)}
_CASES = [(name, impl) for name in _OPTIMIZERS for impl in _IMPLS
          if (impl != "fused" or name in _FUSED) and (name not in _ONE_IMPL or impl == "forloop")]


def make_optimizer(name, impl):
    cls, options = _OPTIMIZERS[name]
    return lambda ps: cls(ps, **options, **({} if name in _ONE_IMPL else _IMPLS[impl]))


@pytest.mark.parametrize("name,impl", _CASES, ids=[f"{n}-{i}" for n, i in _CASES])
def test_skip_is_bit_identical_for_every_optimizer_first_step_included(name, impl):
    check_skip_is_as_if_never_seen(LNNet, make_optimizer(name, impl), bad=(0, 3))


# Fused optimizers that take GradScaler's found_inf, so skip on the device (torch 2.11's fused Adagrad
# does not; the watch refuses such an optimizer with sync='lagged': test_invalid_options_are_refused).
_SKIP_ON_DEVICE = sorted(name for name in _FUSED if getattr(
    make_optimizer(name, "fused")([torch.nn.Parameter(torch.zeros(1))]), "_step_supports_amp_scaling", False))


@pytest.mark.parametrize("name", _SKIP_ON_DEVICE)
def test_lagged_skip_on_the_device_is_bit_identical_first_step_included(name):
    check_skip_is_as_if_never_seen(LNNet, make_optimizer(name, "fused"), bad=(0, 3), sync="lagged")


def test_lagged_skip_reads_a_step_that_creates_optimizer_state_at_once():
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    w = nanfast.watch(model, opt, action="skip", sync="lagged")
    with OpRecorder() as ops, pytest.warns(RuntimeWarning, match="skipped"):
        train_step(model, opt, *dirty(0))
    assert ops.host_syncs == 1 and w.skipped_steps == 1 and len(opt.state) == 0
    syncs = []
    for s in range(3):
        with OpRecorder() as ops:
            train_step(model, opt, *batch(s))
        syncs.append(ops.host_syncs)
    assert syncs == [1, 0, 0]  # the first good step creates the state; later steps wait for nothing
    w.remove()


class Experts(torch.nn.Module):
    """Two experts; each batch is routed to one (a mixture of experts, a branch some batches take)."""

    def __init__(self):
        super().__init__()
        self.e0 = torch.nn.Linear(4, 4)
        self.e1 = torch.nn.Linear(4, 4)

    def forward(self, x, route):
        return (self.e1 if route else self.e0)(x)


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_a_skipped_step_gives_no_gradient_to_a_parameter_that_had_none(set_to_none, sync):
    """The bad batch is the only one routed to expert e1. The skip gave e1 a zeroed .grad, which
    zero_grad(set_to_none=False) kept: every later AdamW step then decayed e1 and gave it state, which a
    run without the batch never does (a probe, session 42: an expert, a branch or a head that only the
    bad batch reached). Where zero_grad sets every gradient to None, all are given back zeroed."""
    def train(batches, watched):
        torch.manual_seed(0)
        model = Experts()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=sync == "lagged")
        w = nanfast.watch(model, opt, action="skip", sync=sync) if watched else None
        grads_after = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for x, route in batches:
                opt.zero_grad(set_to_none=set_to_none)
                model(x, route).square().mean().backward()
                opt.step()
                grads_after.append([p.grad is None for p in model.parameters()])
            if w is not None:
                w.flush()
                assert w.skipped_steps == 1
                w.remove()
        return full_state(model, opt), grads_after

    good = [(batch(s)[0][:, :4], False) for s in range(4)]
    dirty_batch = (torch.full((2, 4), NAN), True)
    reference, reference_grads = train(good, watched=False)
    final, grads = train(good[:2] + [dirty_batch] + good[2:], watched=True)
    assert_same_state(final, reference)
    assert grads[:2] + grads[3:] == reference_grads
    # set_to_none: e1's (the bad batch's only) zeroed, as code after the step may read it (the next zero_grad
    # drops it); else e0's zeroed, as zero_grad kept them, and e1's none.
    assert grads[2] == ([True, True, False, False] if set_to_none else [False, False, True, True])


# ---- closure-based optimizers ----


class ClosureLater(torch.optim.SGD):
    """An optimizer outside torch.optim that may call its closure after other work (SAM perturbs first)."""


def test_skip_runs_a_torch_optimizers_closure_first_and_refuses_others():
    model = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="LBFGS runs the forward and backward inside optimizer.step"):
        nanfast.watch(model, torch.optim.LBFGS(model.parameters()), action="skip")
    x, y = batch(0)
    x[0, 0] = float("nan")
    for kind in (torch.optim.SGD, torch.optim.Adafactor, ClosureLater):  # Adafactor's __module__ is "torch.optim"
        opt = kind(model.parameters(), lr=0.1)

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        before = [p.detach().clone() for p in model.parameters()]
        with nanfast.watch(model, opt, action="skip") as w:
            if kind is ClosureLater:
                with pytest.raises(ValueError, match=r"cannot skip optimizer.step\(closure\) of ClosureLater"):
                    opt.step(closure)
                continue
            with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
                loss = opt.step(closure=closure)  # the closure ran ahead of the watch's check: its step is read
            assert torch.isnan(loss) and [e.phase for e in w.events] == ["input"]
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_raise_with_lbfgs_comes_one_step_late_as_documented():
    """The closure runs the forward and backward inside optimizer.step(), after the step's read: a bad
    batch is read at the next step, which raises with the parameters LBFGS already made non-finite."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)

    def closure(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    with nanfast.watch(model, opt) as w:
        opt.step(lambda: closure(*batch(0)))
        opt.step(lambda: closure(*dirty(1)))  # no error yet
        assert not torch.isfinite(model.weight).all()
        with pytest.raises(nanfast.NonFiniteError) as error:
            opt.step(lambda: closure(*batch(2)))
    event = error.value.report
    assert event.step == 2 and event.phase == "param"
    assert any(p.phase == "input" for p in event.later)  # the dirty batch is named among the places


# ---- property: random small models, optimizers and faults ----


class Planted(torch.nn.Module):
    """Identity, or NaN in one element when armed: a fault made in forward by an op."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        if self.armed:
            x = x.clone()
            x[0, 0] = NAN
        return x


class SharedTwice(torch.nn.Module):
    """One Linear called twice per forward: weight sharing."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


_LAYERS = {
    "linear": lambda d: torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()),
    "batchnorm": lambda d: torch.nn.BatchNorm1d(d),
    "batchnorm-no-momentum": lambda d: torch.nn.BatchNorm1d(d, momentum=None),  # cumulative average
    "layernorm": lambda d: torch.nn.LayerNorm(d),
    "dropout-off": lambda d: torch.nn.Dropout(0.0),
    "shared": SharedTwice,
}
_PROPERTY_OPTIMIZERS = ["sgd", "sgd-momentum", "sgd-nesterov", "adam", "adamw", "adagrad", "rmsprop"]


def make_model(layers, d):
    return lambda: torch.nn.Sequential(torch.nn.Linear(8, d), *(_LAYERS[k](d) for k in layers), Planted(),
                                       torch.nn.Linear(d, 4))


def faulty_run(make, make_opt, batches, fault, bad, sync):
    """Trains on batches; at index `bad` (None: no fault) the fault is planted and the step skipped."""
    torch.manual_seed(0)
    model = make()
    opt = make_opt(model.parameters())
    w = nanfast.watch(model, opt, action="skip", sync=sync) if bad is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (x, y) in enumerate(batches):
            if i == bad and fault == "nan-input":
                x = x.clone()
                x[0, 0] = NAN
            model[-2].armed = i == bad and fault == "nan-forward"
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            if i == bad and fault == "inf-grad":
                model[0].weight.grad[0, 0] = INF
            opt.step()
        if w is not None:
            w.flush()
            assert w.skipped_steps == 1, w.events
            w.remove()
    return full_state(model, opt)


@settings(max_examples=max(5, settings().max_examples // 2))
@given(layers=st.lists(st.sampled_from(sorted(_LAYERS)), min_size=1, max_size=3), d=st.sampled_from([4, 6]),
       opt_name=st.sampled_from(_PROPERTY_OPTIMIZERS), impl=st.sampled_from(sorted(_IMPLS)),
       lagged=st.booleans(), fault=st.sampled_from(["nan-input", "nan-forward", "inf-grad"]),
       n_steps=st.integers(2, 4), data=st.data())
def test_property_a_skipped_step_is_as_if_the_batch_never_came(layers, d, opt_name, impl, lagged, fault, n_steps, data):
    if impl == "fused" and opt_name not in _FUSED:
        impl = "foreach"
    sync = "lagged" if lagged and impl == "fused" else "eager"
    bad = data.draw(st.integers(0, n_steps), label="bad step")
    make, make_opt = make_model(layers, d), make_optimizer(opt_name, impl)
    good = [batch(s) for s in range(n_steps)]
    with_bad = good[:bad] + [batch(100)] + good[bad:]
    assert_same_state(faulty_run(make, make_opt, with_bad, fault, bad, sync),
                      faulty_run(make, make_opt, good, fault, None, sync))


# ---- soak: many steps, a fault every few hundred, all four actions ----

# The default soak is short enough for CI on 2 shared cores; NANFAST_SOAK_STEPS=10000 runs the length.
_SOAK_STEPS = int(os.environ.get("NANFAST_SOAK_STEPS", "360"))
_SOAK_EVERY = 90


class Soaked(torch.nn.Module):
    """Tiny BatchNorm model; `side` armed makes NaN in an output the loss does not use (a fault that a
    warn or callable action lets training survive)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.side = Planted()

    def forward(self, x):
        h = self.bn(self.lin(x))
        return h, self.side(h.detach())


def soak(action, faults, watched=True):
    """Trains _SOAK_STEPS steps; at the steps in `faults` the batch is dirty (raise, skip) or the side
    output is (warn, callable), or, unwatched, the batch is left out. Returns the final state, the steps
    reported, and the live objects and tensors at a third of the run and at its end."""
    torch.manual_seed(0)
    model = Soaked()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    seen = []
    # history=0: the timeline keeps records by design, up to its bound (tests/test_watch_history.py)
    w = nanfast.watch(model, opt, action=seen.append if action == "callable" else action, history=0) if watched else None
    g = torch.Generator().manual_seed(1)
    reported, census = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(_SOAK_STEPS):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
            if step in faults:
                if not watched:
                    continue
                if action in ("raise", "skip"):
                    x[step % 8, step % 4] = NAN
                model.side.armed = action in ("warn", "callable")
            opt.zero_grad()
            F.mse_loss(model(x)[0], y).backward()
            try:
                opt.step()
            except nanfast.NonFiniteError as error:
                assert action == "raise"
                del error
            model.side.armed = False
            if w is not None and step + 1 in (_SOAK_STEPS // 3, _SOAK_STEPS):
                reported += [e.step for e in w.events]
                w.events.clear()
                w.last = None
                seen.clear()
                gc.collect()
                objects = gc.get_objects()
                census.append((len(objects), sum(isinstance(o, torch.Tensor) for o in objects)))
                del objects
    if w is not None:
        reported += [e.step for e in w.events]
        w.remove()
    return full_state(model, opt), reported, census


@pytest.mark.parametrize("action", ["raise", "warn", "skip", "callable"])
def test_soak_memory_stays_flat_every_fault_is_reported_and_skip_is_exact(action):
    faults = set(range(_SOAK_EVERY // 2, _SOAK_STEPS, _SOAK_EVERY))
    final, reported, census = soak(action, faults)
    assert reported == sorted(faults)
    (objects_early, tensors_early), (objects_late, tensors_late) = census
    assert tensors_late == tensors_early
    assert objects_late <= objects_early + 5, census  # no growth with steps (a few from lazily filled caches)
    if action in ("raise", "skip"):  # a caught raise before the step undoes it as a skip does
        reference, _, _ = soak(action, faults, watched=False)
        assert_same_state(final, reference)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "sgd-fused"])
def test_skip_under_a_gradscaler_restores_buffers_too(fused):
    """With a GradScaler the NaN gradients of a dirty batch also make the scaler skip (for a non-fused
    optimizer it never calls optimizer.step()): the watch's skip must still put the buffers back."""

    def run(batches, watched):
        torch.manual_seed(0)
        model = BNNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        w = nanfast.watch(model, opt, action="skip", scaler=scaler) if watched else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for x, y in batches:
                opt.zero_grad()
                scaler.scale(F.mse_loss(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
        if w is not None:
            assert w.skipped_steps == 1 and w.last.phase == "input"
            w.remove()
        return full_state(model, opt), scaler.get_scale()

    good = [batch(s) for s in range(3)]
    (state, scale), (reference, _) = run(good[:1] + [dirty(9)] + good[1:], True), run(good, False)
    assert scale == 0.5  # the scaler halved its scale for the NaN gradients: not undone (documented)
    assert_same_state(state, reference)  # scales are powers of two: unscaled gradients are the same


class ExpandedBuffer(torch.nn.Module):
    """A buffer made by expand(): its rows share memory, so nothing can write it in place."""

    def __init__(self, dtype):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.register_buffer("pos", torch.zeros(1, 8, dtype=dtype).expand(4, 8))

    def forward(self, x):
        return self.lin(x + self.pos[: x.shape[0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_a_skip_with_an_expanded_buffer_skips(dtype):
    """Copying the snapshot back into it raised out of optimizer.step() ("more than one element of the
    written-to tensor refers to a single memory location"): a probe, session 51."""
    torch.manual_seed(0)
    model = ExpandedBuffer(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="skipped"):
        with nanfast.watch(model, opt, action="skip") as w:
            for i in range(3):
                opt.zero_grad()
                (model(torch.randn(4, 8)).pow(2).mean() * (float("nan") if i == 1 else 1.0)).backward()
                opt.step()
    assert w.skipped_steps == 1
