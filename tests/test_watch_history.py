"""The watch's health timeline: a record per checked step whose values match a float64 torch reference,
read with the step's one host read; w.history, w.save, and log_to (a JSONL stream, TensorBoard's real
SummaryWriter, a callable)."""

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast
from nanfast.watcher import StepRecord
from op_recorder import OpRecorder
from torch.utils._python_dispatch import TorchDispatchMode

KEYS = {"step", "loss", "losses", "grad_norm", "param_norm", "grad_max_abs", "nan", "posinf", "neginf", "headroom",
        "headroom_place", "loss_scale", "skipped", "scaler_skipped", "rolled_back", "events"}


@pytest.fixture(autouse=True)
def one_thread(restore_num_threads):
    torch.set_num_threads(1)  # tiny models: more threads only contend for the cores

def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 8, generator=g) * scale
    return x, torch.randint(0, 4, (16,), generator=g)


def reference(model, losses):
    """What the step's record must hold, computed one tensor at a time in float64 right before the step."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    return {"grad_norm": math.sqrt(sum(g.double().square().sum().item() for g in grads)),
            "param_norm": math.sqrt(sum(p.double().square().sum().item() for p in params)),
            "grad_max_abs": max(g.double().abs().max().item() for g in grads),
            "losses": {name: sum(v.double().mean().item() for v in vs) / len(vs) for name, vs in losses.items()}}


def train(model, opt, w, steps, microbatches=1, aux=False, expected=None, scales=None):
    for s in range(steps):
        opt.zero_grad()
        seen = {}
        for m in range(microbatches):
            x, y = batch(s * microbatches + m, (scales or {}).get(s, 1.0))
            out = model(x)
            loss = w.loss(F.cross_entropy(out, y, reduction="none"), "ce")  # per-sample: the mean is the record's
            seen.setdefault("ce", []).append(loss.detach().clone())
            total = loss.mean()
            if aux:
                reg = w.loss(out.square().mean() * 0.01, "aux")
                seen.setdefault("aux", []).append(reg.detach().clone())
                total = total + reg
            total.backward()
        if expected is not None:
            expected.append(reference(model, seen))
        opt.step()


def assert_matches(record, ref, params_read=True):
    for key in ("grad_norm", "param_norm"):  # the kernels sum float32 squares in float32 lanes: 1e-9 apart here
        if key == "param_norm" and not params_read:
            assert record.param_norm is None  # not read at this step: unknown, never a stale or zero value
            continue
        assert getattr(record, key) == pytest.approx(ref[key], rel=1e-6, abs=0), key
    assert record.grad_max_abs == ref["grad_max_abs"]  # a max is exact
    assert record.losses.keys() == ref["losses"].keys()
    for name, value in ref["losses"].items():
        assert record.losses[name] == pytest.approx(value, rel=1e-12, abs=0), name
    assert record.loss == record.losses[next(iter(ref["losses"]))]


@pytest.mark.parametrize("sync,params_every", [("eager", 1), ("eager", 4), ("lagged", 4)])
def test_records_match_a_float64_reference_on_a_real_loop(sync, params_every):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    expected = []
    with nanfast.watch(model, opt, sync=sync, params_every=params_every) as w:
        train(model, opt, w, 6, microbatches=2, aux=True, expected=expected)
    records = w.history
    assert [r.step for r in records] == list(range(6))
    for record, ref in zip(records, expected):
        # The parameters are read every params_every steps, by a lagged CPU watch too (its records are
        # finite; an accelerator's lagged watch would read them at every step).
        assert_matches(record, ref, params_read=record.step % params_every == 0)
        assert (record.nan, record.posinf, record.neginf, record.events, record.skipped) == (0, 0, 0, (), False)
        assert list(record.losses) == ["ce", "aux"] and record.loss_scale is None
    assert w.stats()["grad_norm"] == records[-1].grad_norm


def test_stats_of_an_inference_step_hold_no_gradient_norms():
    """An inference step's pass reads no gradients: w.stats() said grad_norm 0.0 and grad_max_abs 0.0
    where w.history said None (a probe, session 49); it leaves them out, as param_norm when unread."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    with nanfast.watch(model) as w:
        for _ in range(3):
            with torch.no_grad():
                model(torch.randn(3, 4))
    assert w.history[-1].grad_norm is None and w.history[-1].grad_max_abs is None
    assert w.stats() == {"step": 2.0, "nan": 0.0, "posinf": 0.0, "neginf": 0.0}


def count_syncs(fn):
    with OpRecorder() as counter:
        fn()
    return counter.host_syncs


def _loss_values():
    """Loss values of every kind Watch.loss takes: one element (the direct path of NOTE: [A loss's mean
    without ATen ops]) in each 16-, 32- and 64-bit float, 0-dim, [1], a strided one-element view, a
    negative view and special values; and several elements, none, or a graph (ATen's mean)."""
    g = torch.Generator().manual_seed(7)
    specials = [0.0, -0.0, 1.5, -3.25e-30, 6e4, float("nan"), float("inf"), float("-inf"), 1e-310]
    values = [torch.tensor(v, dtype=dtype) for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
              for v in specials]
    values += [torch.randn(1, generator=g), torch.randn(4, 5, generator=g, dtype=torch.float64).t()[2:3, 1],
               torch._neg_view(torch.tensor(2.5)), torch.randn(64, generator=g), torch.randn(3, 7, generator=g).t(),
               torch.randn(33, generator=g).to(torch.bfloat16), torch.empty(0),
               torch.randn((), generator=g, requires_grad=True) * 3, torch.randn(8, generator=g, requires_grad=True) * 3]
    return values


@pytest.mark.parametrize("index", range(len(_loss_values())))
def test_loss_mean_equals_the_float64_mean_with_no_graph_and_no_host_read(index):
    value = _loss_values()[index]
    with OpRecorder() as ops:
        mean = nanfast._C.loss_mean(value)
    assert ops.host_syncs == 0
    expected = value.detach().mean(dtype=torch.float64)
    assert mean.dtype == torch.float64 and mean.shape == () and mean.device == value.device
    assert not mean.requires_grad and mean.grad_fn is None
    torch.testing.assert_close(mean, expected, rtol=0, atol=0, equal_nan=True)  # the same number, bit for bit
    assert math.copysign(1, mean.item()) == math.copysign(1, expected.item())  # zero's sign as ATen's (-0 gives +0)


def test_loss_mean_of_a_tensor_subclass_is_the_mean_of_the_values_it_holds():
    # A wrapper subclass's own storage holds no values. Its own mean (a TwoTensor) went into the step's
    # summary, which no read could turn into numbers: the step failed (session 41). The mean is taken
    # over the plain tensors it holds (NOTE: [Tensor subclasses read through their plain tensors]).
    from torch.testing._internal.two_tensor import TwoTensor

    mean = nanfast._C.loss_mean(TwoTensor(torch.tensor(1.5), torch.tensor(-2.5)))
    assert type(mean) is torch.Tensor and mean.dtype == torch.float64 and mean.item() == -0.5


def test_loss_mean_rejects_a_value_that_is_not_floating():
    with pytest.raises(RuntimeError, match="nanfast._C.loss_mean: value must be a floating tensor, got Long"):
        nanfast._C.loss_mean(torch.tensor(3))


def test_an_empty_loss_adds_no_mean_to_the_records():
    """A per-sample loss of a batch with nothing left (every sample masked out) has no values: ATen's mean
    of it is NaN, which went into the step's record as a NaN loss with no event (session 41's probe).
    The empty microbatch adds nothing; the step's loss is the other microbatch's mean, or none at all."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt, history=10)
    for step, kept in enumerate([(16, 16), (0, 16), (0, 0)]):
        opt.zero_grad()
        means = []
        for m, n in enumerate(kept):
            x, y = batch(2 * step + m)
            per_sample = w.loss(F.cross_entropy(model(x), y, reduction="none")[:n])
            means += [per_sample.double().mean().item()] if n else []
            per_sample.sum().backward()
        opt.step()
        record = w.history[-1]
        assert w.events == [] and record.step == step
        if means:
            assert record.loss == pytest.approx(sum(means) / len(means), rel=1e-12, abs=0)
        else:
            assert record.loss is None and record.losses == {}
    w.remove()


@pytest.mark.parametrize("sync,every,expected", [("eager", 1, [1, 1, 1, 1]), ("eager", 2, [1, 0, 1, 0]),
                                                 ("lagged", 1, [0, 0, 0, 0])])
def test_one_host_read_per_checked_step_with_history_spikes_and_a_stream(tmp_path, sync, every, expected):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    received = []
    with nanfast.watch(model, opt, sync=sync, every=every, log_to=[tmp_path / "run.jsonl", received.append],
                       spikes=dict(warmup=1)) as w:
        counts = [count_syncs(lambda: train(model, opt, w, 1, aux=True)) for _ in range(4)]
    assert counts == expected
    assert len(w.history) == len(received) == 4 // every
    assert all(r.loss is not None and r.grad_norm > 0 for r in w.history)


class BlockingReads(TorchDispatchMode):
    """Counts what blocks the host on the device: .item() and friends (aten._local_scalar_dense), and
    copies from a CUDA tensor to the CPU that are not non_blocking (.tolist(), .cpu())."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name == "aten._local_scalar_dense.default":
            self.count += 1
        elif name == "aten._to_copy.default" and args[0].is_cuda and str(kwargs.get("device", "")).startswith("cpu"):
            self.count += not kwargs.get("non_blocking", False)
        elif name == "aten.copy_.default" and args[1].is_cuda and not args[0].is_cuda:
            self.count += not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return func(*args, **kwargs)


def blocking_reads(fn):
    with BlockingReads() as counter:
        fn()
    return counter.count


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU a read does not block")
def test_cuda_one_blocking_read_brings_the_whole_summary():
    """Before, an eager watch read only the flag and left the norms on the device: w.stats() made a
    second blocking transfer. Now the step's one read brings the summary (norms, losses, module norms)
    through a non-blocking copy ordered before the flag's .item()."""
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_and_stats():
        x, y = batch(0)
        opt.zero_grad()
        w.loss(F.cross_entropy(model(x.cuda()), y.cuda())).backward()
        opt.step()
        return w.stats()

    with nanfast.watch(model, opt) as w:
        step_and_stats()  # first step: caches warm
        assert blocking_reads(step_and_stats) == 1
    assert w.history[-1].grad_norm == w.stats()["grad_norm"] > 0 and w.history[-1].loss > 0


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_save_round_trip_and_a_bad_step(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with nanfast.watch(model, opt, action="skip") as w:
            train(model, opt, w, 5, scales={3: float("nan")})
    w.save(tmp_path / "run.jsonl")
    header, *lines = read_lines(tmp_path / "run.jsonl")
    assert header["nanfast"] == nanfast.__version__ and header["model"] == "Sequential" and "step" not in header
    assert lines == [r.to_dict() for r in w.history] and all(set(line) == KEYS for line in lines)
    bad = lines[3]
    assert bad["skipped"] and bad["nan"] > 0 and bad["loss"] is None  # JSON has no NaN: null
    assert [(e["kind"], e["phase"]) for e in bad["events"]] == [("nonfinite", "input")]
    assert bad["events"][0]["summary"] == w.events[0].summary()
    assert not any(line["skipped"] or line["events"] for i, line in enumerate(lines) if i != 3)
    assert math.isnan(w.history[3].loss)  # the record itself keeps the value


def test_history_is_bounded_and_zero_keeps_none(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, history=3) as w:
        train(model, opt, w, 5)
    assert [r.step for r in w.history] == [2, 3, 4]
    with nanfast.watch(model, opt, history=0) as w:
        train(model, opt, w, 2)
    assert w.history == []
    w.save(tmp_path / "empty.jsonl")
    assert len(read_lines(tmp_path / "empty.jsonl")) == 1  # the header only


def test_records_made_when_read_equal_the_ones_a_sink_gets_at_once(tmp_path):
    """Without a sink a record's values are kept and the StepRecord is made when w.history is read (NOTE:
    [Records made when read]); with one it is made at the step. Both ways give the same records, over
    healthy steps, a skipped bad one, several losses and a bounded history, read midway and at the end."""
    kept = {}
    for way, log_to in (("when read", None), ("at once", [lambda scalars: None])):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with nanfast.watch(model, opt, action="skip", history=4, log_to=log_to) as w:
                train(model, opt, w, 3, aux=True)
                midway = w.history
                train(model, opt, w, 3, aux=True, scales={1: float("inf")})
        kept[way] = (midway, w.history, w.stats())
    as_dicts = {way: [[r.to_dict() for r in records] for records in found[:2]] for way, found in kept.items()}
    assert as_dicts["when read"] == as_dicts["at once"]  # dicts: the bad step's loss is NaN, unequal to itself
    midway, last, stats = kept["when read"]
    assert [r.step for r in midway] == [0, 1, 2] and [r.step for r in last] == [2, 3, 4, 5]
    assert all(isinstance(r, StepRecord) for r in midway + last)
    bad = last[2]
    assert bad.skipped and bad.nan + bad.posinf + bad.neginf > 0 and bad.events and math.isnan(bad.loss)
    assert last[-1].grad_norm == stats["grad_norm"] > 0 and last[-1].grad_max_abs == stats["grad_max_abs"]
    assert set(last[-1].losses) == {"ce", "aux"} and not last[-1].skipped


def test_stream_is_written_a_line_per_step_and_closed_by_remove(tmp_path):
    path = tmp_path / "stream.jsonl"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, opt, log_to=str(path), history=0)
    train(model, opt, w, 3)
    lines = read_lines(path)  # flushed at each step: readable while the run goes on
    assert len(lines) == 4 and [line["step"] for line in lines[1:]] == [0, 1, 2]
    assert all(line["loss"] > 0 and line["grad_norm"] > 0 for line in lines[1:])
    stream = w._timeline._sinks[0]
    w.remove()
    assert stream._file.closed


def test_a_callable_receives_flat_numbers():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    received = []
    with nanfast.watch(model, opt, log_to=received.append, params_every=1) as w:
        train(model, opt, w, 3, aux=True)
    assert len(received) == 3
    for got, record in zip(received, w.history):
        assert all(k.startswith("nanfast/") and isinstance(v, float) for k, v in got.items())
        assert got["nanfast/step"] == record.step and got["nanfast/grad_norm"] == record.grad_norm
        assert got["nanfast/loss"] == record.loss and got["nanfast/loss/aux"] == record.losses["aux"]
        assert got["nanfast/param_norm"] == record.param_norm and got["nanfast/nan"] == 0.0
        assert "nanfast/loss_scale" not in got  # unknown values are left out


def test_tensorboard_summary_writer_receives_the_values(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, log_to=writer, params_every=1) as w:
        train(model, opt, w, 4)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    for key in ("grad_norm", "param_norm", "loss", "grad_max_abs"):
        scalars = events.Scalars(f"nanfast/{key}")
        assert [s.step for s in scalars] == [0, 1, 2, 3]
        for s, record in zip(scalars, w.history):
            assert s.value == pytest.approx(getattr(record, key), rel=1e-6)  # stored as float32


def test_loss_scale_comes_from_the_grad_scaler_with_the_read():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    scales = []
    with nanfast.watch(model, opt, scaler=scaler) as w:
        for s in range(5):
            opt.zero_grad()
            x, y = batch(s)
            loss = w.loss(F.cross_entropy(model(x), y))
            scaler.scale(loss).backward()
            scales.append(scaler.get_scale())
            scaler.step(opt)
            scaler.update()
    assert [r.loss_scale for r in w.history] == scales == [1024.0, 1024.0, 2048.0, 2048.0, 4096.0]
    # the gradients are read after the scaler unscaled them
    assert w.history[0].grad_norm < 100


def test_options_are_checked():
    model = mlp()
    with pytest.raises(ValueError, match="history must be an int >= 0"):
        nanfast.watch(model, history=-1)
    with pytest.raises(TypeError, match="log_to entries must be a path"):
        nanfast.watch(model, log_to=42)
    assert not model._forward_hooks  # nothing installed


@pytest.mark.parametrize("second", [42, "same", "taken"])
def test_a_refused_log_to_list_leaves_its_files_as_they_were(tmp_path, second):
    """A log_to list refused for its second entry (of no sink type, the first file again, a file another
    watch writes) opens none of its files: the first one's earlier records are still there."""
    model = mlp()
    kept = tmp_path / "earlier-run.jsonl"
    kept.write_text('{"step": 0}\n')
    taken = tmp_path / "taken.jsonl"
    with nanfast.watch(mlp(), log_to=taken):
        entry = {"same": str(kept), "taken": taken}.get(second, second)
        with pytest.raises((TypeError, ValueError), match="log_to"):
            nanfast.watch(model, log_to=[kept, entry])
    assert kept.read_text() == '{"step": 0}\n'
    assert not model._forward_hooks


def test_record_to_dict_has_exactly_the_documented_keys():
    assert set(StepRecord(step=0).to_dict()) == KEYS


@pytest.mark.parametrize("sync", ["eager", "lagged"])
@pytest.mark.parametrize("bad_last", [False, True])
def test_a_with_block_left_by_an_exception_keeps_its_last_step(tmp_path, sync, bad_last):
    """A lagged watch's last completed step was still pending when an exception (Ctrl-C, a crash) left the
    `with` block, and was dropped: the timeline, streamed so that a crashed run keeps it, lacked the step
    before the crash (a probe, session 43). It is kept now, a bad one's event too, and nothing is acted on:
    the exception that left the block is the one raised."""
    path = tmp_path / "run.jsonl"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyboardInterrupt):
        with nanfast.watch(model, opt, sync=sync, log_to=path) as w:
            for step in range(4):
                opt.zero_grad()
                x, y = batch(step)
                if bad_last and step == 3:
                    x[0, 0] = float("nan")
                w.loss(F.cross_entropy(model(x), y)).backward()
                if not (bad_last and step == 3 and sync == "eager"):  # eager raises there, a step before the crash
                    opt.step()
            raise KeyboardInterrupt
    steps = [line["step"] for line in map(json.loads, path.read_text().splitlines()) if "step" in line]
    expected = [0, 1, 2] if bad_last and sync == "eager" else [0, 1, 2, 3]
    assert steps == [r.step for r in w.history] == expected
    assert [e.step for e in w.events] == ([3] if bad_last and sync == "lagged" else [])
