"""nanfast.watch's step state (nanfast issue 13, "Nothing lost, nothing falsely clean"): a forward that
raised is forgotten, eval forwards inside a step, a loop that never calls w.step(), sparse gradients,
a non-finite loss value with finite gradients, a GradScaler shared by two watches, and one whose step
the watch raised in."""

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import nanfast
from nanfast.watcher import forwards
from op_recorder import OpRecorder
from test_watch import MLP, Magnitude, batch

NAN, INF = float("nan"), float("inf")


def count_syncs(fn):
    with OpRecorder() as counter:
        fn()
    return counter.host_syncs


class Flaky(torch.nn.Module):
    """Raises after its first layer ran when `fail` is set: an OOM in a later layer, say."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)
        self.fail = False

    def forward(self, x):
        h = self.l1(x)
        if self.fail:
            raise RuntimeError("CUDA out of memory (simulated)")
        return self.l2(h)


def test_a_forward_that_raised_is_forgotten_with_its_activations():
    torch.manual_seed(0)
    model = Flaky()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt)
    outputs = []
    model.l1.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    x, y = batch()
    dirty = x.clone()
    dirty[0, 0] = NAN  # l1 records NaN (input and output), then the forward raises
    model.fail = True
    with pytest.raises(RuntimeError, match="out of memory"):
        F.mse_loss(model(dirty), y).backward()
    model.fail = False
    gc.collect()
    assert outputs and outputs[0]() is None  # the failed forward's activations are not kept
    # The next, clean step is clean, with its one read; it is the first microbatch again.
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    assert count_syncs(opt.step) == 1
    assert w.events == [] and w.step_count == 1
    # Faults after it are still reported, in the right place.
    opt.zero_grad()
    F.mse_loss(model(dirty), y).backward()
    with pytest.raises(nanfast.NonFiniteError):
        opt.step()
    assert (w.last.step, w.last.phase, w.last.first.microbatch) == (1, "input", 0)
    w.remove()


def test_a_microbatch_that_raised_leaves_the_earlier_ones_of_its_step():
    model = Flaky()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt, action="warn")
    x, y = batch()
    x[1, 2] = INF
    F.mse_loss(model(x), y).backward()  # microbatch 0, dirty: kept
    bad = batch(seed=1)[0]
    bad[0, 0] = NAN
    model.fail = True
    with pytest.raises(RuntimeError):
        model(bad)  # a dirty batch, then the forward raises: dropped
    model.fail = False
    F.mse_loss(model(batch(seed=2)[0]), y).backward()
    with pytest.warns(RuntimeWarning, match="input batch is dirty"):
        opt.step()
    assert (w.last.phase, w.last.posinf, w.last.first.microbatch) == ("input", 1, 0)
    assert {p.microbatch for p in w.last.places if p.phase not in ("param", "grad")} == {0}
    w.remove()


class Boom(torch.autograd.Function):
    """The identity, whose backward raises while `failing` is set: an out-of-memory error in backward."""

    failing = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if Boom.failing:
            raise RuntimeError("CUDA out of memory in backward (simulated)")
        return grad


class FlakyBackward(Flaky):
    def forward(self, x):
        return self.l2(Boom.apply(self.l1(x)))


def test_a_microbatch_whose_backward_raised_is_forgotten():
    torch.manual_seed(0)
    model = FlakyBackward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt)
    x, y = batch()
    F.mse_loss(model(x), y).backward()  # microbatch 0: kept
    dirty = x.clone()
    dirty[0, 0] = NAN
    Boom.failing = True
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            F.mse_loss(model(dirty), y).backward()  # l2's gradient check fired, then Boom raised
    finally:
        Boom.failing = False
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    assert count_syncs(opt.step) == 1
    assert w.events == [] and w.step_count == 1
    # Stepping right after the failed backward drops it too: what is left to report is the NaN its
    # partial backward put into l2's gradients, which this step would apply.
    F.mse_loss(model(x), y).backward()
    Boom.failing = True
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            F.mse_loss(model(dirty), y).backward()
    finally:
        Boom.failing = False
    with pytest.raises(nanfast.NonFiniteError):
        opt.step()
    assert (w.last.phase, w.last.name, w.step_count) == ("grad", "l2.weight", 2)
    assert all(p.microbatch == 0 for p in w.last.places)
    opt.zero_grad()
    # The next dirty batch is reported, as microbatch 0.
    F.mse_loss(model(dirty), y).backward()
    with pytest.raises(nanfast.NonFiniteError):
        opt.step()
    assert (w.last.step, w.last.phase, w.last.first.microbatch) == (2, "input", 0)
    w.remove()


def test_gradient_checks_of_a_forward_that_raised_stay_inert():
    model = Flaky()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt)
    kept, failing = [], [True]

    def after_l2(module, args, out):
        if failing[0]:
            raise RuntimeError("late failure")

    model.l1.register_forward_hook(lambda m, a, out: kept.append(out))
    model.l2.register_forward_hook(after_l2)
    x, y = batch()
    with pytest.raises(RuntimeError, match="late failure"):
        model(x)  # l2 hooked the gradient of its input, kept[0], then the forward raised
    failing[0] = False
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    # A backward through what the failed forward left, with a NaN gradient, records nothing.
    torch.autograd.grad((kept[0] * NAN).sum(), model.l1.bias)
    opt.step()
    assert w.events == []
    w.remove()


def test_a_backward_after_its_step_ended_is_left_to_the_parameters_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), Magnitude(), torch.nn.Linear(1, 4))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()  # the magnitude of 0: its gradient is 0/0
    w = nanfast.watch(model)
    x, y = batch()
    out = model(x)
    w.step()  # too early: the backward below comes after the step it belongs to ended
    F.mse_loss(out, y).backward()
    with pytest.raises(nanfast.NonFiniteError):
        w.step()
    assert (w.last.step, w.last.phase, w.last.name) == (1, "grad", "0.weight")
    w.remove()


@pytest.mark.parametrize("eval_at", ["before_backward", "before_step"])
def test_an_eval_forward_inside_a_step_without_optimizer(eval_at):
    torch.manual_seed(0)
    model = MLP()
    w = nanfast.watch(model)
    x_eval = batch(seed=7)[0]

    def step(x, y):
        out = model(x)
        if eval_at == "before_backward":
            with torch.no_grad():
                model(x_eval)
        F.mse_loss(out, y).backward()
        if eval_at == "before_step":
            with torch.no_grad():
                model(x_eval)
        w.step()
        model.zero_grad()

    for s in range(3):
        step(*batch(seed=s))
    assert w.events == [] and w.step_count == 3
    x, y = batch()
    x[2] = 1e4
    with torch.no_grad():
        model.l1.weight[0] = 1e35  # finite; l1's output overflows for the training batch only
    with pytest.raises(nanfast.NonFiniteError):
        step(x, y)
    assert (w.last.step, w.last.phase, w.last.name, w.last.first.microbatch) == (3, "forward", "l1", 0)
    # The eval forward is the second forward of the step: its places (none here) would say microbatch 1.
    assert all(p.microbatch == 0 for p in w.last.places)
    w.remove()


def test_inference_alone_is_still_a_step_per_forward():
    model = MLP()
    w = nanfast.watch(model)
    with torch.no_grad():
        for _ in range(3):
            model(batch()[0])
    assert w.step_count == 3
    w.remove()


def test_a_loop_that_never_calls_step_warns_once_and_keeps_no_more_than_a_step():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # not given to the watch
    w = nanfast.watch(model)
    _, y = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(40):
            opt.zero_grad()
            F.mse_loss(model(batch(seed=s)[0]), y).backward()
            opt.step()
            if s == 1:
                per_step = len(w._step.slots)
    assert len(w._step.slots) <= per_step
    assert len(w._recorder.take()[2]) <= per_step  # the records of one step, not of 40
    unclosed = [c for c in caught if "w.step()" in str(c.message)]
    assert len(unclosed) == 1 and unclosed[0].category is UserWarning
    assert unclosed[0].filename == __file__  # the loop's line, not torch's module call
    assert "optimizer" in str(unclosed[0].message)
    w.remove()


def test_gradient_accumulation_without_optimizer_does_not_warn():
    model = MLP()
    w = nanfast.watch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            for k in range(4):
                F.mse_loss(model(batch(seed=k)[0]), batch(seed=k)[1]).backward()
            w.step()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 1e-3 * p.grad
            model.zero_grad()
    assert w.events == [] and w.step_count == 3
    w.remove()


def test_forwards_without_a_step_are_bounded_even_when_parameters_never_change(monkeypatch):
    monkeypatch.setattr(forwards, "MAX_FORWARDS_PER_STEP", 8)
    model = MLP()
    w = nanfast.watch(model)
    x, y = batch()
    with pytest.warns(UserWarning, match="w.step()"):
        for _ in range(20):
            F.mse_loss(model(x), y).backward()
    assert w._step.forwards <= 8
    w.remove()
    # Forwards under no_grad (a long validation loop between two optimizer steps) do not count.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            for _ in range(20):
                model(x)
        F.mse_loss(model(x), y).backward()
        opt.step()
    assert w.step_count == 1
    w.remove()


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, idx):
        return self.fc(self.emb(idx)).squeeze(-1)


@pytest.mark.parametrize("make_optimizer", [
    lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
    lambda model: torch.optim.SparseAdam(model.emb.parameters(), lr=0.1),
], ids=["sgd", "sparse-adam"])
def test_sparse_embedding_gradients_are_checked(make_optimizer):
    torch.manual_seed(0)
    model = Bag()
    opt = make_optimizer(model)
    w = nanfast.watch(model, opt)
    idx = torch.tensor([[1, 2, 2], [3, 1, 9]])  # duplicate rows: an uncoalesced gradient

    def backward():
        opt.zero_grad()
        F.mse_loss(model(idx), torch.ones(2, 3)).backward()

    backward()
    assert model.emb.weight.grad.is_sparse
    assert count_syncs(opt.step) == 1
    assert w.events == []
    assert w.stats()["grad_norm"] > 0
    backward()
    model.emb.weight.grad._values()[4, 1] = NAN
    with pytest.raises(nanfast.NonFiniteError, match="emb.weight"):
        opt.step()
    assert (w.last.phase, w.last.name, w.last.nan) == ("grad", "emb.weight", 1)
    w.remove()


class Picker(torch.nn.Module):
    """Gathers with sparse_grad=True: the gradient flowing out of it (w.r.t. its input) is sparse."""

    def forward(self, h):
        return torch.gather(h, 1, torch.tensor([[0, 3], [1, 1]]), sparse_grad=True)


class Picking(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(2, 16))
        self.pick = Picker()
        self.head = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.head(self.pick(self.scale * x))  # Linear's backward takes no sparse gradient


def test_a_sparse_gradient_flowing_out_of_a_module_is_checked():
    model = Picking()
    with torch.no_grad():
        model.head.weight[0, 0] = INF  # the head's input gradient is infinite; the head is ignored
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, ignore="head*", loss=False) as w, pytest.raises(nanfast.NonFiniteError):
        opt.zero_grad()
        model(batch(n=2, d=16)[0]).sum().backward()
        opt.step()
    assert (w.last.phase, w.last.name) == ("backward", "pick")


def test_a_non_finite_loss_with_finite_gradients_is_reported():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt)
    x, _ = batch()

    def step(targets):
        opt.zero_grad()
        loss = w.loss(F.cross_entropy(model(x), targets, ignore_index=-100))
        loss.backward()
        return loss

    assert count_syncs(lambda: (step(torch.arange(5) % 4), opt.step())) == 1
    loss = step(torch.full((5,), -100))  # every target ignored: 0/0
    assert loss.isnan() and all(torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(nanfast.NonFiniteError, match="value of 'loss' passed to Watch.loss"):
        opt.step()
    assert (w.last.phase, w.last.name, w.last.nan, w.last.later) == ("loss_value", "loss", 1, ())
    assert w.loss(loss, name="aux") is loss
    w.remove()


def test_a_loss_passed_after_its_optimizer_step_is_read_alone_not_with_the_next_step():
    """`optimizer.step(); w.loss(loss)` (the tutorials' logging order) counted a batch's loss into the
    next step: an all-ignored batch's NaN loss skipped the next, healthy update (or stopped it), its
    step blamed, and the timeline's losses were one step off (a probe, session 48). A loss passed before
    any forward of its step is read at once, alone, as the step it came after, and said so once."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt, action="skip")
    x, _ = batch()

    def step(targets):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), targets, ignore_index=-100)
        loss.backward()
        opt.step()
        return w.loss(loss)

    with pytest.warns(UserWarning, match="called before any forward of the model in its step"):
        step(torch.arange(5) % 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # said once
        step(torch.arange(5) % 4)
    with pytest.warns(RuntimeWarning, match=r"step 2 .*after optimizer.step\(\)"):
        step(torch.full((5,), -100))  # every target ignored: a NaN loss, zero gradients
    assert (w.last.phase, w.last.step, w.last.late_loss, w.last.evaluation) == ("loss_value", 2, True, False)
    before = [p.detach().clone() for p in model.parameters()]
    step(torch.arange(5) % 4)  # healthy: applied
    assert w.skipped_steps == 0 and w.last.step == 2
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    w.remove()


def test_late_losses_stay_told_apart_after_a_validation_through_a_submodule():
    """A validation through a submodule (Lightning's self.net(x)) between the step and its late loss made
    that loss count into the next step, which then counted as given one, and every later late loss went
    into the step after it: a NaN at step 4 skipped the healthy step 5 (a probe, session 48)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = nanfast.watch(net, opt, action="skip")
        for step in range(7):
            opt.zero_grad()
            loss = F.mse_loss(net(torch.randn(8, 4)), torch.randn(8, 2))
            loss.backward()
            opt.step()
            if step == 2:  # a validation through a submodule
                net.eval()
                with torch.no_grad():
                    net[0](torch.randn(8, 4))
                net.train()
            w.loss(loss.detach() + (float("nan") if step == 4 else 0.0))
        w.remove()
    assert [(e.step, e.late_loss, e.phase) for e in w.events] == [(4, True, "loss_value")] and w.skipped_steps == 0


@pytest.mark.parametrize("action", ["skip", "raise"])
def test_a_late_loss_puts_back_no_buffers_of_the_step_already_applied(action):
    """Read as a bad step's before its optimizer step, a late NaN loss put back the BatchNorm statistics
    of its step, whose update had been applied (a review, session 48)."""
    def train(watched):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        w = nanfast.watch(model, opt, action=action) if watched else None
        x, _ = batch()
        for targets in (torch.arange(5) % 4, torch.full((5,), -100), torch.arange(5) % 4):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), targets, ignore_index=-100)
            loss.backward()
            opt.step()
            if w is not None:
                try:
                    w.loss(loss)
                except nanfast.NonFiniteError:
                    pass
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watched = train(True)
    for (name, buffer), want in zip(watched.named_buffers(), train(False).buffers()):
        assert torch.equal(buffer, want), name


def test_two_watches_sharing_a_scaler_restore_it_in_any_order():
    def make():
        model = MLP()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    (m1, o1), (m2, o2) = make(), make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    w1 = nanfast.watch(m1, o1, scaler=scaler)
    w2 = nanfast.watch(m2, o2, scaler=scaler)
    w1.remove()
    # w2 still sees the steps the scaler skips (it overflows at this scale).
    o2.zero_grad()
    scaler.scale(F.mse_loss(m2(batch()[0]), batch()[1] * 1e3)).backward()
    scaler.step(o2)
    assert (w2.scaler_skipped_steps, w2.step_count) == (1, 1)
    w2.remove()
    assert "step" not in vars(scaler) and scaler.step.__func__ is torch.amp.GradScaler.step


class SideOutput(torch.nn.Module):
    """An MLP that also returns a side output, left out of the loss: NaN there leaves the gradients finite."""

    def __init__(self):
        super().__init__()
        self.main = MLP()
        self.side = torch.nn.Linear(8, 2)

    def forward(self, x, bad_side=False):
        side = self.side(x)
        return self.main(x), side * NAN if bad_side else side


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("fault", ["off_the_loss", "in_the_loss"])
def test_a_caught_error_inside_gradscaler_step_leaves_the_scaler_ready(fault, fused):
    """The watch raised inside GradScaler.step and scaler.update() never ran. When the scaler had called
    optimizer.step() (the NaN off the loss, gradients finite), its next step() took the gradients for
    unscaled already and applied them multiplied by the scale; when it had skipped the step (the NaN in
    the loss), its next step() raised "step() has already been called since the last update()". A fused
    optimizer kept the scale GradScaler handed it as an attribute, and the next step multiplied its own by
    it: an update 1024x too small (a probe, session 47)."""
    def run(watched):
        torch.manual_seed(0)
        model = SideOutput()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        w = nanfast.watch(model, opt, scaler=scaler) if watched else None
        for seed in range(3):
            if seed == 1 and not watched:
                continue  # the reference never sees the bad batch
            x, y = batch(seed=seed)
            if seed == 1 and fault == "in_the_loss":
                x[0, 0] = NAN
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, _ = model(x, bad_side=seed == 1 and fault == "off_the_loss")
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            try:
                scaler.step(opt)
                scaler.update()
            except nanfast.NonFiniteError:
                assert watched and seed == 1
        if w is not None:
            assert w.step_count == 3 and len(w.events) == 1
            w.remove()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        return model, scaler.get_scale()

    (model, scale), (reference, reference_scale) = run(watched=True), run(watched=False)
    assert scale == reference_scale == 2.0 ** 10
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_late_loss_raising_between_scaler_step_and_update_leaves_the_scaler_ready():
    """`scaler.step(opt); w.loss(loss); scaler.update()`: a late NaN loss raised from w.loss with the
    scaler's iteration stepped and never updated, and a loop that caught it failed at every later
    scaler.step() ("step() has already been called since the last update()": a probe, session 48)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    w = nanfast.watch(model, opt, scaler=scaler)
    caught = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the late loss's warning
        for i in range(4):
            opt.zero_grad()
            y = torch.full((16,), -100) if i == 1 else torch.randint(0, 4, (16,))  # all ignored: a NaN loss
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(torch.randn(16, 8)).float(), y, ignore_index=-100)
            scaler.scale(loss).backward()
            try:
                scaler.step(opt)
                w.loss(loss)
                scaler.update()
            except nanfast.NonFiniteError as error:
                caught += 1
                assert error.report.late_loss and error.report.step == i
    assert caught == 1 and w.step_count == 4 and scaler.get_scale() == 2.0 ** 10
    w.remove()


def test_the_locate_rerun_opens_no_step():
    model = MLP()
    x, y = batch()
    x[0, 0] = NAN

    def rerun():
        F.mse_loss(model(x), y).backward()

    w = nanfast.watch(model, action="warn", on_event="locate", rerun=rerun)
    rerun()
    with pytest.warns(RuntimeWarning, match="input batch is dirty"):
        w.step()
    assert w.last.located is not None and w.step_count == 1
    with torch.no_grad():
        model(batch()[0])  # inference: a step of its own, as the re-run was no training forward
    assert w.step_count == 2
    w.remove()


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_an_evaluation_forward_between_optimizer_steps_is_its_own_event(sync):
    """A validation pass between optimizer steps (see NOTE: [Evaluation forwards between optimizer
    steps]): a NaN there is that forward's event, read when it returns; the training steps around it are
    neither skipped nor recorded differently: one timeline record per training step, w.stats() the last
    training step's, the step numbers the optimizer's."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)  # lagged skip: skipped on the device
    reference = [p.detach().clone() for p in model.parameters()]
    plain = MLP()
    plain.load_state_dict(model.state_dict())
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, fused=True)
    with nanfast.watch(model, opt, action="skip", sync=sync) as w:
        for s in range(3):
            for m, o in ((model, opt), (plain, plain_opt)):
                o.zero_grad()
                F.mse_loss(m(batch(seed=s)[0]), batch(seed=s)[1]).backward()
                o.step()
            x_val = batch(seed=10 + s)[0]
            if s == 1:
                x_val[0, 0] = float("nan")
            with pytest.warns(RuntimeWarning, match="an evaluation forward") if s == 1 else warnings.catch_warnings():
                with torch.no_grad():
                    model.eval()
                    model(x_val)
                    model.train()
        stats = w.stats()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))  # no step skipped
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), reference))
    [event] = w.events
    assert (event.step, event.phase, event.evaluation, w.skipped_steps, w.step_count) == (2, "input", True, 0, 3)
    assert [r.step for r in w.history] == [0, 1, 2] and stats["step"] == 2.0 and stats["grad_norm"] > 0


def test_an_evaluation_forward_raises_there_in_a_raising_watch():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt) as w:
        opt.zero_grad()
        F.mse_loss(model(batch()[0]), batch()[1]).backward()
        opt.step()
        x_val = batch(seed=3)[0] * float("inf")
        with pytest.raises(nanfast.NonFiniteError, match=r"step 1 \(an evaluation: a forward in eval mode without gradients\)"):
            with torch.inference_mode():
                model.eval()
                model(x_val)
        model.train()
        opt.zero_grad()
        F.mse_loss(model(batch()[0]), batch()[1]).backward()
        opt.step()  # the next training step is healthy: no raise
    assert [(e.step, e.evaluation) for e in w.events] == [(1, True)] and w.step_count == 2


class Wrapped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("action", ["skip", "raise"])
def test_an_evaluation_through_a_submodule_is_its_own_event(action):
    """A validation pass through model.net(x) (eval mode, no gradients) between optimizer steps: the
    model's own forward never ran, so its records went into the next step, which a dirty batch then
    skipped (or stopped at its optimizer step), without a word (a probe, session 41). They are read as
    an evaluation's when the next training forward begins (NOTE: [Submodules called outside the model's
    forward]): a raise watch raises there, naming the evaluation, and the training step goes on healthy."""
    torch.manual_seed(0)
    model, plain = Wrapped(), Wrapped()
    plain.load_state_dict(model.state_dict())
    opt, plain_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain))
    raised = []
    with nanfast.watch(model, opt, action=action) as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a skip watch's: an evaluation has no step to skip
        for s in range(3):
            for m, o in ((model, opt), (plain, plain_opt)):
                o.zero_grad()
                try:
                    out = m(batch(seed=s)[0][:, :4])
                except nanfast.NonFiniteError as e:
                    raised.append((s, e.report.evaluation))
                    out = m(batch(seed=s)[0][:, :4])
                F.mse_loss(out, batch(seed=s)[1][:, :1]).backward()
                o.step()
            if s == 1:
                model.eval()
                with torch.no_grad():
                    model.net(torch.full((2, 4), NAN))
                model.train()
    assert [(e.step, e.phase, e.name, e.evaluation) for e in w.events] == [(2, "forward", "net.0", True)]
    assert w.skipped_steps == 0 and w.step_count == 3
    assert raised == ([(2, True)] if action == "raise" else [])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_a_forward_without_gradients_in_train_mode_stays_in_the_step():
    """A GAN's generator run under no_grad for its discriminator's step, PPO's old log-probabilities: in
    train mode, before the training forward, part of the step as before: no read of its own, and a NaN
    there is the step's (skipped by a skip watch)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def without_gradients(x):
        with torch.no_grad():
            model(x)

    with nanfast.watch(model, opt, action="skip") as w:
        assert count_syncs(lambda: without_gradients(batch(seed=4)[0])) == 0
        without_gradients(batch(seed=5)[0] * NAN)
        opt.zero_grad()
        F.mse_loss(model(batch()[0]), batch()[1]).backward()
        with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
            opt.step()
    assert [(e.step, e.phase, e.first.microbatch, e.evaluation) for e in w.events] == [(0, "input", 1, False)]
    assert w.skipped_steps == 1


def test_a_validation_loss_given_to_watch_loss_is_an_evaluations():
    """w.loss(val_loss) in a validation loop (no gradients, eval mode, between optimizer steps): a NaN
    validation loss (a mean over no elements) is that evaluation's event, and its value stays out of the
    next training step's record and spike alarms."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action="skip") as w:
        for s in range(3):
            opt.zero_grad()
            w.loss(F.mse_loss(model(batch(seed=s)[0]), batch(seed=s)[1])).backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                out = model(batch(seed=9)[0])
                if s == 1:
                    with pytest.warns(RuntimeWarning, match="an evaluation forward"):
                        w.loss(F.mse_loss(out[:0], batch(seed=9)[1][:0]))  # NaN: a mean over nothing
                else:
                    w.loss(F.mse_loss(out, batch(seed=9)[1]) * 1e6)  # finite, far from the training loss
            model.train()
    [event] = w.events
    assert (event.step, event.phase, event.evaluation, w.skipped_steps) == (2, "loss_value", True, 0)
    assert [r.step for r in w.history] == [0, 1, 2] and all(r.loss < 1e3 for r in w.history)


@pytest.mark.parametrize("checked", [True, False])
def test_a_validation_loss_with_nothing_to_check_makes_no_read_of_its_own(checked):
    """With loss=False (or the loss ignored) w.loss(val_loss) records nothing: the evaluation has had its
    read when its forward returned, and gets no second, empty one; its value stays out of the next step."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    with nanfast.watch(model, opt, loss=checked) as w:
        opt.zero_grad()
        w.loss(F.mse_loss(model(x), y)).backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            with OpRecorder() as forward:
                out = model(x)
            with OpRecorder() as loss:
                w.loss(F.mse_loss(out, y) * 1e6)
        model.train()
        opt.zero_grad()
        w.loss(F.mse_loss(model(x), y)).backward()
        opt.step()
    assert forward.host_syncs == 1 and loss.host_syncs == (1 if checked else 0)
    assert [r.step for r in w.history] == [0, 1] and all(r.loss < 1e3 for r in w.history)


def test_an_optimizer_made_after_watch_is_named_once_and_a_perturbed_forward_is_not():
    """A loop that rebuilt its optimizer after watch() (a common step after unfreezing layers) stepped one
    the watch did not hook: no step ended, a NaN batch later went unreported and made the parameters NaN,
    and nothing was said for 1024 forwards. SAM-style steps (perturb the weights, forward again, restore,
    step), with gradient accumulation too, change them between forwards, and their steps end: they
    warned from two microbatches a step (a probe, session 44)."""
    torch.manual_seed(0)
    model = MLP()
    watched = torch.optim.SGD(model.parameters(), lr=1e-3)
    w = nanfast.watch(model, watched)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(4):  # SAM: ascend, forward and backward again at the perturbed weights, restore, step
            watched.zero_grad()
            for k in range(1 + s % 3):  # microbatches
                F.mse_loss(model(batch(seed=s)[0]), batch(seed=s)[1]).backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p += 1e-2 * p.grad
                F.mse_loss(model(batch(seed=s)[0]), batch(seed=s)[1]).backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 1e-2 * p.grad
            watched.step()
        rebuilt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for s in range(forwards.UNSEEN_AFTER + 2):
            rebuilt.zero_grad()
            F.mse_loss(model(batch(seed=s)[0]), batch(seed=s)[1]).backward()
            rebuilt.step()
    unseen = [c for c in caught if "without optimizer.step() of the optimizer given to watch()" in str(c.message)]
    assert [c for c in caught if c not in unseen] == [] and len(unseen) == 1, [str(c.message) for c in caught]
    assert unseen[0].category is UserWarning and unseen[0].filename == __file__  # the loop's line
    assert "nanfast.watch(model, new_optimizer)" in str(unseen[0].message) and w.step_count == 4
    w.remove()


@pytest.mark.parametrize("sync", ["eager", "lagged"])
@pytest.mark.parametrize("dirty", ["evaluation", "microbatch 0", "microbatch 1"])
def test_an_evaluation_inside_a_step_is_read_alone_and_the_step_goes_on(sync, dirty):
    """Validation between the two microbatches of one optimizer step (Lightning's val_check_interval inside
    an accumulation window; NOTE: [An evaluation inside a training step]). A dirty validation batch was
    read with the step, as its "microbatch 2": the healthy step was skipped. Now it is its own event and
    the step is applied as without the watch; a dirty training microbatch before or after it still makes
    the step bad, named by its own microbatch number."""
    torch.manual_seed(0)
    model, plain = MLP(), MLP()
    plain.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, fused=True)

    def microbatch(m, k, s):
        x, y = batch(seed=10 * s + k)
        if dirty == f"microbatch {k}" and s == 1 and m is model:
            x[0, 0] = float("nan")
        F.mse_loss(m(x), y).backward()

    with warnings.catch_warnings(record=True) as caught, nanfast.watch(model, opt, action="skip", sync=sync) as w:
        warnings.simplefilter("always")
        for s in range(3):
            for m, o in ((model, opt), (plain, plain_opt)):
                o.zero_grad()
                microbatch(m, 0, s)
                if m is model:
                    x_val = batch(seed=100 + s)[0]
                    if dirty == "evaluation" and s == 1:
                        x_val[0, 0] = float("nan")
                    model.eval()
                    with torch.no_grad():
                        w.loss(F.mse_loss(model(x_val), batch(seed=100 + s)[1]))
                    model.train()
                microbatch(m, 1, s)
                o.step()
            if dirty != "evaluation" and s == 1:
                plain.load_state_dict(model.state_dict())  # the reference: as the skipped step left it
        w.flush()
    event = w.events[0]
    if dirty == "evaluation":  # the forward's read, then its loss's
        assert [(e.step, e.phase, e.evaluation) for e in w.events] == [(1, "input", True), (1, "loss_value", True)]
        assert event.first.microbatch == 0 and w.skipped_steps == 0
        assert any("an evaluation forward, so no optimizer step to skip" in str(c.message) for c in caught)
    else:
        assert len(w.events) == 1 and (event.step, event.evaluation, event.first.microbatch) == (1, False, int(dirty[-1]))
        assert w.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_submodules_run_without_the_models_forward_are_named_once():
    """A loop (a Lightning training_step calling self.net(x)) that runs the watched model's submodules but
    never its forward: faults are still found and skipped, but calls were numbered on across steps ("call
    4" at step 3) and the batch went unchecked as the model's input, without a word."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):
            opt.zero_grad()
            x, y = batch(seed=s)
            F.mse_loss(model.l2(model.act(model.l1(x))), y).backward()  # the submodules, not model(x)
            opt.step()
        for s in range(2):  # through the model's forward: nothing more is said
            opt.zero_grad()
            F.mse_loss(model(batch(seed=s)[0]), batch(seed=s)[1]).backward()
            opt.step()
    outside = [c for c in caught if "ran but its own forward did not" in str(c.message)]
    assert len(outside) == 1 and len(caught) == 1 and "step 0: submodules of the watched MLP" in str(outside[0].message)
    assert outside[0].filename == __file__ and w.events == []
    w.remove()


@pytest.mark.parametrize("evaluation", [False, True])
def test_submodule_calls_outside_the_forward_are_numbered_from_one_each_step(evaluation):
    """Calls outside the model's forward kept counting from the last forward's: a dirty batch through the
    submodules at step 2 was named "call 3" (training) or "call 2" (an evaluation after a training step),
    though each module ran once (a probe, session 41)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt, action="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the outside-forward warning, the skip's
        for s in range(3):
            opt.zero_grad()
            x, y = batch(seed=s)
            if s == 2 and evaluation:
                model.eval()
                with torch.no_grad():
                    model.l2(model.act(model.l1(x * NAN)))
                model.train()
            F.mse_loss(model.l2(model.act(model.l1(x * (NAN if s == 2 and not evaluation else 1.0)))), y).backward()
            opt.step()
    [event] = w.events
    assert (event.first.name, event.first.call, event.evaluation) == ("l1", 1, evaluation)
    w.remove()


def test_a_validation_pass_without_no_grad_is_named_as_such():
    """A validation loop in eval mode that forgot torch.no_grad() is, for the watch, training (fine-tuning
    in eval mode trains so): its dirty batch makes the next step bad. The event said nothing of it."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt, action="skip")  # the parameters stay finite: each event is its step's input
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for s in range(2):
            model.train()
            opt.zero_grad()
            x, y = batch(seed=s)
            if s == 1:  # a dirty training batch in train mode: no hint
                x[0, 0] = float("nan")
            F.mse_loss(model(x), y).backward()
            opt.step()
        model.eval()
        x_val = batch(seed=9)[0]
        x_val[0, 0] = float("nan")
        model(x_val)  # validation without no_grad
        model.train()
        opt.zero_grad()
        F.mse_loss(model(batch(seed=3)[0]), batch(seed=3)[1]).backward()
        opt.step()
    assert [(e.step, e.evaluation, e.eval_mode_with_grad) for e in w.events] == [(1, False, False), (2, False, True)]
    assert "run it under torch.no_grad()" in w.events[1].summary()
    assert "no_grad" not in w.events[0].summary()
    w.remove()


def test_the_watchs_warnings_point_at_the_loops_line():
    """They pointed at nanfast/watcher/actions.py (or step_end.py), so a filter by module or line could
    not select them, and the line shown was not the user's."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt, action="skip")
    x, y = batch()
    x[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    [skipped] = [c for c in caught if "skipped the optimizer step" in str(c.message)]
    assert skipped.filename == __file__ and skipped.category is RuntimeWarning
    w.remove()


def test_a_batch_the_loop_abandons_ends_its_step_with_w_step():
    """A loop's own NaN-loss guard (`continue` before backward and step) left the abandoned forward in the
    step, and the skip at the next, healthy batch's optimizer.step() dropped that batch too (a probe,
    session 44). w.step() in the guard ends the abandoned step: the run is as if the batch never came."""
    def run(batches, watch):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with (nanfast.watch(model, opt, action="skip") if watch else warnings.catch_warnings()) as w:
            warnings.simplefilter("ignore", RuntimeWarning)
            for x, y in batches:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                if not torch.isfinite(loss):
                    w.step()
                    continue
                loss.backward()
                opt.step()
            events = [(e.step, e.first.phase) for e in w.events] if watch else None
        return model.state_dict(), opt.state_dict()["state"], events

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(5)]
    batches[2][0][0, 0] = float("nan")
    model, state, events = run(batches, watch=True)
    ref_model, ref_state, _ = run(batches[:2] + batches[3:], watch=False)
    assert events == [(2, "input")]
    assert all(torch.equal(model[k], ref_model[k]) for k in ref_model)
    assert all(torch.equal(state[i][k], ref_state[i][k]) for i in ref_state for k in ref_state[i])


def test_a_last_evaluation_through_a_submodule_is_read_when_the_watch_ends():
    """A trainer's last validation calling a submodule (self.net(x)) is read at the next forward or step
    end, and at the end of training none comes: its dirty batch was never reported (a probe of Lightning,
    session 44). flush(), which the `with` block's end and the callbacks call, reads it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught, nanfast.watch(model, opt, action="warn") as w:
        warnings.simplefilter("always")
        for s in range(2):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1)).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            x = torch.randn(2, 4)
            x[0, 0] = float("nan")
            model[0](x)  # the validation loop calls a submodule
        assert w.events == []  # not yet: read when the watch ends
    assert [(e.step, e.evaluation, e.first.name) for e in w.events] == [(2, True, "0")]
    assert any("an evaluation" in str(c.message) for c in caught)


class NanInBackward(torch.nn.Module):
    """Adds sqrt((h - h)^2): zero in forward, in backward sqrt's infinite gradient at 0 times 0, a NaN at
    every step that no scale makes or cures."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 1)

    def forward(self, x):
        h = self.a(x)
        return self.b(h + torch.sqrt((h - h.detach()) ** 2))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_nan_the_scaler_keeps_skipping_is_reported_once_its_scale_reaches_1(fused):
    """The scaler skipped every step and backed its scale off to 6e-8 without a word from the watch (a
    probe, session 47): the skips it makes at a scale above 1 are its overflows, at 1 or below they are
    reported."""
    torch.manual_seed(0)
    model = NanInBackward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 3)
    with nanfast.watch(model, opt, action="warn", scaler=scaler) as w:
        for step in range(6):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                scaler.step(opt)
            scaler.update()
            warned = [c for c in caught if "nanfast.watch" in str(c.message)]
            assert len(warned) == (step >= 3), (step, scaler.get_scale())  # scales 8, 4, 2, then 1
        assert w.scaler_skipped_steps == 6 and [e.step for e in w.events] == [3, 4, 5]
        assert w.events[0].first.phase in ("backward", "grad")


def test_a_spike_raised_inside_gradscaler_step_leaves_a_fused_optimizer_ready():
    """A spike's raise (SpikeError) inside GradScaler.step left the scale it had handed a fused optimizer:
    the next healthy update came out 1024x too small (a review, session 47)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    with nanfast.watch(model, opt, scaler=scaler,
                       spikes=nanfast.SpikeOptions(action="raise", warmup=5, window=10, modules=False)) as w:
        with pytest.raises(nanfast.SpikeError):
            for step in range(10):
                opt.zero_grad()
                loss = w.loss(F.mse_loss(model(x), y * (1000.0 if step == 8 else 1.0)))
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        assert step == 8 and not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_an_inference_loss_without_an_optimizer_is_its_forwards_not_a_late_one():
    """Without an optimizer, each no_grad forward is a step ended when it returns; a loss passed to
    w.loss after it is that forward's: an evaluation loop warned "Watch.loss was called ... after
    optimizer.step()?" and named a NaN loss as passed after optimizer.step() (a probe, session 49)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).eval()
    targets = [torch.randn(5, 1), torch.randn(5, 1), torch.full((5, 1), float("nan"))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning but the NaN loss's own
        with pytest.warns(RuntimeWarning, match=r"^nanfast.watch: step 2: non-finite values first appeared in the "
                                                r"value of 'loss' passed to Watch.loss \(nan=5"):
            with nanfast.watch(model, action="warn") as w:
                for y in targets:
                    with torch.no_grad():
                        w.loss(torch.nn.functional.mse_loss(model(torch.randn(5, 4)), y, reduction="none"))
    (event,) = w.events
    assert event.step == 2 and not event.late_loss and not event.evaluation and len(w.history) == 3
