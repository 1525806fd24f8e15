"""Spike alarms on real small training loops: a planted spike (a batch scaled up, one layer's gradient
blown up or cut off) gives exactly one event of kind "spike" at its step naming the series; a smooth run
of a few hundred steps (an MLP, a small ResNet, a tiny transformer) gives none."""

import math
import re
import statistics
import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast
from nanfast.cli.watch_workloads import BasicBlock
from nanfast.watcher import SpikeError, SpikeOptions


@pytest.fixture(autouse=True)
def one_thread(restore_num_threads):
    torch.set_num_threads(1)  # tiny models: more threads only contend for the cores

class SmallResNet(torch.nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(8),
                                        torch.nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.head = torch.nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


TARGET = torch.Generator().manual_seed(7)
W_TRUE = torch.randn(8, 1, generator=TARGET)


def regression_batch(g):
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x @ W_TRUE)


def image_batch(g):
    return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)


def token_batch(g):
    tokens = torch.randint(0, 50, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


WORKLOADS = {
    "mlp": (mlp, regression_batch, lambda out, y: F.mse_loss(out, y), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "resnet": (SmallResNet, image_batch, F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "transformer": (TinyTransformer, token_batch, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                    lambda p: torch.optim.AdamW(p, lr=1e-3)),
}


def run(workload, steps, plant=None, seed=0, **options):
    """Trains `steps` steps of a workload under a watch (gradients clipped to norm 1 by the watch, whose
    norm is the one before clipping); `plant(step, x, y, model, opt)` may change a batch (returns it) or arm
    a fault. Returns the watch, removed."""
    make, data, criterion, optimizer = WORKLOADS[workload]
    torch.manual_seed(seed)
    model = make()
    opt = optimizer(model.parameters())
    g = torch.Generator().manual_seed(seed + 1)
    with nanfast.watch(model, opt, **options) as w:
        for step in range(steps):
            x, y = data(g)
            if plant is not None:
                x, y = plant(step, x, y, model, opt)
            opt.zero_grad()
            w.loss(criterion(model(x), y)).backward()
            w.clip_grad_norm_(1.0)
            opt.step()
    return w


def spikes_of(w):
    return [e for e in w.events if e.kind == "spike"]


def scaled_targets(at, factor=100.0, until=None):
    def plant(step, x, y, model, opt):
        return x, (y * factor if at <= step < (until or at + 1) else y)
    return plant


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_a_batch_with_targets_scaled_up_fires_one_spike_naming_the_loss_and_the_grad_norm(sync):
    with pytest.warns(RuntimeWarning, match="step 60: loss 'loss' spiked") as caught:
        w = run("mlp", 80, plant=scaled_targets(60), sync=sync)
    assert len(caught) == 1
    (event,) = spikes_of(w)
    assert w.events == [event] and event.step == 60 and w.last is event
    assert (event.first.phase, event.first.name) == ("loss_value", "loss")
    assert ("grad", "") in [(p.phase, p.name) for p in event.later]  # the total gradient norm
    assert "the total gradient norm spiked" in event.detail and "threshold 10x)" in event.detail
    record = w.history[60]
    assert record.events == (event,) and record.to_dict()["events"][0]["kind"] == "spike"
    assert record.loss > 10 * w.history[59].loss


def test_a_level_shift_fires_once_not_at_every_step_it_stays_high():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        w = run("mlp", 140, plant=scaled_targets(60, until=140))
    assert [e.step for e in spikes_of(w)] == [60]


def lr_bump(at, factor):
    """Multiplies the learning rate by `factor` for the optimizer step of step `at` only."""
    def plant(step, x, y, model, opt):
        for group in opt.param_groups:
            group.setdefault("base_lr", group["lr"])
            group["lr"] = group["base_lr"] * (factor if step == at else 1)
        return x, y
    return plant


def test_a_learning_rate_1000x_for_one_step_fires_at_the_next_step():
    """The step that took the huge update is healthy; the next step's loss and gradient norm show it.
    The wrecked run may fire again later (it is genuinely unstable): the first event is asserted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        w = run("mlp", 63, plant=lr_bump(60, 1000))
    first = spikes_of(w)[0]
    assert first.step == 61 and (first.phase, first.name) == ("loss_value", "loss")
    assert ("grad", "") in [(p.phase, p.name) for p in first.later]


def grad_hook(module_index, at, scale, until=None):
    """Multiplies the gradients of module `module_index`'s parameters by `scale` at steps [at, until)."""
    state = {"step": -1}

    def plant(step, x, y, model, opt):
        if step == 0:
            for p in model[module_index].parameters():
                p.register_hook(lambda g: g * scale if at <= state["step"] < (until or at + 1) else g)
        state["step"] = step
        return x, y
    return plant


def test_one_layer_exploding_names_the_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        w = run("mlp", 80, plant=grad_hook(2, 60, 1e3))
    (event,) = spikes_of(w)
    assert event.step == 60
    modules = [p for p in event.places if p.phase == "grad" and p.name]
    assert [(p.name, p.module_class) for p in modules] == [("2", "Linear")]
    assert "the gradient norm of 2 (Linear) exploded" in event.detail


def test_one_layer_vanishing_for_ten_steps_names_the_module_once():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        w = run("mlp", 100, plant=grad_hook(0, 60, 0.0, until=80))
    (event,) = spikes_of(w)
    assert event.step == 69  # the 10th checked step in a row below 1/10 of its median
    assert [(p.phase, p.name, p.module_class) for p in event.places] == [("grad", "0", "Linear")]
    assert ("the gradient norm of 0 (Linear) vanished to 0, 0 of the modules' median gradient norm (against its "
            "running median share") in event.detail
    assert "below 1/10 for 10 steps in a row" in event.detail


def test_one_layer_shrinking_1000x_says_its_share():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        w = run("mlp", 100, plant=grad_hook(2, 60, 1e-3, until=80))
    (event,) = spikes_of(w)
    assert event.step == 69 and [(p.name, p.module_class) for p in event.places] == [("2", "Linear")]
    share, usual = (float(x) for x in re.search(r"vanished to \S+, (\S+) of the modules' median gradient norm "
                                                 r"\(1/\S+ of its running median share (\S+)\)", event.detail).groups())
    assert 5e-4 < share / usual < 2e-3  # the share fell by the hook's 1000x, give or take the step's noise


def test_dead_units_that_cut_off_most_layers_below_them_fire():
    """Every ReLU unit of the 5th of 6 hidden layers dies at step 100 (its bias set to -1000): every
    module below it, most of the model, gets exactly zero gradient. They vanish as shares of the median
    of the positive norms (a median over every module, zeros included, was 0 and judged nothing: a
    probe of session 39)."""
    torch.manual_seed(0)
    layers = []
    for i in range(6):
        layers += [torch.nn.Linear(16 if i == 0 else 32, 32), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    with nanfast.watch(model, opt, spikes=dict(action="record")) as w:
        for step in range(120):
            if step == 100:
                with torch.no_grad():
                    model[8].bias.fill_(-1e3)
            x = torch.randn(32, 16)
            opt.zero_grad()
            F.mse_loss(model(x), x @ target).backward()
            opt.step()
    (event,) = spikes_of(w)
    assert event.step == 109 and "vanished to 0, 0 of the modules' median gradient norm" in event.detail
    # In backward order: the dead layer, nearest the output, first.
    assert [p.name for p in event.places] == ["8", "6", "4", "2", "0"]


def test_gradients_underflowing_together_are_no_vanishing():
    """From step 60 every gradient is scaled into float32's subnormal range (1e-40 of itself), module 0's
    to exactly 0, as underflow takes the first of them there: nothing was cut off, and nothing fires
    (module 0 "vanished" at step 69 before: NOTE: [Vanishing as a share])."""
    scales = {0: 0.0, 2: 1e-40, 4: 1e-40}
    hooks = [grad_hook(i, 60, scale, until=100) for i, scale in scales.items()]

    def plant(step, x, y, model, opt):
        for hook in hooks:
            hook(step, x, y, model, opt)
        return x, y
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy run neither warns nor raises
        w = run("mlp", 100, plant=plant)
    assert 0 < w.history[80].grad_norm < 1e-38 and spikes_of(w) == []


def test_overfitting_one_batch_to_a_zero_loss_is_no_vanishing():
    """The watch suite's MLP (2.1M parameters) trained on one batch: from step ~30 its float32 loss is
    0.0 and every gradient falls through the subnormal range, its Linear modules' reaching exactly 0 one
    after the other (net.0 at step 43 with this seed on the machine of session 49), each reported as
    vanished before (steps 51, 52 and 60). "Overfit one batch" is a standard check of a new model."""
    from nanfast.cli.watch_workloads import MLP, MLP4

    torch.manual_seed(3)
    model = MLP4(**MLP)
    x, y = torch.randn(MLP["batch"], MLP["features"]), torch.randint(0, MLP["classes"], (MLP["batch"],))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy run neither warns nor raises
        with nanfast.watch(model, opt) as w:
            for _ in range(70):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
    assert w.history[-1].grad_norm < 1e-38 and spikes_of(w) == []


def test_unfreezing_a_backbone_is_no_spike():
    """Fine-tuning's freeze-then-unfreeze: torchvision's mobilenet_v3_small (random init) trains its
    classifier alone for 100 steps, then the whole model. The backbone's gradients join the total norm,
    a step up of about 10x that is no spike: the total starts a new window when modules never seen with
    a gradient join (it warned at 5 steps after the unfreeze: a probe of session 39)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    backbone = [p for name, p in model.named_parameters() if not name.startswith("classifier")]
    for p in backbone:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy run neither warns nor raises
        with nanfast.watch(model, opt) as w:
            for step in range(130):
                if step == 100:
                    for p in backbone:
                        p.requires_grad_(True)
                x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
    norms = [r.grad_norm for r in w.history]
    assert statistics.median(norms[100:]) > 5 * statistics.median(norms[:100])  # the step up is real
    assert spikes_of(w) == []


class SplitLinear(torch.nn.Module):
    """A linear model of 12 features as three Linear modules, one per group of 4 (summed)."""

    def __init__(self):
        super().__init__()
        self.parts = torch.nn.ModuleList(torch.nn.Linear(4, 8) for _ in range(3))

    def forward(self, x):
        return sum(part(x[:, 4 * i:4 * i + 4]) for i, part in enumerate(self.parts))


def test_a_run_that_converges_is_not_a_vanishing():
    """A linear model fitting a linear target exactly: the loss falls from ~1 to the float32 floor
    (~1e-14) and every module's gradient with it, 100x every 50 steps, together; no module's share of
    them falls, and nothing fires (judged on its own past, every module "vanished")."""
    torch.manual_seed(0)
    model, teacher = SplitLinear(), torch.nn.Linear(12, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy run neither warns nor raises
        with nanfast.watch(model, opt) as w:
            for _ in range(200):
                x = torch.randn(32, 12, generator=g)
                with torch.no_grad():
                    y = teacher(x)
                opt.zero_grad()
                w.loss(F.mse_loss(model(x), y)).backward()
                opt.step()
    losses, grad_norms = [r.loss for r in w.history], [r.grad_norm for r in w.history]
    assert losses[-1] < 1e-12 * losses[0] and grad_norms[-1] < 1e-5 * grad_norms[0]
    assert spikes_of(w) == []


@pytest.mark.parametrize("workload", ["mlp", "resnet", "transformer"])
def test_no_spike_on_a_smooth_run(workload):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy run neither warns nor raises
        w = run(workload, 300)
    assert w.events == [] and len(w.history) == 300
    assert all(r.loss is not None and math.isfinite(r.loss) and r.grad_norm > 0 for r in w.history)


def test_spikes_raise_before_the_step_is_applied():
    seen = {}

    def plant(step, x, y, model, opt):
        if step == 60:
            seen["before"] = [p.detach().clone() for p in model.parameters()]
            seen["model"] = model
        return scaled_targets(60)(step, x, y, model, opt)

    with pytest.raises(SpikeError, match="step 60: loss 'loss' spiked") as raised:
        run("mlp", 80, plant=plant, spikes=SpikeOptions(action="raise"))
    assert raised.value.event.step == 60 and raised.value.event.kind == "spike"
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], seen["model"].parameters()))


def test_spikes_skip_leaves_the_run_as_if_the_batch_never_came():
    _, data, criterion, optimizer = WORKLOADS["mlp"]

    def train(watched):
        torch.manual_seed(0)
        model = mlp()
        opt = optimizer(model.parameters())
        g = torch.Generator().manual_seed(1)
        w = nanfast.watch(model, opt, action="skip", spikes=SpikeOptions(action="skip")) if watched else None
        for step in range(70):
            x, y = data(g)
            if step == 60:
                if not watched:
                    continue  # the reference never sees the batch
                y = y * 100
            opt.zero_grad()
            loss = criterion(model(x), y)
            (loss if w is None else w.loss(loss)).backward()
            opt.step()
        state = [p.detach().clone() for p in model.parameters()]
        state += [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        return state, w

    with pytest.warns(RuntimeWarning, match="step 60: loss 'loss' spiked.*skipped the optimizer step"):
        state, w = train(watched=True)
    reference, _ = train(watched=False)
    assert all(torch.equal(a, b) for a, b in zip(state, reference))
    assert w.skipped_steps == 1 and [e.step for e in spikes_of(w)] == [60]
    assert w.history[60].skipped and not any(r.skipped for r in w.history[:60] + w.history[61:])
    with pytest.raises(ValueError, match="spikes action 'skip' needs the watch's action='skip' and sync='eager'"):
        nanfast.watch(mlp(), spikes={"action": "skip"})


def test_spikes_record_only_or_call_a_callable_and_the_watch_callable_gets_them_too():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = run("mlp", 80, plant=scaled_targets(60), spikes={"action": "record"})
    assert [e.step for e in spikes_of(w)] == [60]
    called = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = run("mlp", 80, plant=scaled_targets(60), spikes=SpikeOptions(action=called.append))
    assert called == spikes_of(w) and [e.step for e in called] == [60]
    called.clear()
    with pytest.warns(RuntimeWarning, match="spiked"):
        w = run("mlp", 80, plant=scaled_targets(60), action=called.append)
    assert called == w.events and [e.kind for e in called] == ["spike"]


def test_spikes_off_and_options_checked():
    w = run("mlp", 80, plant=scaled_targets(60), spikes=False)
    assert w.events == []
    model = mlp()
    for bad, error in [(dict(factor=1.0), ValueError), (dict(window=0), ValueError), (dict(warmup=50, window=20), ValueError),
                       (dict(action="explode"), ValueError), (dict(vanishing_steps=0), ValueError)]:
        with pytest.raises(error, match="spikes"):
            nanfast.watch(model, spikes=bad)
    with pytest.raises(TypeError, match="spikes must be"):
        nanfast.watch(model, spikes="on")
    assert not model._forward_hooks


def loss_spikes(values, name):
    """The spike events of a watch given `values` as its loss `name`, one step each (no model step)."""
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with nanfast.watch(model, spikes=SpikeOptions(grad_norm=False, modules=False)) as w:
            for v in values:
                w.loss(torch.tensor(v, dtype=torch.float64), name)
                w.step()
    return spikes_of(w)


def test_a_negative_loss_is_judged_by_its_spread():
    """A loss below zero (a log-likelihood) has no meaningful ratio to its median: its excess over the
    median is judged against max(|median|, 1.5 x its interquartile range) times factor - 1."""
    g = torch.Generator().manual_seed(0)
    values = [-5.0 + 0.1 * torch.randn((), generator=g).item() for _ in range(150)]
    values[140] = 50.0
    (event,) = loss_spikes(values, "nll")
    assert event.step == 140 and (event.phase, event.name) == ("loss_value", "nll")
    assert "above its running median -5" in event.detail


def test_a_loss_that_is_mostly_exactly_zero_fires_only_on_a_real_jump():
    """A hinge loss is 0 on most steps: the window's median and interquartile range are 0, and every
    nonzero value was a spike ("0.0657 above its running median 0"), eleven warnings on a healthy run.
    Its largest value now sets the scale."""
    g = torch.Generator().manual_seed(0)
    values = [0.0 if torch.rand((), generator=g) < 0.85 else 0.1 * torch.rand((), generator=g).item()
              for _ in range(150)]
    values[140] = 5.0
    assert [e.step for e in loss_spikes(values, "hinge")] == [140]


# --- the windows in C++ (NOTE: [Spike windows in C++]) against the rule written here in Python --------


class ReferenceSeries:
    """One series under NOTE: [Spikes], in plain Python: the last `window` finite values, the median and
    quartiles of a sorted copy, the run of low steps and the two alarms."""

    def __init__(self, window, factor, warmup, vanishing_steps, vanishing):
        self.window, self.factor, self.warmup, self.vanishing_steps = window, factor, warmup, vanishing_steps
        self.vanishing, self.recent, self.low, self.alarmed = vanishing, [], 0, set()

    def observe(self, x):
        o = sorted(self.recent)
        n = len(o)
        median = (o[(n - 1) // 2] + o[n // 2]) / 2 if n else math.nan
        above = below = False
        if n >= self.warmup and math.isfinite(x):
            spread = max(abs(median), 1.5 * (o[(3 * n) // 4] - o[n // 4])) or max(abs(o[0]), abs(o[-1]))
            above = spread > 0 and x - median > (self.factor - 1) * spread and x - median > 2 * (o[-1] - median)
            below = median > 0 and x < median / self.factor
        if math.isfinite(x):
            self.recent = (self.recent + [x])[-self.window:]
        self.low = self.low + 1 if below else 0
        fired = []
        for direction, crossed in (("up", above and not self.vanishing),
                                   ("down", self.vanishing and self.low >= self.vanishing_steps)):
            if not crossed:
                if math.isfinite(x):
                    self.alarmed.discard(direction)
            elif direction not in self.alarmed:
                self.alarmed.add(direction)
                fired.append((direction, median))
        return fired


@pytest.mark.parametrize("seed", range(6))
def test_the_windows_fire_as_the_rule_on_random_series(seed):
    """Random series with spikes, drops, NaN/inf, ties and negative stretches, some appearing late: the
    same alarms at the same steps with the same medians as the rule in Python, value for value."""
    g = torch.Generator().manual_seed(seed)
    window, warmup, vanishing = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((3, 12), (1, 3), (1, 4)))
    factor = 1.5 + 4 * float(torch.rand((), generator=g))
    windows = nanfast._C.SpikeWindows(window, factor, min(warmup, window), vanishing)
    refs, ids = [], []
    total = 0
    for step in range(300):
        if step % 60 == 0:  # a new series joins now and then
            judged_vanishing = len(refs) % 2 == 0
            ids.append(windows.add(judged_vanishing))
            refs.append(ReferenceSeries(window, factor, min(warmup, window), vanishing, judged_vanishing))
        values = []
        for i in range(len(refs)):
            u = float(torch.rand((), generator=g))
            x = float(torch.randn((), generator=g)) + (5 if (step // 40) % 2 else 1)
            x = [x, x * 100, x / 100, math.nan, math.inf, -math.inf, -x, 2.0][int(u * 8)] if u < 0.2 else x
            x = 0.0 if (step // 30) % 4 == 3 and u < 0.8 else x  # stretches mostly exactly 0
            values.append(round(x, 1) if u > 0.9 else x)  # rounded: ties in the window
        # A vanishing series is judged on its share of the median of the step's positive vanishing values.
        finite = [v for ref, v in zip(refs, values) if ref.vanishing and math.isfinite(v) and v > 0]
        median = statistics.median(finite) if finite else math.nan
        judged = [(v / median if median > 0 else math.nan) if ref.vanishing else v for ref, v in zip(refs, values)]
        expected = [(i, d, m) for i, ref in enumerate(refs) for d, m in ref.observe(judged[i])]
        fired = windows.observe(ids, values)
        assert [(i, d) for i, d, _, _ in fired] == [(i, d) for i, d, _ in expected], step
        assert all(m == e or (math.isnan(m) and math.isnan(e)) for (_, _, m, _), (_, _, e) in zip(fired, expected))
        assert all(x == judged[i] for i, _, _, x in fired)  # the value judged: a vanishing series' share
        total += len(fired)
    assert len(windows) == len(refs) == 5 and total > 10, total  # alarms did fire


def test_the_windows_name_bad_arguments():
    with pytest.raises(RuntimeError, match="nanfast._C.SpikeWindows: factor must be finite and > 1, got 1"):
        nanfast._C.SpikeWindows(10, 1.0, 2, 3)
    with pytest.raises(RuntimeError, match="warmup <= window, got 10, 20, 3"):
        nanfast._C.SpikeWindows(10, 2.0, 20, 3)
    windows = nanfast._C.SpikeWindows(10, 2.0, 2, 3)
    windows.add(False)
    with pytest.raises(RuntimeError, match="observe: 1 ids for 2 values"):
        windows.observe([0], [1.0, 2.0])
    with pytest.raises(RuntimeError, match="observe: ids\\[1\\]=1 is not a series \\(1 added\\)"):
        windows.observe([0, 1], [1.0, 2.0])


def test_module_groups_follow_a_head_swapped_in_after_the_watch_began():
    """Each gradient's module is the model's as it is when the names change (NOTE: [A model changed after
    watch()]): a swapped-in head's weight and bias are one module, of its class."""
    from nanfast.watcher.spikes import ModuleGroups

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    groups = ModuleGroups(model)
    names, index = groups.index(("0.weight", "0.bias", "1.weight"), torch.device("cpu"))
    assert names == ("0", "1") and index.tolist() == [0, 0, 1]
    model[1] = torch.nn.Sequential(torch.nn.LayerNorm(2))
    names, index = groups.index(("0.weight", "1.0.weight", "1.0.bias"), torch.device("cpu"))
    assert names == ("0", "1.0") and index.tolist() == [0, 1, 1] and groups.module_class("1.0") == "LayerNorm"
