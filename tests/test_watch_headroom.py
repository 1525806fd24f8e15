"""nanfast.watch's overflow headroom (issue 18): per-place max |x| of float16/bfloat16/float8 places as a
fraction of the dtype's largest finite value, warning events of kind "headroom" with the growth trend,
read with the step's one read."""

from __future__ import annotations

import collections
import math
import warnings

import pytest
import torch

import nanfast
from nanfast.watcher import headroom as hr

# Each test runs with the recorder's counts on the host and as tensors, as on a GPU (conftest.py).
pytestmark = pytest.mark.usefixtures("recorder_counts")

FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]
LOW = [torch.float16, torch.bfloat16, *FP8]


def random_of(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random finite values spread over the dtype's range (float8: within its largest finite value)."""
    g = torch.Generator().manual_seed(seed)
    top = torch.finfo(dtype).max
    scale = min(top / 8, 1e4)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).clamp(-top, top).to(dtype)


def headroom_events(w) -> list:
    return [e for e in w.events if e.kind == "headroom"]


def capture_fractions(w) -> list:
    """Records, for each observed step, the per-place fractions the tracker was given."""
    seen = []
    observe = w._headroom.observe

    def spy(step, pending, input_names, scale):
        events = observe(step, pending, input_names, scale)
        seen.append(None if pending is None else {key: found[:3] for key, found in pending.fractions(scale).items()})
        return events

    w._headroom.observe = spy
    return seen


# ---- the recorder keeps max |x| and the dtype's limit per row ----


def test_recorder_keeps_absmax_and_limit_per_low_precision_row():
    rec = nanfast._C.WatchRecorder(torch.device("cpu"))
    tensors = {dtype: random_of(dtype, (37, 5), seed=i) for i, dtype in enumerate(LOW)}
    fp32 = torch.randn(11)
    rec.record([fp32], 0)  # nothing kept for float32 rows
    for slot, t in enumerate(tensors.values(), start=1):
        rec.record([t], slot)
    mixed = [fp32, tensors[torch.float16]]
    rec.record(mixed, 9)
    counts, _, slots, absmax, limited = rec.take()
    assert torch.cat(counts).shape == (len(LOW) + 3, 3)
    expected = [t.double().abs().max().item() for t in tensors.values()] + [fp32.double().abs().max().item(),
                                                                            tensors[torch.float16].double().abs().max().item()]
    limits = [torch.finfo(d).max for d in tensors] + [0.0, 65504.0]
    assert absmax.dtype == torch.float64 and absmax.tolist() == expected  # exact: max |x| is a stored value
    assert limited == [(slot, limit) for slot, limit in zip([*range(1, len(LOW) + 1), 9, 9], limits)]
    assert [hr.LIMITS[d] for d in tensors] == limits[:len(LOW)]  # the recorder's table and the Python one agree

    rec.record([fp32], 0)
    assert rec.take()[3:] == (None, [])  # a step of float32 records keeps nothing more


class EveryThird(torch.nn.Module):
    def forward(self, x):
        return x[1::3]  # a strided view: reads without a copy, in every dtype


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_watch_fractions_equal_a_float64_reference(dtype):
    model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Flatten(0), EveryThird())
    outputs = {}
    for name, module in model.named_children():
        module.register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, out.double().abs().max().item()))
    w = nanfast.watch(model, params=False, grads=False, pass_through=(), headroom=(1.0,))
    seen = capture_fractions(w)
    x = random_of(dtype, (64, 3), seed=3)
    x[0, 0] = torch.finfo(dtype).max  # EveryThird leaves it out
    model(x)
    w.step()
    w.remove()
    limit = torch.finfo(dtype).max
    fractions = {key[:2]: fraction for key, (fraction, _, _) in seen[0].items()}
    assert fractions[("input", "input")] == 1.0
    assert outputs["2"] < limit
    for name in "012":
        assert fractions[("forward", name)] == outputs[name] / limit
    record = w.history[-1]  # the step's record names its largest fraction and where
    assert (record.headroom, record.headroom_place) == (1.0, nanfast.Place("input", "input", "", 0, 0, 0).where())


def test_fused_pass_rows_of_low_precision_parameters_and_gradients():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).to(torch.bfloat16)
    model.weight.data[0, 0] = 3e37  # a fraction far from 0, so that the comparison means something
    w = nanfast.watch(model, ignore=["bias"], headroom=(1.0,))
    seen = capture_fractions(w)
    model(torch.randn(2, 6, dtype=torch.bfloat16)).float().square().sum().backward()
    w.step()
    w.remove()
    limit = torch.finfo(torch.bfloat16).max
    fractions = {key[:2]: fraction for key, (fraction, _, _) in seen[0].items()}
    assert fractions[("param", "weight")] == model.weight.double().abs().max().item() / limit
    assert fractions[("grad", "weight")] == model.weight.grad.double().abs().max().item() / limit
    assert ("param", "bias") not in fractions and ("grad", "bias") not in fractions  # ignored


# ---- events ----


def growing_run(factor: float, stop_at: float, **options):
    """A float16 Linear whose weight is multiplied by `factor` each step; runs until its output reaches
    `stop_at` of float16's max. Returns the watch and the reference max |output| / 65504 per step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False)).half()
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(8, 8) * 2)
    x = (torch.randn(16, 8) * 10).half()  # outputs far larger than the weight, which grows too
    fractions = []
    model[0].register_forward_hook(lambda m, a, out: fractions.append(out.double().abs().max().item() / 65504))
    w = nanfast.watch(model, **{"action": "warn", **options})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while not fractions or fractions[-1] < stop_at:
            model(x)
            w.step()
            with torch.no_grad():
                model[0].weight.mul_(factor)
        w.flush()
    w.remove()
    return w, fractions, caught


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_growing_float16_output_fires_once_per_threshold_at_the_crossing_step(sync):
    w, fractions, caught = growing_run(1.1, 0.9, sync=sync)
    assert fractions[0] < 0.01  # starts far from the thresholds
    events = headroom_events(w)
    assert [(e.step, e.phase, e.name) for e in events] == [
        (next(i for i, f in enumerate(fractions) if f >= t), "forward", "0") for t in hr.DEFAULT_THRESHOLDS]
    assert all(e.first.nonfinite == 0 and e.first.module_class == "Linear" for e in events)
    assert not [e for e in w.events if e.kind != "headroom"]
    truth = math.log(2) / math.log(1.1)  # 7.27 steps
    for event, threshold in zip(events, hr.DEFAULT_THRESHOLDS):
        assert f"of float16's max (threshold {100 * threshold:.0f}%)" in event.detail
        doubling = float(event.detail.split("doubling every ~")[1].split(" steps")[0])
        assert doubling == pytest.approx(truth, rel=0.05)
        assert event.summary() == f"nanfast.watch: step {event.step}: {event.detail}"
    messages = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    assert messages == [e.summary() for e in events]  # each warned once
    last = w.history[-1]
    assert last.headroom_place.startswith("output of 0 ") and last.headroom == pytest.approx(fractions[-1])


def test_thresholds_are_configurable_and_a_callable_action_receives_the_events():
    received = []
    _, fractions, _ = growing_run(1.1, 0.3, headroom=0.2, action=received.append)
    assert [(e.kind, e.step) for e in received] == [("headroom", next(i for i, f in enumerate(fractions) if f >= 0.2))]
    w, _, _ = growing_run(1.1, 0.95, headroom=None)
    assert headroom_events(w) == [] and all(record.headroom is None for record in w.history)


def test_trend_is_a_fit_over_the_recent_samples():
    tracker = hr.Headroom((0.5,))
    key = ("forward", "fc", "Linear", 1)
    assert tracker.doubling_steps(key) is None
    tracker._samples[key] = collections.deque(
        [(step, math.log2(1e-3 * 2 ** (step / 40))) for step in range(0, 400, 4)], maxlen=hr.WINDOW)
    assert tracker.doubling_steps(key) == pytest.approx(40)
    assert hr._trend(40.4, 32) == "doubling every ~40 steps" and hr._trend(1.71, 32) == "doubling every ~1.7 steps"
    tracker._samples[key] = collections.deque([(step, -3.0 - step / 100) for step in range(8)])
    assert math.isinf(tracker.doubling_steps(key))
    assert hr._trend(math.inf, 8) == "not growing over the last 8 checked steps"


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), "0.5", True, [0.5, 2]])
def test_bad_thresholds_are_refused_naming_the_entry(bad):
    with pytest.raises((ValueError, TypeError), match="headroom"):
        nanfast.watch(torch.nn.Linear(2, 2), headroom=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_healthy_training_gives_no_headroom_event(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nanfast.watch(model, opt) as w:
            for _ in range(60):
                x = torch.randn(8, 16, dtype=dtype)
                opt.zero_grad()
                model(x).float().square().mean().backward()
                opt.step()
    lasts = [record.headroom for record in w.history]
    assert w.events == [] and len(lasts) == 60
    if dtype == torch.float32:
        assert lasts == [None] * 60  # nothing low-precision: nothing packed, nothing read
    else:
        assert all(0 < last < 1e-30 for last in lasts)


# ---- no extra host read ----


@pytest.mark.parametrize("sync,per_step", [("eager", 1), ("lagged", 0)])
def test_one_host_read_per_checked_step(op_recorder, sync, per_step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = nanfast.watch(model, opt, sync=sync, headroom=(1e-9,), action="warn")  # every place crosses at once
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            with op_recorder() as rec:
                opt.zero_grad()
                model(torch.randn(4, 8).half()).float().sum().backward()
                opt.step()
            counts.append(rec.host_syncs)
        w.flush()
    w.remove()
    assert counts == [per_step] * 4
    assert len(headroom_events(w)) > 5  # the fractions were read: every place warned


def test_a_low_precision_step_whose_max_values_are_one_tensor_copies_them_once(op_recorder):
    """The step's max |x| of its low-precision places go to the host in one copy. Where they were one
    tensor already (a float16 model's records, fused or not), they went through a cat of that one
    tensor first: a copy more per step (a launch on a GPU, its host time on the step's path). The fused
    watch (the default on a GPU) has them in one tensor, its one call's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanfast.watch(model, opt, fuse=True, params=False, grads=False) as w:
        for _ in range(3):
            with op_recorder() as rec:
                opt.zero_grad()
                model(torch.randn(4, 8).half()).float().sum().backward()
                opt.step()
    assert "aten.cat.default" not in rec.counts and w.history[-1].headroom > 0


class _Alternating(torch.nn.Module):
    """float16 and float32 places in turn, as autocast makes them (a Linear in float16, the LayerNorm
    after it in float32)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = (torch.nn.Linear(8, 8).half() for _ in range(3))
        self.norm_a, self.norm_b = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)

    def forward(self, x):
        h = self.norm_a(self.a(x).float())
        h = self.norm_b(self.b(h.half()).float())
        return self.head(h.half())


def test_a_fused_steps_alternating_low_precision_places_come_out_of_one_call_without_a_cat(op_recorder):
    """NOTE: [One call's max |x| in one view]: the float16 records of one fused call, with float32 ones
    between them, were joined by a cat (a launch more per fused step under autocast); the rows between
    now come along with the limit 0, so the step makes no cat, and reports the same largest fraction,
    at the same place, as a watch that checks each record at once."""
    seen = {}
    for fuse in (False, True):
        torch.manual_seed(0)
        model = _Alternating()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        with nanfast.watch(model, opt, fuse=fuse, params=False, grads=False) as w:
            for _ in range(3):
                with op_recorder() as rec:
                    opt.zero_grad()
                    model((torch.randn(4, 8, generator=g) * 100).half()).float().sum().backward()
                    opt.step()
        seen[fuse] = [(r.headroom, r.headroom_place) for r in w.history]
        if fuse:
            assert "aten.cat.default" not in rec.counts
    assert seen[True] == seen[False] and all(fraction > 0 for fraction, _ in seen[True])


def test_a_scaled_steps_loss_scale_comes_with_the_summary_not_in_a_cat(op_recorder):
    """NOTE: [The loss scale read with the summary]: under a GradScaler the scale was appended to the max
    |x| copied to the host, a float64 copy and a cat in every step (two launches on a GPU); the summary
    carries it already. A fused float16 step makes no cat, and its scaled places are measured at scale 1
    (test_scaled_gradients_are_measured_at_scale_one)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with nanfast.watch(model, opt, fuse=True, scaler=scaler) as w:
        for _ in range(3):
            with op_recorder() as rec:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 8)).float().sum()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    assert "aten.cat.default" not in rec.counts and w.history[-1].headroom > 0 and w.events == []


def test_a_float32_model_runs_the_same_ops_with_headroom_on_or_off(op_recorder):
    ops = []
    for headroom in (hr.DEFAULT_THRESHOLDS, None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with nanfast.watch(model, opt, headroom=headroom):
            with op_recorder() as rec:
                for _ in range(3):
                    opt.zero_grad()
                    model(torch.randn(4, 8)).sum().backward()
                    opt.step()
        ops.append(rec.counts)
    assert ops[0] == ops[1]


def test_a_place_is_its_largest_value_over_the_microbatches():
    model = torch.nn.Sequential(torch.nn.Tanh()).half()
    w = nanfast.watch(model, pass_through=(), headroom=(1.0,))
    seen = capture_fractions(w)
    small, large = torch.full((3,), 100.0).half(), torch.full((3,), 3000.0).half()
    for x in (small, large, small):  # gradient accumulation: three forwards in one step
        model(x.requires_grad_())
    w.step()
    w.remove()
    inputs = {key: fraction for key, (fraction, _, _) in seen[0].items() if key[0] == "input"}
    assert inputs == {("input", "input", "", 1): 3000 / 65504}


# ---- GradScaler ----


def scaled_run(headroom, scale=None):
    """Two float16 autocast steps under a GradScaler; returns the watch, the fractions it was given, the
    largest |gradient| flowing out of layer 1 (scaled) and the warnings."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, growth_interval=10 ** 6, enabled=scale is not None)
    w = nanfast.watch(model, opt, scaler=scaler, headroom=headroom, action="warn")
    seen = capture_fractions(w)
    grads = []
    model[1].register_full_backward_hook(lambda m, gi, go: grads.append(gi[0].double().abs().max().item()))
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    w.remove()
    return w, seen, grads, [c for c in caught if issubclass(c.category, RuntimeWarning)]


def test_scaled_gradients_are_measured_at_scale_one():
    _, _, grads, _ = scaled_run(hr.DEFAULT_THRESHOLDS)  # no scaler: the unscaled gradient
    scale = 2.0 ** math.floor(math.log2(0.5 * 65504 / grads[0]))  # scaled, it lands in [25%, 50%) of the max
    w, seen, scaled, caught = scaled_run(hr.DEFAULT_THRESHOLDS, scale)
    assert 0.25 <= scaled[0] / 65504 < 0.5  # near the top, as the scaler wants: not a warning
    fraction, limit, unscaled = seen[0][("backward", "1", "Linear", 1)]
    assert limit == 65504 and unscaled
    assert fraction == scaled[0] / scale / 65504 == pytest.approx(grads[0] / 65504, rel=1e-2)
    assert headroom_events(w) == [] and caught == []

    w, seen, _, caught = scaled_run((1e-6,), scale)
    fraction = seen[0][("backward", "1", "Linear", 1)][0]
    event = next(e for e in headroom_events(w) if (e.phase, e.name) == ("backward", "1"))
    assert f"before loss scaling (the largest GradScaler scale that fits is ~{1 / fraction:.3g})" in event.detail
    assert [str(c.message) for c in caught] == [e.summary() for e in headroom_events(w)]


def test_a_place_crossing_several_thresholds_in_one_step_warns_once_for_all():
    """A float16 output that jumps from far below to 87% of the maximum crosses 25% and 50% at once: one
    warning naming both (not one per threshold in the same step); 90%, crossed later, warns on its own."""
    model = torch.nn.Linear(4, 4, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    w = nanfast.watch(model, action="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for value in (1.0, 14250.0, 15500.0):  # outputs 4, 57000 (87%), 62000 (95%)
            model(torch.full((2, 4), value, dtype=torch.half))
            w.step()
    w.remove()
    events = headroom_events(w)
    assert [(e.step, e.phase) for e in events] == [(1, "forward"), (2, "forward")]
    assert "at 87% of float16's max (thresholds 25% and 50%)" in events[0].detail
    assert "at 95% of float16's max (threshold 90%)" in events[1].detail
    messages = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    assert messages == [e.summary() for e in events]


class _MaskedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24).bfloat16()

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        return ((q @ k.transpose(-1, -2)) / 8 ** 0.5 + attention_mask).softmax(-1) @ v


@pytest.mark.parametrize("fuse", [False, True])
def test_an_additive_mask_of_finfo_min_is_no_headroom_alarm(fuse):
    """HF's additive masks hold torch.finfo(dtype).min where they mask: the watch does not count a mask's
    -inf, but its headroom read the same mask's max |x| and warned "the input batch at 100% of bfloat16's
    max" at step 0 of a healthy run (a probe, session 38). A mask row's magnitude is a sentinel; the
    same values in an entry not named as a mask still warn (the headroom still looks at inputs)."""
    torch.manual_seed(0)
    model = _MaskedAttention()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mask = torch.zeros(6, 6, dtype=torch.bfloat16).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1),
                                                                torch.finfo(torch.bfloat16).min)
    w = nanfast.watch(model, opt, fuse=fuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 6, 8, dtype=torch.bfloat16), attention_mask=mask).float().square().mean().backward()
            opt.step()
    assert w.events == [] and [str(c.message) for c in caught] == []
    w.remove()

    class Biased(_MaskedAttention):
        def forward(self, x, bias):
            return super().forward(x, bias)

    model = Biased()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    w = nanfast.watch(model, opt, fuse=fuse)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        opt.zero_grad()
        model(torch.randn(2, 6, 8, dtype=torch.bfloat16), mask).float().square().mean().backward()
        opt.step()
    assert [(e.kind, e.first.phase) for e in w.events] == [("headroom", "input")]
    w.remove()


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
def test_an_input_entry_near_the_max_is_named(keyword):
    """The input's headroom event names the entry whose max |x| it is, as a dirty input's event does
    (a probe, session 38: it said only "the input batch"), whether the input is a tuple of tensors (the
    C++ fast path) or has keyword arguments (the container walker)."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8).bfloat16()

        def forward(self, x, offsets, scale):
            return self.proj(x) * scale + offsets.clamp(-1, 1)

    model = Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, scale = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(2, 8, dtype=torch.bfloat16)
    offsets = torch.full((2, 8), 0.6 * torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with nanfast.watch(model, opt) as w:
            opt.zero_grad()
            out = model(x, offsets, scale=scale) if keyword else model(x, offsets, scale)
            out.float().mean().backward()
            opt.step()
    (event,) = w.events
    assert (event.kind, event.first.phase, [e.name for e in event.first.entries]) == ("headroom", "input", ["offsets"])
    assert event.detail.startswith("the input batch (offsets) at 60% of bfloat16's max")


def test_a_place_that_went_non_finite_gets_no_headroom_warning_in_that_step():
    """pytorch/pytorch#115500: a float16 Linear whose output overflowed to +inf was also warned of as
    "output of 0 (Linear) at 97% of float16's max" (its finite values) in the step the event reported it
    (a probe, session 51). Other places' warnings stay (the input's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.BatchNorm1d(10), torch.nn.Linear(10, 1))
    with torch.no_grad():
        model[0].weight.fill_(0.5)
    model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanfast.watch(model, opt, action="skip") as w:
            for scale in (1.0, 1.0, 30000.0):
                opt.zero_grad()
                model((torch.rand(8, 10, generator=g) * scale).half()).float().pow(2).mean().backward()
                opt.step()
    nonfinite = [e for e in w.events if e.kind == "nonfinite"]
    assert [(e.phase, e.name) for e in nonfinite] == [("forward", "0")]
    assert [(e.phase, e.name) for e in w.events if e.kind == "headroom"] == [("input", "input")]
