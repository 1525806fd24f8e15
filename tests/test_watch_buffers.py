"""The module buffers a training forward writes are checked after it (NOTE: [Buffers a forward writes]):
BatchNorm's running statistics turned non-finite while its output stays finite, named and skipped; the
buffers that already hold NaN/inf when listed (masks, observers' bounds) left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanfast
from op_recorder import OpRecorder


def _float16_batchnorm() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1)).half()


def _batches(bad: int, n: int = 4) -> list[torch.Tensor]:
    """float16 batches; batch `bad` is scaled so that the Linear's outputs stay finite (~4e4) while their
    variance (~1e9) passes float16's largest value."""
    g = torch.Generator().manual_seed(1)
    return [(torch.rand(8, 10, generator=g) * (60000.0 if i == bad else 1.0)).half() for i in range(n)]


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for x in batches:
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def test_a_float16_batchnorm_whose_running_var_overflows_is_named_and_skipped():
    """pytorch/pytorch#115500: the batch's variance passes float16's max, so BatchNorm's running_var
    becomes +inf while every activation, the loss and the gradients stay finite. The watch said nothing,
    and model.eval() then output the last Linear's bias alone."""
    model = _float16_batchnorm()
    reference = _float16_batchnorm()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, reference))
    batches = _batches(bad=2)
    with pytest.warns(RuntimeWarning, match="skipped"):
        with nanfast.watch(model, opt, action="skip", headroom=None) as w:
            _train(model, opt, batches)
    (event,) = w.events
    assert (event.step, event.phase, event.name) == (2, "buffer", "1.running_var")
    assert (event.nan, event.posinf, event.neginf) == (0, 10, 0)
    assert "non-finite values first appeared in the buffer 1.running_var after the forward" in event.summary()
    assert w.skipped_steps == 1
    # As if the bad batch never came: the statistics and weights of a run without it.
    _train(reference, ref_opt, batches[:2] + batches[3:])
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(mine, theirs), name
    model.eval()
    assert model(batches[0]).unique().numel() > 1  # not the bias alone


def test_a_raising_watch_names_the_buffer_and_puts_it_back():
    model = _float16_batchnorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanfast.watch(model, opt, headroom=None):
        _train(model, opt, _batches(bad=-1, n=2))
        with pytest.raises(nanfast.NonFiniteError, match=r"buffer 1\.running_var after the forward"):
            _train(model, opt, _batches(bad=0, n=1))
    assert torch.isfinite(model[1].running_var).all()


def test_a_healthy_run_is_silent_and_adds_no_host_read():
    model = _float16_batchnorm().float()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [x.float() for x in _batches(bad=-1)]
    with nanfast.watch(model, opt) as w:
        _train(model, opt, batches[:1])
        with OpRecorder() as ops:
            model(batches[1])  # the buffers' record is in the forward's post-hook
        assert ops.host_syncs == 0
        _train(model, opt, batches[2:])
    assert w.events == []


class Masked(nn.Module):
    """A float causal mask of -inf kept in a buffer, and a quantization observer whose bounds stay at
    +inf/-inf because it is never called: both intended, from before the watch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("causal", torch.full((4, 4), float("-inf")).triu(1))
        self.observer = torch.ao.quantization.MinMaxObserver()

    def forward(self, x):
        scores = (self.lin(x)[:, None, :] + self.causal).softmax(-1)
        return self.bn(scores.sum(1))


def test_buffers_that_held_nan_or_inf_when_listed_are_intended():
    torch.manual_seed(0)
    model = Masked()
    assert torch.isinf(model.observer.min_val) and torch.isinf(model.causal).any()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt) as w:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    assert w.events == []


def test_ignore_and_params_false_leave_the_buffers_unchecked():
    for options in (dict(ignore="1.running_*"), dict(params=False)):
        model = _float16_batchnorm()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with nanfast.watch(model, opt, headroom=None, **options) as w:
            _train(model, opt, _batches(bad=0, n=1))
        assert w.events == [], options
        assert torch.isinf(model[1].running_var).any()  # what the check would have found


def test_a_batchnorm_added_after_watch_is_checked_from_the_next_step():
    model = nn.Sequential(nn.Linear(10, 10)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanfast.watch(model, opt, action="skip", headroom=None) as w:
        _train(model, opt, _batches(bad=-1, n=1))
        model.append(nn.BatchNorm1d(10).half())  # a head swapped in: listed at the next step's start
        with pytest.warns(RuntimeWarning, match="skipped"):
            _train(model, opt, _batches(bad=0, n=1))
    assert [(e.phase, e.name) for e in w.events] == [("buffer", "1.running_var")]
    assert torch.isfinite(model[1].running_var).all()


def test_an_evaluation_forward_reads_no_buffer():
    model = _float16_batchnorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanfast.watch(model, opt, headroom=None) as w:
        _train(model, opt, _batches(bad=-1, n=1))
        model[1].running_var.fill_(float("inf"))  # as a bad step left it (with action="warn")
        model.eval()
        with torch.no_grad():
            model(_batches(bad=-1, n=1)[0])
    assert w.events == []  # eval mode writes no buffer: what the training step left was its to report


@pytest.mark.filterwarnings("ignore:nanfast.watch. 4 trainable parameter")  # the lazy ones, not in the optimizer
def test_a_lazy_batchnorm_is_checked_once_its_first_forward_made_its_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.LazyBatchNorm1d(), nn.Linear(10, 1)).half()
    assert isinstance(model[1].running_var, torch.nn.parameter.UninitializedBuffer)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.01)
    with nanfast.watch(model, opt, action="skip", headroom=None) as w:
        _train(model, opt, _batches(bad=-1, n=1))  # materializes the buffers
        with pytest.warns(RuntimeWarning, match="skipped"):
            _train(model, opt, _batches(bad=0, n=1))
    assert [(e.phase, e.name) for e in w.events] == [("buffer", "1.running_var")]


def test_a_float16_buffer_near_its_max_gets_a_headroom_warning_naming_it():
    model = _float16_batchnorm()
    model[1].running_var.fill_(30000.0)  # 0.9 of it after the next forward: 41% of float16's max
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(RuntimeWarning, match="headroom|float16's max"):
        with nanfast.watch(model, opt, headroom=(0.25,)) as w:
            _train(model, opt, _batches(bad=-1, n=1))
    assert [(e.kind, e.phase, e.name) for e in w.events] == [("headroom", "buffer", "1.running_var")]
    assert w.events[0].detail.startswith("buffer 1.running_var after the forward at 41% of float16's max")


def test_each_microbatch_of_an_accumulated_step_is_named():
    model = _float16_batchnorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanfast.watch(model, opt, action="skip", headroom=None) as w:
        opt.zero_grad()
        with pytest.warns(RuntimeWarning, match="skipped"):
            for x in _batches(bad=1, n=2):
                model(x).float().pow(2).mean().backward()
            opt.step()
    assert [(p.phase, p.name, p.microbatch) for p in w.events[0].places] == [("buffer", "1.running_var", 1)]


class CachedMask(nn.Module):
    """A causal mask cached in a buffer by the first forward, an empty placeholder before it."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(10, 10)
        self.register_buffer("mask", torch.empty(0), persistent=False)

    def forward(self, x):
        n = x.shape[1]
        if self.mask.shape[-1] < n:
            self.mask = torch.full((n, n), float("-inf")).triu(1)
        return (self.q(x) @ x.transpose(1, 2) + self.mask[:n, :n]).softmax(-1) @ x


def test_a_mask_cached_in_a_buffer_after_watch_may_hold_minus_inf():
    """The placeholder was finite when listed, so its -inf mask read as a fault: every step skipped and the
    model never trained (a probe)."""
    model = CachedMask()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanfast.watch(model, opt, action="skip") as w:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 5, 10)).pow(2).mean().backward()
            opt.step()
    assert w.events == [] and w.skipped_steps == 0


def test_a_compiled_forwards_buffers_are_read_at_the_steps_end():
    """A compiled forward runs none of the watch's hooks: the overflowed running_var went unseen."""
    model = _float16_batchnorm()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(RuntimeWarning, match="skipped"):
        with nanfast.watch(compiled, opt, action="skip", headroom=None) as w:
            _train(compiled, opt, _batches(bad=1, n=3))
    assert [(e.step, e.phase, e.name, e.forward_unchecked) for e in w.events] == [(1, "buffer", "1.running_var", True)]
    assert torch.isfinite(model[1].running_var).all()


def test_a_batchnorm_adapted_in_train_mode_under_an_eval_model_is_read():
    model = _float16_batchnorm().eval()
    model[1].train()  # test-time adaptation: only the BatchNorm updates its statistics
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanfast.watch(model, opt, action="skip", headroom=None) as w:
        with pytest.warns(RuntimeWarning, match="skipped"):
            _train(model, opt, _batches(bad=0, n=1))
    assert [(e.phase, e.name) for e in w.events] == [("buffer", "1.running_var")]
    assert torch.isfinite(model[1].running_var).all()


def test_a_buffer_a_bad_step_left_non_finite_stays_checked_when_the_model_changes():
    """Listed again after the model gained a module, a running_var a bad step had made +inf (with
    action="warn") was judged intended and never reported again."""
    model = _float16_batchnorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(RuntimeWarning, match="running_var"):
        with nanfast.watch(model, opt, action="warn", headroom=None) as w:
            _train(model, opt, _batches(bad=0, n=1))
            model.append(nn.Identity())  # listed again at the next step
            _train(model, opt, _batches(bad=-1, n=1))
    assert [(e.step, e.name) for e in w.events] == [(0, "1.running_var"), (1, "1.running_var")]


class FilledLater(nn.Module):
    """A buffer registered as None, given a tensor by the forward (an assignment to a name it has)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("last", None)

    def forward(self, x):
        self.last = x.mean(0).detach() * 1e39  # float32 overflow: +inf
        return self.lin(x)


def test_a_buffer_registered_as_none_is_read_once_it_holds_a_tensor():
    model = FilledLater()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nanfast.NonFiniteError, match="buffer last after the forward"):
        with nanfast.watch(model, opt):
            opt.zero_grad()
            model(torch.rand(2, 4) + 1).sum().backward()
            opt.step()
