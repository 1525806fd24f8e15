"""locate on healthy models: reports of NaN gradients that torch has since fixed by masking 0/0 inside
the backward formula. The model is healthy (loss and every gradient finite), so locate, locate_step and
watch(on_event="locate") must stay silent; a model with one real bug and one of these patterns must get
the real bug named. Each case cites the public report it reproduces."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast
from grounding import first_made
from nanfast.locator import StepState, locate_step


def normalize_zero_vector():
    # pytorch/pytorch#2421 (the gradient of a zero norm was NaN); F.normalize takes that norm.
    x = torch.randn(4, 3)
    x[1] = 0.0
    x.requires_grad_()
    return [x], lambda: F.normalize(x, dim=1).sum()


def std_of_constant_row():
    # pytorch/pytorch#4320 (torch.std NaN gradient on a constant input)
    x = torch.randn(4, 5)
    x[2] = 3.0
    x.requires_grad_()
    return [x], lambda: x.std(dim=1).sum()


def atan2_at_origin():
    # pytorch/pytorch#98276 (torch.atan2 NaN gradient when the input is exactly (0, 0))
    y = torch.tensor([0.0, 1.0], requires_grad=True)
    x = torch.tensor([0.0, 2.0], requires_grad=True)
    return [y, x], lambda: torch.atan2(y, x).sum()


def _atan2_is_healthy_at_the_origin() -> bool:
    y, x = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    torch.atan2(y, x).sum().backward()
    return bool(y.grad.isfinite().all() and x.grad.isfinite().all())


# Older torch (2.8) gives atan2 a NaN gradient at (0, 0) itself: there the pattern is a real fault,
# which locate and the watch report, so the cases that call it healthy apply only where torch made it so.
ATAN2_HEALTHY = pytest.mark.skipif(not _atan2_is_healthy_at_the_origin(),
                                   reason=f"torch {torch.__version__} gives atan2 a NaN gradient at the origin")


def angle_at_origin():
    # pytorch/pytorch#98276 (torch.angle NaN gradient at 0)
    c = torch.tensor([0j, 1 + 1j], requires_grad=True)
    return [c], lambda: torch.angle(c).sum()


def cdist_of_a_batch_with_itself():
    # pytorch/pytorch#37154 (cdist NaN gradients from 1.5 on; zero distances on the diagonal; > 25 rows
    # takes the matmul path of the report)
    x = torch.randn(40, 3, requires_grad=True)
    return [x], lambda: torch.cdist(x, x).sum()


def cdist_fractional_p_with_equal_coordinates():
    # pytorch/pytorch#36493 (cdist p < 1 NaN gradients where a coordinate difference is 0)
    x = torch.randn(5, 3, requires_grad=True)
    shift = torch.tensor([1.0, 0.0, 0.0])
    return [x], lambda: torch.cdist(x, (x + shift).detach(), p=0.5).sum()


def pow_with_learnable_exponent_at_zero_base():
    # pytorch/pytorch#27134 (d/db a**b is NaN at a = 0 instead of 0)
    b = torch.ones(2, requires_grad=True)
    a = torch.tensor([0.0, 2.0])
    return [b], lambda: (a ** b).sum()


def p_norm_of_pruned_weights():
    # pytorch/pytorch#3264 (norms other than p=2 had NaN gradients at 0, "the same treatment as #2421")
    w = torch.randn(4, 3)
    w[1] = 0.0  # a pruned row
    w.requires_grad_()
    return [w], lambda: torch.linalg.vector_norm(w, ord=3, dim=1).sum()


def fractional_p_norm_with_a_zero_entry():
    # pytorch/pytorch#44452 (norm can't backpropagate with 0 < p < 1: NormBackward1 returned nan)
    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    return [x], lambda: x.norm(p=0.5)


def sdpa_with_a_fully_masked_row():
    # pytorch/pytorch#103749 (SDPA produces NaN with a padding mask that masks a query row whole); torch's
    # SDPA now returns zeros for such rows, forward and backward
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[2] = False
    return [q], lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()


HEALTHY = [sdpa_with_a_fully_masked_row, fractional_p_norm_with_a_zero_entry, normalize_zero_vector,
           std_of_constant_row, pytest.param(atan2_at_origin, marks=ATAN2_HEALTHY), angle_at_origin,
           cdist_of_a_batch_with_itself, cdist_fractional_p_with_equal_coordinates,
           pow_with_learnable_exponent_at_zero_base, p_norm_of_pruned_weights]


def _step(leaves, loss_fn):
    def step():
        for t in leaves:
            t.grad = None
        loss_fn().backward()
    return step


@pytest.mark.parametrize("case", HEALTHY)
def test_healthy_model_is_healthy_and_locate_stays_silent(case):
    torch.manual_seed(0)
    leaves, loss_fn = case()
    step = _step(leaves, loss_fn)
    step()
    assert loss_fn().isfinite() and all(t.grad.isfinite().all() for t in leaves)  # the model is healthy
    assert first_made(step) is None  # the independent tracer agrees

    with nanfast.locate():  # raises on any finding
        step()
    with nanfast.locate(action="record") as region:
        step()
    assert region.findings == []
    assert locate_step(step, StepState.capture(leaves)) is None


@pytest.mark.parametrize("case", [normalize_zero_vector, std_of_constant_row,
                                  pytest.param(atan2_at_origin, marks=ATAN2_HEALTHY),
                                  pow_with_learnable_exponent_at_zero_base, p_norm_of_pruned_weights])
def test_what_a_node_masked_is_kept_as_a_note(case):
    leaves, loss_fn = case()
    with nanfast.locate(action="record") as region:
        _step(leaves, loss_fn)()
    assert region.findings == [] and region.masked
    assert all(note.phase == "backward" and note.node for note in region.masked)


class HealthyPatterns(torch.nn.Module):
    """A small model that runs every pattern above on its activations."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.exponent = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        h = self.linear(x) * torch.tensor([[1.0], [0.0], [1.0], [1.0]])  # row 1 is all zeros
        return (F.normalize(h, dim=1).sum() + h.std(dim=1).sum() + torch.atan2(h[:, 0], h[:, 1]).sum()
                + torch.cdist(h, h).sum() + h.abs().pow(self.exponent).sum()
                + torch.linalg.vector_norm(h, ord=3, dim=1).sum())


@ATAN2_HEALTHY
def test_watch_with_locate_stays_silent_on_a_healthy_model():
    torch.manual_seed(0)
    model = HealthyPatterns()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 3)

    def rerun():
        model(x).backward()

    w = nanfast.watch(model, optimizer, on_event="locate", rerun=rerun)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            rerun()
            optimizer.step()
    w.remove()
    assert w.events == [] and w.step_count == 3
    assert all(p.isfinite().all() for p in model.parameters())
    with nanfast.locate():
        rerun()


class RealBugBesideAHarmlessPattern(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x):
        h = self.linear(x)
        spread = torch.sqrt(h.pow(2).sum(dim=1) - h.pow(2).sum(dim=1))  # <real-bug> sqrt(0): inf gradient
        zeroed = h * torch.tensor([[1.0], [0.0], [1.0], [1.0]])
        return spread.sum() + F.normalize(zeroed, dim=1).sum()  # harmless; its backward runs first


def test_the_real_bug_is_named_not_the_harmless_pattern_before_it():
    torch.manual_seed(0)
    model = RealBugBesideAHarmlessPattern()
    x = torch.randn(4, 3)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).backward()

    grounded = first_made(step)
    assert grounded is not None and grounded.node == "SqrtBackward0"
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            step()
    finding = raised.value.report
    assert (finding.op, finding.phase, finding.node) == (grounded.op, "backward", "SqrtBackward0")
    assert finding.where.filename == __file__
    assert "<real-bug>" in open(__file__).read().splitlines()[finding.where.lineno - 1]
    with nanfast.locate(action="record") as region:
        step()
    assert [f.node for f in region.findings] == ["SqrtBackward0"]
    assert "LinalgVectorNormBackward0" in {note.node for note in region.masked}


def test_watch_event_and_its_finding_agree_on_the_real_bug():
    torch.manual_seed(0)
    model = RealBugBesideAHarmlessPattern()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 3)

    def rerun():
        model(x).backward()

    w = nanfast.watch(model, optimizer, action="skip", on_event="locate", rerun=rerun)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        optimizer.zero_grad(set_to_none=True)
        rerun()
        optimizer.step()
    w.remove()
    [event] = w.events
    assert event.located is not None and event.located.node == "SqrtBackward0"
    assert "<real-bug>" in open(__file__).read().splitlines()[event.located.where.lineno - 1]
    # watch first saw the NaN in linear.weight's gradient; the op that made it ran outside `linear`:
    # the summary says why the two places differ.
    assert (event.first.phase, event.first.name) == ("grad", "linear.weight")
    assert event.located_differs is not None and "the places differ" in event.located_differs
    assert "outside that module's forward" in event.summary()


def test_inf_times_zero_after_a_reported_inf_is_propagation_in_record():
    # The inf that exp makes is reported; the NaN that inf * 0 then makes is the same fault.
    x = torch.tensor([100.0, 1.0])
    with nanfast.locate(action="record") as region:
        big = torch.exp(x * 10)
        torch.log(big * torch.tensor([0.0, 1.0]))
    assert [f.op for f in region.findings] == ["aten.exp.default"]


def test_inf_times_zero_after_an_allowed_inf_is_still_a_producer():
    # An inf from outside locate (a mask built before) is allowed; the NaN it makes is a finding.
    mask = torch.tensor([0.0, float("-inf")])
    with nanfast.locate(action="record") as region:
        mask * torch.tensor([1.0, 0.0])
    assert [(f.kind, f.op) for f in region.findings] == [("producer", "aten.mul.Tensor")]


def test_a_confirmed_backward_finding_dumps_the_inputs_its_op_read(tmp_path):
    # The node is judged after its ops ran (and after the masking ops overwrote their outputs): the dump
    # holds the inputs as the reported op read them.
    path = tmp_path / "backward.pt"
    x = torch.tensor([0.0, 4.0], requires_grad=True)
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate(dump=path):
            torch.sqrt(x).sum().backward()
    finding = raised.value.report
    assert (finding.op, finding.node, finding.dump) == ("aten.div.Tensor", "SqrtBackward0", str(path))
    assert nanfast.replay(path).isinf().tolist() == [True, False]


def test_a_masked_backward_finding_writes_no_dump(tmp_path):
    path = tmp_path / "masked.pt"
    leaves, loss_fn = normalize_zero_vector()
    with nanfast.locate(dump=path) as region:
        loss_fn().backward()
    assert region.masked and not path.exists()


def test_a_node_fed_nan_by_an_earlier_finding_is_not_a_second_producer():
    # log(0) = -inf is reported in forward; the backward nodes downstream receive non-finite gradients,
    # so what they make inside is not judged as new (record mode lists one finding).
    x = torch.tensor([[0.0, 1.0, 2.0]], requires_grad=True)
    with nanfast.locate(action="record") as region:
        F.normalize(torch.log(x) * 0 + x, dim=1).sum().backward()
    assert [(f.op, f.phase) for f in region.findings] == [("aten.log.default", "forward")]


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        torch.zeros_like(x) / x  # 0/0 made inside the node, which then fails before returning
        raise RuntimeError("backward failed")


def test_a_node_that_never_returns_leaves_its_held_finding_as_a_note():
    x = torch.zeros(2, requires_grad=True)
    y = _FailingBackward.apply(x)
    with nanfast.locate(action="record") as region:
        with pytest.raises(RuntimeError, match="backward failed"):
            y.sum().backward(retain_graph=True)
    assert region.findings == [] and [note.op for note in region.masked] == ["aten.div.Tensor"]


class OPTAttention(torch.nn.Module):
    """huggingface/transformers#17437's fix of OPT's float16 attention (#17306): scores plus a mask of
    torch.finfo(dtype).min overflow to -inf where a masked score is negative, then are clamped back."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qk, self.o = torch.nn.Linear(d, 2 * d), torch.nn.Linear(d, d)

    def forward(self, x, attention_mask, clamp: bool = True):
        q, k = self.qk(x).chunk(2, -1)
        w = q @ k.transpose(1, 2) + attention_mask  # <opt-mask>
        if clamp:
            w = torch.max(w, torch.tensor(torch.finfo(w.dtype).min))
        return self.o(F.softmax(w, dim=-1, dtype=torch.float32).to(x.dtype) @ x)  # <opt-softmax>


def _opt_case():
    torch.manual_seed(0)
    model = OPTAttention().half()
    with torch.no_grad():
        model.qk.weight.mul_(8)
    x = torch.randn(2, 4, 8).half()
    keep = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]).bool()
    mask = torch.zeros(2, 1, 4, dtype=torch.half).masked_fill(~keep[:, None, :], torch.finfo(torch.half).min)
    return model, x, mask


def test_a_mask_at_the_dtypes_limit_that_overflows_and_is_clamped_is_silent():
    """The float16 overflow of a finfo.min mask, clamped back at once, was reported at the add: a healthy
    HF model stopped there (a probe, session 43). A mask at the dtype's limit counts as an infinite one."""
    model, x, mask = _opt_case()
    scores = model.qk(x).chunk(2, -1)
    assert torch.isneginf(scores[0] @ scores[1].transpose(1, 2) + mask).any()  # the add overflows
    model(x, mask).float().sum().backward()
    assert all(p.grad.isfinite().all() for p in model.parameters())  # the model is healthy
    model.zero_grad()
    with nanfast.locate(action="record") as region:
        model(x, mask).float().sum().backward()
    assert region.findings == []


def test_a_row_masked_whole_at_the_dtypes_limit_is_found_where_it_becomes_nan():
    """Without the clamp, a row whose every score overflowed to -inf makes NaN in softmax: that is the
    finding (the overflowed mask is no fault of its own)."""
    model, x, _ = _opt_case()
    mask = torch.full((2, 1, 4), torch.finfo(torch.half).min, dtype=torch.half)
    mask[1] = 0
    with torch.no_grad():
        model.qk.bias.fill_(4.0)  # positive queries, negative keys: every masked score is negative
        model.qk.weight.zero_()
        model.qk.bias[8:] = -4.0
    with nanfast.locate(action="record") as region:
        model(x, mask, clamp=False)
    assert [f.op for f in region.findings][:1] == ["aten._softmax.default"]


def test_an_overflow_beside_a_mask_at_the_dtypes_limit_is_found_at_its_op():
    """Scores masked with finfo.min, then divided by a small temperature: the division overflows an
    unmasked score too. Every inf the op made was taken for the mask's, and the softmax after it was
    blamed (a probe, session 52). Only infinities where an input holds the limit are the mask's."""
    scores = torch.tensor([[4000.0, 1.0, 2.0], [1.0, 2.0, 3.0]], dtype=torch.half, requires_grad=True)
    mask = torch.tensor([[False, False, True], [False, False, True]])
    with nanfast.locate(action="record") as region:
        s = scores.masked_fill(mask, torch.finfo(torch.half).min)
        s = s / 0.05  # <temperature>
        F.softmax(s, dim=-1).sum().backward()
    first = region.findings[0]
    assert (first.op, first.kind) == ("aten.div.Tensor", "producer"), first.summary()
    assert "<temperature>" in open(first.source.filename).read().splitlines()[first.source.lineno - 1]
    assert "`other` 0.05 give a result past 65504" in first.diagnosis
    with nanfast.locate(action="record") as region:  # only the masked scores overflow: the mask's, silent
        (scores.detach().clamp(max=100).masked_fill(mask, torch.finfo(torch.half).min) / 0.05).softmax(-1)
    assert region.findings == []
