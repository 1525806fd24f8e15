"""nanfast.locate: the first op that makes NaN/inf, forward and backward, with its node, user line, inputs
and their producers; no report for masking; dumps; locate_step (the watch's re-run).

Source lines are asserted against the line of the test code that ran the op, found by its marker
comment (`# <name>` at the end of the line)."""

from __future__ import annotations

import pathlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import nanfast
from test_watch_state import Boom
from nanfast.locator import LocateFinding, StepState, locate_step

INF = float("inf")
NAN = float("nan")
_SOURCE = pathlib.Path(__file__).read_text().splitlines()


def line(marker: str) -> int:
    hits = [i for i, text in enumerate(_SOURCE, 1) if text.endswith(f"# <{marker}>")]
    assert len(hits) == 1, f"marker <{marker}> must appear once"
    return hits[0]


def assert_line(source, marker: str) -> None:
    assert source is not None
    assert (source.filename, source.lineno) == (__file__, line(marker))


def assert_forward_line(source, marker: str) -> None:
    """A backward op's forward line, which locate records with torch.autograd.graph.node_creation_hook,
    or takes from anomaly mode's stack where torch has no such hook (2.11)."""
    assert_line(source, marker)


def first_finding(fn, *args) -> LocateFinding:
    """Runs fn under locate() and returns what it raised."""
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            fn(*args)
    finding = raised.value.report
    assert isinstance(finding, LocateFinding)
    assert str(raised.value) == str(finding)
    return finding


def findings_of(fn, *args) -> list[LocateFinding]:
    with nanfast.locate(action="record") as region:
        fn(*args)
    return region.findings


def counts(info) -> tuple[int, int, int]:
    return (info.nan, info.posinf, info.neginf)


# --------------------------------------------------------------------------------------------------
# Forward producers
# --------------------------------------------------------------------------------------------------

def log_of(x):
    return torch.log(x)  # <log>


def sqrt_of(x):
    return torch.sqrt(x)  # <sqrt>


def acos_of(x):
    return torch.acos(x)  # <acos>


def asin_of(x):
    return torch.asin(x)  # <asin>


def log1p_of(x):
    return torch.log1p(x)  # <log1p>


def exp_of(x):
    return torch.exp(x)  # <exp>


@pytest.mark.parametrize("fn, bad, op, marker, out_counts", [
    (log_of, -1.0, "aten.log.default", "log", (1, 0, 0)),
    (log_of, 0.0, "aten.log.default", "log", (0, 0, 1)),
    (sqrt_of, -4.0, "aten.sqrt.default", "sqrt", (1, 0, 0)),
    (acos_of, 2.0, "aten.acos.default", "acos", (1, 0, 0)),
    (asin_of, -1.5, "aten.asin.default", "asin", (1, 0, 0)),
    (log1p_of, -2.0, "aten.log1p.default", "log1p", (1, 0, 0)),
    (log1p_of, -1.0, "aten.log1p.default", "log1p", (0, 0, 1)),
    (exp_of, 100.0, "aten.exp.default", "exp", (0, 1, 0)),
])
def test_forward_producer(fn, bad, op, marker, out_counts):
    x = torch.tensor([0.5, bad])
    finding = first_finding(fn, x)
    assert (finding.kind, finding.op, finding.phase, finding.node) == ("producer", op, "forward", None)
    assert_line(finding.source, marker)
    assert finding.where == finding.source and finding.forward_source is None
    assert [counts(o) for o in finding.outputs] == [out_counts]
    [inp] = finding.inputs
    assert (inp.name, inp.shape, inp.dtype, counts(inp)) == ("self", (2,), "float32", (0, 0, 0))
    assert (inp.min, inp.max) == (min(0.5, bad), max(0.5, bad))
    assert inp.producer is None  # x was made before locate
    assert op in finding.summary() and f"{__file__}:{line(marker)}" in finding.summary()


def test_cast_overflow_is_a_producer():
    def narrow(x):
        return x.to(torch.float32)  # <cast>

    finding = first_finding(narrow, torch.tensor([1.0, 1e300], dtype=torch.float64))
    assert (finding.op, finding.phase) == ("aten._to_copy.default", "forward")
    assert_line(finding.source, "cast")
    assert counts(finding.outputs[0]) == (0, 1, 0)


def test_an_op_returning_a_tuple_with_a_tensor_list_has_its_outputs_checked():
    """Outputs (Tensor[], Tensor): the tensors in the list were not checked, so its NaN went unreported."""
    def unscale(grads, found_inf, inv_scale):
        return torch.ops.aten._amp_foreach_non_finite_check_and_unscale(grads, found_inf, inv_scale)  # <unscale>

    finding = first_finding(unscale, [torch.tensor([1.0, INF])], torch.zeros(1), torch.zeros(1))  # inf * 0
    assert (finding.op, finding.kind) == ("aten._amp_foreach_non_finite_check_and_unscale.default", "producer")
    assert_line(finding.source, "unscale")
    assert [counts(out) for out in finding.outputs] == [(1, 0, 0), (0, 0, 0)]


def test_tensors_in_a_list_with_nones_are_named_by_their_position():
    """index_put_'s indices are a Tensor?[]: the index tensor at position 1 was named indices[0] (a None)."""
    x, idx = torch.full((2, 3), INF), torch.tensor([1])
    finding = first_finding(torch.ops.aten.index_put_, x, [None, idx], torch.tensor([-INF]), True)  # inf - inf
    assert [i.name for i in finding.inputs] == ["self", "indices[1]", "values"]


def test_inf_minus_inf_names_the_nan_producer_and_where_its_inputs_came_from():
    def run():
        big = torch.full((3,), INF)  # <full-inf>
        return big - big  # <inf-minus-inf>

    finding = first_finding(run)
    assert (finding.kind, finding.op, finding.phase) == ("producer", "aten.sub.Tensor", "forward")
    assert finding.reason == "made NaN from inputs without NaN"
    assert_line(finding.source, "inf-minus-inf")
    assert counts(finding.outputs[0]) == (3, 0, 0)
    for inp in finding.inputs:
        assert counts(inp) == (0, 3, 0) and (inp.min, inp.max) == (None, None)
        assert inp.producer.op == "aten.full.default"
        assert_line(inp.producer.source, "full-inf")


def test_zero_times_inf_in_a_masked_entropy():
    def masked_entropy(logits, mask):
        logp = torch.log_softmax(logits.masked_fill(mask, -INF), dim=-1)  # <masked-logp>
        return -(logp.exp() * logp).sum(-1)  # <entropy>

    mask = torch.tensor([[False, True, False], [False, False, False]])
    finding = first_finding(masked_entropy, torch.randn(2, 3), mask)
    assert (finding.op, finding.phase) == ("aten.mul.Tensor", "forward")
    assert_line(finding.source, "entropy")
    assert counts(finding.outputs[0]) == (1, 0, 0)
    probs, logp = finding.inputs
    assert probs.min == 0.0 and probs.producer.op == "aten.exp.default"
    assert counts(logp) == (0, 0, 1) and logp.producer.op == "aten._log_softmax.default"
    assert_line(logp.producer.source, "masked-logp")


def test_log_of_underflowed_softmax_shows_softmax_as_the_producer_of_its_input():
    def run(x):
        probs = F.softmax(x, dim=-1)  # <softmax>
        return torch.log(probs)  # <log-probs>

    finding = first_finding(run, torch.tensor([[0.0, 200.0, 1.0]]))
    assert (finding.op, finding.phase) == ("aten.log.default", "forward")
    assert_line(finding.source, "log-probs")
    assert counts(finding.outputs[0]) == (0, 0, 2)
    [probs] = finding.inputs
    assert counts(probs) == (0, 0, 0) and probs.min == 0.0 and probs.max == 1.0
    assert probs.producer.op == "aten._softmax.default" and probs.producer.phase == "forward"
    assert_line(probs.producer.source, "softmax")
    assert "aten._softmax.default" in str(finding)


def test_ctc_loss_with_an_impossible_target_is_inf():
    log_probs = torch.randn(2, 1, 5).log_softmax(-1).requires_grad_()
    targets = torch.tensor([[1, 1, 1]])  # 3 labels (with a repeat) cannot fit in 2 frames

    def run():
        loss = F.ctc_loss(log_probs, targets, torch.tensor([2]), torch.tensor([3]))  # <ctc>
        loss.backward()

    finding = first_finding(run)
    assert (finding.op, finding.phase) == ("aten._ctc_loss.Tensor", "forward")
    assert_line(finding.source, "ctc")
    assert counts(finding.outputs[0]) == (0, 1, 0)
    assert [i.name for i in finding.inputs] == ["log_probs", "targets", "input_lengths", "target_lengths"]
    assert finding.inputs[1].dtype == "int64" and (finding.inputs[1].min, finding.inputs[1].max) == (1, 1)


def test_a_healthy_ctc_loss_is_silent():
    """Every target fits its input: loss and gradients are finite. aten._ctc_loss also returns log_alpha,
    its backward's table of log-probabilities, -inf for every unreachable state: judged as a result, it
    stopped every healthy F.ctc_loss at its forward (a probe, session 43, after meijieru/crnn.pytorch#235
    and pytorch/pytorch#16199; zero_infinity=False is torch's default)."""
    torch.manual_seed(0)
    logits = torch.randn(10, 2, 5, requires_grad=True)
    targets, lengths, target_lengths = torch.tensor([[1, 2], [3, 4]]), torch.tensor([10, 10]), torch.tensor([2, 2])
    with nanfast.locate():
        loss = F.ctc_loss(logits.log_softmax(-1), targets, lengths, target_lengths)
        loss.backward()
    assert loss.isfinite() and logits.grad.isfinite().all()
    log_alpha = torch.ops.aten._ctc_loss(logits.log_softmax(-1), targets, lengths, target_lengths)[1]
    assert torch.isneginf(log_alpha).any()  # what was judged


def test_a_fault_after_a_healthy_ctc_loss_is_the_one_found():
    """The probe's watch(on_event="locate") case: a NaN gradient from sqrt at 0 in a regulariser of an
    ASR loss was blamed on the healthy CTC before it."""
    torch.manual_seed(0)
    logits = torch.randn(10, 2, 5, requires_grad=True)
    w = torch.ones(3, requires_grad=True)

    def run():
        reg = (w - w.detach()).pow(2).sum().sqrt()  # distance 0: its gradient is 0/0
        loss = F.ctc_loss(logits.log_softmax(-1), torch.tensor([[1, 2], [3, 4]]), torch.tensor([10, 10]),
                          torch.tensor([2, 2]))
        (loss + reg).backward()

    finding = first_finding(run)
    assert (finding.phase, finding.node) == ("backward", "SqrtBackward0")


def test_ctc_loss_with_zero_infinity_is_silent():
    # The composite zeroes _ctc_loss's inf (and its gradient): the model is healthy.
    log_probs = torch.randn(2, 1, 5).log_softmax(-1).detach().requires_grad_()
    with nanfast.locate():
        loss = F.ctc_loss(log_probs, torch.tensor([[1, 1, 1]]), torch.tensor([2]), torch.tensor([3]),
                          zero_infinity=True)
        loss.backward()
    assert loss.item() == 0.0 and log_probs.grad.isfinite().all()


# --------------------------------------------------------------------------------------------------
# Backward producers: the forward was finite, a backward formula divides by zero or overflows
# --------------------------------------------------------------------------------------------------

def sqrt_loss(x):
    return torch.sqrt(x).sum()  # <fwd-sqrt>


def acos_loss(x):
    return torch.acos(x).sum()  # <fwd-acos>


def asin_loss(x):
    return torch.asin(x).sum()  # <fwd-asin>


def log_loss(x):
    return torch.log(x).sum()  # <fwd-log>


def rsqrt_loss(x):
    return torch.rsqrt(x).sum()  # <fwd-rsqrt>


def masked_logsumexp_loss(x):
    fully_masked_first_row = torch.tensor([[True, True, True], [False, True, False]])
    return torch.logsumexp(x.masked_fill(fully_masked_first_row, -INF), dim=-1).sum()  # <fwd-logsumexp>


@pytest.mark.parametrize("loss_fn, values, op, node, marker", [
    (sqrt_loss, [[0.0, 4.0]], "aten.div.Tensor", "SqrtBackward0", "fwd-sqrt"),
    (acos_loss, [[1.0, 0.5]], "aten.rsqrt.default", "AcosBackward0", "fwd-acos"),
    (asin_loss, [[0.5, -1.0]], "aten.rsqrt.default", "AsinBackward0", "fwd-asin"),
    # 1/x overflows float32 at a denormal x whose log is finite
    (log_loss, [[1e-45, 1.0]], "aten.div.Tensor", "LogBackward0", "fwd-log"),
    (rsqrt_loss, [[1e-45, 1.0]], "aten.pow.Tensor_Scalar", "RsqrtBackward0", "fwd-rsqrt"),
])
def test_backward_producer(loss_fn, values, op, node, marker):
    leaves = [torch.tensor(v, requires_grad=True) for v in values]

    def step():
        loss_fn(*leaves).backward()  # <backward-call>

    finding = first_finding(step)
    assert (finding.kind, finding.op, finding.phase, finding.node) == ("producer", op, "backward", node)
    assert_forward_line(finding.forward_source, marker)
    assert_line(finding.source, "backward-call")
    assert finding.where == finding.forward_source
    assert f"backward of {node}" in finding.summary()
    assert finding.outputs[0].nonfinite > 0 and all(i.nonfinite == 0 for i in finding.inputs
                                                     if finding.reason.endswith("finite inputs"))


def test_a_backward_that_raised_leaves_no_finding_held_past_the_next_backward():
    """A backward that raised (a transient failure in a later node, caught) never runs the callbacks queued
    on it: a finding held there kept later backwards from queueing theirs, and a real inf gradient in a
    later step reached the optimizer, reported only when the region ended."""

    w = torch.nn.Parameter(torch.tensor([1.0, 0.5]))
    u = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(nanfast.NonFiniteError) as raised, nanfast.locate():
        Boom.failing = True
        try:
            with pytest.raises(RuntimeError):  # after acos's masked -inf was held
                (Boom.apply(w * 1).sum() + torch.acos((w * 1.0000001).clamp(-1, 1)).sum()).backward()
        finally:
            Boom.failing = False
        (w.sum() + u.sqrt().sum()).backward()  # sqrt's gradient at 0: inf, into u.grad
        raise AssertionError("the second backward returned")
    assert raised.value.report.node == "SqrtBackward0"


def test_a_loss_of_a_fully_masked_logsumexp_row_is_reported_not_its_masked_gradient():
    """logsumexp of a fully masked row is -inf (allowed), so the loss is -inf; its gradient takes -inf - -inf
    (NaN), which masked_fill's backward zeroes: the leaf's gradient is finite. The backward NaN was the
    finding; it is masked (noted), and the -inf loss backward() was called on is reported."""
    x = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], requires_grad=True)
    with nanfast.locate(action="record") as region:
        masked_logsumexp_loss(x).backward()
    assert torch.isfinite(x.grad).all()
    assert [(f.op, f.node) for f in region.masked] == [("aten.sub.Tensor", "LogsumexpBackward0")]
    (finding,) = region.findings
    assert (finding.kind, finding.phase, finding.outputs[0].neginf) == ("producer", "forward", 1)
    assert_forward_line(finding.source, "fwd-logsumexp")


def _clamped_acos(cosine):
    return torch.acos(cosine.clamp(-1.0, 1.0)).sum()  # <clamped-acos>


def _arcface_sine(cosine):
    return torch.sqrt((1.0 - cosine.pow(2)).clamp(0, 1)).sum()  # <arcface-sine>


@pytest.mark.parametrize("loss_fn, value", [(_clamped_acos, 1.0000001), (_arcface_sine, 1.0)],
                         ids=["acos-8069", "arcface-91"])
def test_a_backward_inf_that_a_later_node_masks_is_no_finding(loss_fn, value):
    """acos(clamp(cos, -1, 1)) with a cosine rounded past 1 (pytorch/pytorch#8069) and ArcFace's
    sqrt((1 - cos^2).clamp(0, 1)) at cos = 1 (ronghuaiyang/arcface-pytorch#91): the inner node returns
    ±inf, the clamp's backward zeroes it, the leaf's gradient is finite; locate stopped that healthy step.
    The same inf reaching the leaf is still reported, when backward ends, before the optimizer runs."""
    cosine = torch.tensor([0.5, value], requires_grad=True)
    with nanfast.locate():
        loss_fn(cosine).backward()
    assert torch.isfinite(cosine.grad).all()
    # The inner node under a reentrant checkpoint, the clamp outside it: the checkpoint's own backward ends
    # while the -inf it returns is alive, before the outer node masks it (a review, session 45).
    weight = torch.tensor([1.0, value], requires_grad=True)
    inner = torch.acos if loss_fn is _clamped_acos else (lambda c: torch.sqrt(c))
    outer = (lambda w: w.clamp(-1.0, 1.0)) if loss_fn is _clamped_acos else (lambda w: (1.0 - w.pow(2)).clamp(0, 1))
    with nanfast.locate():
        checkpoint(inner, outer(weight * 1.0), use_reentrant=True).sum().backward()
    assert torch.isfinite(weight.grad).all()
    if loss_fn is _clamped_acos:  # without the clamp the inf reaches the leaf
        leaf = torch.tensor([0.5, 1.0], requires_grad=True)
        with pytest.raises(nanfast.NonFiniteError) as raised, nanfast.locate():
            torch.acos(leaf).sum().backward()
            raise AssertionError("backward() returned")  # the report comes out of backward()
        assert raised.value.report.node == "AcosBackward0" and torch.isinf(leaf.grad).any()



def test_backward_inputs_name_their_producers():
    x = torch.tensor([0.0, 4.0], requires_grad=True)
    finding = first_finding(lambda: sqrt_loss(x).backward())
    grad, doubled_result = finding.inputs
    assert (grad.name, doubled_result.name) == ("self", "other")
    assert (doubled_result.min, doubled_result.max) == (0.0, 4.0)
    assert doubled_result.producer.phase == "backward" and doubled_result.producer.node == "SqrtBackward0"
    assert_forward_line(doubled_result.producer.source, "fwd-sqrt")


def test_backward_of_a_graph_built_outside_locate_still_names_the_node():
    x = torch.tensor([0.0, 4.0], requires_grad=True)
    loss = sqrt_loss(x)
    finding = first_finding(loss.backward)
    assert (finding.op, finding.node, finding.forward_source) == ("aten.div.Tensor", "SqrtBackward0", None)
    assert "forward op at unknown" in str(finding)


# --------------------------------------------------------------------------------------------------
# Dirty data and non-finite parameters
# --------------------------------------------------------------------------------------------------

def test_dirty_data_is_reported_at_its_first_consumer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    batch = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, 6.0]])

    def step():
        layer(batch).sum().backward()  # <dirty-linear>

    finding = first_finding(step)
    assert (finding.kind, finding.op, finding.phase) == ("input", "aten.addmm.default", "forward")
    assert_line(finding.source, "dirty-linear")
    assert "input mat1" in finding.reason
    data = {i.name: i for i in finding.inputs}["mat1"]
    assert counts(data) == (1, 0, 0) and data.producer is None and (data.min, data.max) == (1.0, 6.0)
    assert "not made by an op locate saw" in str(finding)


def test_dirty_data_is_reported_once_and_its_propagation_not_at_all():
    layer = torch.nn.Linear(3, 2)
    batch = torch.tensor([[NAN, 2.0, 3.0]])
    found = findings_of(lambda: torch.relu(layer(batch)).sum().backward())
    assert [(f.kind, f.op) for f in found] == [("input", "aten.addmm.default")]


def test_a_nan_parameter_is_dirty_input():
    layer = torch.nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight[1, 2] = NAN
    finding = first_finding(layer, torch.ones(1, 3))
    assert (finding.kind, finding.op) == ("input", "aten.addmm.default")
    assert "input mat2" in finding.reason  # the transposed weight


def zero_first_column(x):
    x[:, 0] = 0


def scale_first_two_columns(x):
    x[:, :2] /= 255


@pytest.mark.parametrize("write", [zero_first_column, scale_first_two_columns])
def test_dirty_batch_partly_written_in_place_is_still_dirty(write):
    """An in-place write to part of a batch made outside leaves the rest of it from outside: its NaN
    is dirty data at its first consumer, not NaN that an op under locate made."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    batch = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]])

    def step():
        write(batch)
        layer(batch).sum().backward()  # <partly-written-linear>

    finding = first_finding(step)
    assert (finding.kind, finding.op) == ("input", "aten.addmm.default")
    assert_line(finding.source, "partly-written-linear")
    assert "input mat1" in finding.reason
    data = {i.name: i for i in finding.inputs}["mat1"]
    assert counts(data) == (1, 0, 0)
    assert data.partial and data.producer.source.function == write.__name__  # the last partial write
    assert "partly written by" in str(finding)


@pytest.mark.parametrize("overwrite", [lambda x: x.zero_(), lambda x: x.copy_(torch.ones(2, 3)),
                                       lambda x: x.fill_(1.0)])
def test_a_dirty_batch_overwritten_whole_is_clean(overwrite):
    batch = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]])
    assert findings_of(lambda: torch.log(overwrite(batch) + 1)) == []


def test_nan_written_into_part_of_a_clean_batch_is_not_taken_for_dirty_data():
    """The NaN an op under locate wrote into part of an outside tensor is that op's; the rest of the
    tensor holds none, so its consumers are not reported as dirty."""
    batch = torch.ones(2, 3)

    def step():
        batch[:, 0] = torch.log(torch.tensor([-1.0, 1.0]))  # <log-into-column>
        return batch.sum()

    [finding] = findings_of(step)
    assert (finding.kind, finding.op) == ("producer", "aten.log.default")
    assert_line(finding.source, "log-into-column")


def test_dirty_batch_with_nan_in_the_written_part_is_reported_at_the_write():
    batch = torch.tensor([[1.0, 2.0, 3.0], [NAN, 5.0, 6.0]])

    def step():
        batch[:, 0] *= 2  # <write-dirty-column>
        return batch.sum()

    [finding] = findings_of(step)
    assert (finding.kind, finding.op) == ("input", "aten.mul_.Tensor")
    assert_line(finding.source, "write-dirty-column")


def test_inf_in_data_is_allowed_until_it_makes_nan():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    batch = torch.tensor([[1.0, INF, 3.0]])
    finding = first_finding(model, batch)
    assert (finding.kind, finding.op) == ("producer", "aten.native_layer_norm.default")
    assert finding.reason == "made NaN from inputs without NaN"
    hidden = finding.inputs[0]
    assert hidden.posinf + hidden.neginf > 0 and hidden.producer.op == "aten.addmm.default"


# --------------------------------------------------------------------------------------------------
# Masking is not reported
# --------------------------------------------------------------------------------------------------

def test_masked_fill_with_neg_inf_then_softmax_is_not_reported():
    scores = torch.randn(2, 4, 4, requires_grad=True)
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)

    def attention():
        weights = F.softmax(scores.masked_fill(causal, -INF), dim=-1)
        (weights @ torch.randn(2, 4, 3)).sum().backward()

    assert findings_of(attention) == []
    assert torch.isfinite(scores.grad).all()


def test_additive_neg_inf_mask_built_before_locate_is_not_reported():
    additive = torch.full((4, 4), -INF).triu(1)
    scores = torch.randn(4, 4, requires_grad=True)
    assert findings_of(lambda: F.softmax(scores + additive, dim=-1).sum().backward()) == []


def test_scaled_dot_product_attention_masks_are_not_reported():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    lower = torch.ones(4, 4, dtype=torch.bool).tril()

    def attention():
        F.scaled_dot_product_attention(q, q, q, attn_mask=lower).sum().backward()
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    assert findings_of(attention) == []


def test_softmax_of_a_fully_masked_row_is_reported():
    scores = torch.randn(2, 3)
    mask = torch.tensor([[True, True, True], [False, True, False]])

    def attention():
        return F.softmax(scores.masked_fill(mask, -INF), dim=-1)  # <fully-masked>

    finding = first_finding(attention)
    assert (finding.op, finding.reason) == ("aten._softmax.default", "made NaN from inputs without NaN")
    assert_line(finding.source, "fully-masked")
    assert counts(finding.outputs[0]) == (3, 0, 0)
    assert finding.inputs[0].producer.op == "aten.masked_fill.Scalar"


def test_masking_ops_with_infinite_scalars_are_not_reported():
    x = torch.randn(3, 4)
    mask = x > 0

    def masking():
        x.masked_fill(mask, -INF)
        x.clone().masked_fill_(mask, INF)
        torch.where(mask, x, -INF)
        torch.where(mask, -INF, x)
        torch.full((2, 2), -INF).triu(1)
        torch.full_like(x, -INF)
        x.new_full((2,), INF)
        x.clone().fill_(-INF)
        torch.clamp(x, min=-INF, max=INF)
        F.pad(x, (1, 1), value=-INF)
        x.clone().index_fill_(1, torch.tensor([0]), -INF)
        torch.nan_to_num(torch.tensor([INF, 1.0]), posinf=INF)
        torch.linalg.vector_norm(x, ord=INF)

    assert findings_of(masking) == []


SCALE = NAN  # a scale read earlier (a config, a loss.item()) that is NaN


def scaled(x):
    return x * SCALE  # <nan-scale>


def filled(x):
    return torch.full((3,), NAN)  # <nan-full>


def shifted(x):
    return x + INF  # <inf-shift>


def powered(x):
    return x * INF  # <inf-times-zero>


@pytest.mark.parametrize("fn, op, reason, marker", [
    (scaled, "aten.mul.Tensor", "its scalar argument `other` is nan", "nan-scale"),
    (filled, "aten.full.default", "its scalar argument `fill_value` is nan", "nan-full"),
    (shifted, "aten.add.Tensor", "its scalar argument `other` is inf", "inf-shift"),
    (powered, "aten.mul.Tensor", "its scalar argument `other` is inf", "inf-times-zero"),
])
def test_non_finite_scalar_argument_is_the_source(fn, op, reason, marker):
    finding = first_finding(fn, torch.tensor([0.0, 1.0, 2.0]))
    assert (finding.kind, finding.op, finding.reason) == ("scalar", op, reason)
    assert_line(finding.source, marker)
    assert any(s.startswith(reason.split("`")[1] + "=") for s in finding.scalars)


def test_non_finite_scalar_on_non_finite_tensors_is_propagation():
    """The scalar is not blamed for what its tensor inputs already held."""
    x = torch.tensor([INF, 1.0])
    assert findings_of(lambda: (x + INF, torch.linalg.vector_norm(x, ord=INF))) == []


def test_healthy_transformer_with_causal_masks_is_silent():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 5, 16)
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    q = torch.randn(2, 2, 5, 8, requires_grad=True)

    def step():
        causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
        hidden = encoder(x, mask=causal, is_causal=True,
                         src_key_padding_mask=torch.zeros(2, 5).masked_fill(padding, float("-inf")))
        attended = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        scores = (q @ q.transpose(-1, -2)).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        manual = F.softmax(scores, dim=-1) @ q
        logits = hidden[:, -1] @ torch.randn(16, 10)
        kth = torch.topk(logits, 3).values[:, -1:]
        top_k = F.softmax(torch.where(logits < kth, float("-inf"), logits), dim=-1)
        (hidden.sum() + attended.sum() + manual.sum() + top_k.sum()).backward()

    assert findings_of(step) == []
    assert torch.isfinite(q.grad).all()


# --------------------------------------------------------------------------------------------------
# Nested tensors: their values are checked
# --------------------------------------------------------------------------------------------------

def jagged(*rows):
    return torch.nested.nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)


def strided_nested(*rows):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the strided layout is a prototype
        return torch.nested.nested_tensor([torch.tensor(r) for r in rows])


@pytest.mark.parametrize("make", [jagged, strided_nested])
def test_nan_in_a_nested_input_is_dirty_data(make):
    nt = make([[1.0, 2.0], [3.0, 4.0]], [[NAN, 6.0]])

    def step():
        return torch.sin(nt * 2)  # <nested-dirty>

    finding = first_finding(step)
    assert (finding.kind, finding.op) == ("input", "aten.mul.Tensor")
    assert_line(finding.source, "nested-dirty")
    [data] = finding.inputs
    values_shape = (6,) if make is strided_nested else (3, 2)  # a strided one's buffer is flat
    assert (data.name, counts(data), data.shape, data.producer) == ("self.values()", (1, 0, 0), values_shape, None)


@pytest.mark.parametrize("make", [jagged, strided_nested])
def test_nested_producer_is_reported_with_its_input_values(make):
    nt = make([[1.0, -2.0]], [[3.0, 4.0], [5.0, 6.0]])

    def step():
        return torch.sqrt(nt + 0)  # <nested-sqrt>

    finding = first_finding(step)
    assert (finding.kind, finding.op) == ("producer", "aten.sqrt.default")
    assert finding.reason == "made NaN from inputs without NaN"
    assert_line(finding.source, "nested-sqrt")
    assert counts(finding.outputs[0]) == (1, 0, 0) and finding.outputs[0].name == "out.values()"
    [data] = finding.inputs
    assert (data.min, data.max) == (-2.0, 6.0) and data.producer.op == "aten.add.Tensor"


# --------------------------------------------------------------------------------------------------
# In-place and out= ops
# --------------------------------------------------------------------------------------------------

def test_in_place_op_reports_its_input_before_the_op():
    def run():
        x = torch.tensor([-1.0, 2.0]) * 1
        x.log_()  # <log-inplace>

    finding = first_finding(run)
    assert (finding.op, finding.reason) == ("aten.log_.default", "made NaN from inputs without NaN")
    assert_line(finding.source, "log-inplace")
    [before] = finding.inputs
    assert (before.min, before.max, counts(before)) == (-1.0, 2.0, (0, 0, 0))
    assert before.producer.op == "aten.mul.Tensor"


def test_out_argument_is_an_output_not_an_input():
    out = torch.full((2,), NAN)  # made before locate: stale values in an out= buffer are no input

    finding = first_finding(lambda: torch.log(torch.tensor([0.0, 2.0]), out=out))
    assert finding.op == "aten.log.out" and finding.kind == "producer"
    assert [i.name for i in finding.inputs] == ["self"]
    assert counts(finding.outputs[0]) == (0, 0, 1)


# --------------------------------------------------------------------------------------------------
# record, dump, decorator
# --------------------------------------------------------------------------------------------------

def test_record_collects_every_producer_and_does_not_raise():
    log_probs = torch.randn(2, 1, 5).log_softmax(-1).requires_grad_()
    x = torch.tensor([0.0, 4.0], requires_grad=True)

    def step():
        ctc = F.ctc_loss(log_probs, torch.tensor([[1, 1, 1]]), torch.tensor([2]), torch.tensor([3]))
        (ctc + torch.sqrt(x).sum()).backward()

    found = findings_of(step)
    # The ctc backward's NaN comes from the forward's inf: propagation, not a second producer.
    assert [(f.op, f.phase, f.node) for f in found] == [("aten._ctc_loss.Tensor", "forward", None),
                                                         ("aten.div.Tensor", "backward", "SqrtBackward0")]
    assert log_probs.grad.isnan().all() and x.grad[0].isinf()  # ran on to the end


def test_dump_saves_the_inputs_and_replay_reproduces_the_nan(tmp_path):
    path = tmp_path / "repro.pt"
    x = torch.tensor([[-2.0, 3.0], [0.5, -0.0]])
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate(dump=path):
            torch.sqrt(x * 2)
    assert raised.value.report.dump == str(path) and str(path) in str(raised.value)
    saved = torch.load(path, weights_only=True)
    assert saved["op"] == "aten.sqrt.default" and torch.equal(saved["arguments"]["self"], x * 2)
    replayed = nanfast.replay(path)
    assert torch.equal(replayed.isnan(), torch.tensor([[True, False], [False, False]]))


def test_dump_of_an_in_place_op_holds_the_values_before_it(tmp_path):
    path = tmp_path / "inplace.pt"
    x = torch.tensor([1.0, -1.0])
    with pytest.raises(nanfast.NonFiniteError):
        with nanfast.locate(dump=path):
            (x + 0).sqrt_()
    assert torch.equal(torch.load(path, weights_only=True)["arguments"]["self"], x)
    assert nanfast.replay(path).isnan().tolist() == [False, True]


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_replay_of_an_in_place_op_returning_nothing_gives_the_written_arguments(tmp_path, impl):
    """Adam with eps=0 on a zero gradient: 0/0 in _foreach_div_/_fused_adam_, which write their arguments
    and return nothing, so replay returned None (the NaN went into the loaded arguments, thrown away)."""
    path = tmp_path / "adam.pt"
    param = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
    param.grad = torch.tensor([0.0, 1.0, 2.0])
    with nanfast.locate(action="record", dump=path) as found:
        torch.optim.Adam([param], lr=0.1, eps=0.0, **{impl: True}).step()
    assert found.finding is not None and found.finding.dump == str(path)
    written = nanfast.replay(path)
    assert isinstance(written, dict) and written, written
    flat = [t for v in written.values() for t in (v if isinstance(v, (list, tuple)) else [v])]
    assert any(not torch.isfinite(t).all() for t in flat)


def test_replay_refuses_what_is_not_a_dump_and_calls_only_operators(tmp_path):
    """A dump shared in a bug report is input from someone else: replay runs no pickled code (weights-only
    loading), calls only an operator of torch.ops by its name, takes only memory formats by name, and
    says what is wrong instead of a KeyError or an unpacking error."""
    cases = {
        "checkpoint.pt": ({"model": torch.ones(2)}, "is not a dump written by locate"),
        "named.pt": ({"op": "os.system", "arguments": {}}, "'os.system', which is not an operator of torch.ops"),
        "deeper.pt": ({"op": "os.path.join", "arguments": {}}, "'os.path.join', which is not an operator"),
        "packet.pt": ({"op": "aten.div", "arguments": {}}, "'aten.div', which is not an operator"),
        "format.pt": ({"op": "aten.contiguous.default",
                       "arguments": {"self": torch.ones(2), "memory_format": {"memory_format": "load"}}},
                      "'load' is not a torch memory format"),
    }
    for name, (content, message) in cases.items():
        torch.save(content, tmp_path / name)
        with pytest.raises(ValueError, match=message):
            nanfast.replay(tmp_path / name)


@nanfast.locate()
def decorated(x):
    return torch.log(x)  # <decorated>


def test_decorator():
    for _ in range(2):  # reusable
        with pytest.raises(nanfast.NonFiniteError) as raised:
            decorated(torch.tensor([-1.0]))
        assert_line(raised.value.report.source, "decorated")
    assert decorated(torch.tensor([1.0])).item() == 0.0


def test_bad_arguments_and_reentry():
    with pytest.raises(ValueError, match="action"):
        nanfast.locate(action="warn")
    region = nanfast.locate()
    with region:
        with pytest.raises(RuntimeError, match="already active"):
            region.__enter__()


def test_outside_locate_nothing_is_checked():
    with nanfast.locate():
        pass
    torch.log(torch.tensor([-1.0]))  # no error: the mode is gone


# --------------------------------------------------------------------------------------------------
# locate_step: the watch's re-run of one step
# --------------------------------------------------------------------------------------------------

def test_locate_step_reruns_the_step_with_its_rng_and_leaves_no_trace():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5))
    batch = torch.randn(16, 4)
    outputs = []

    def step():
        hidden = model(batch)
        outputs.append(hidden.detach().clone())
        torch.sqrt(hidden).sum().backward()  # <step-sqrt>

    before = StepState.capture(model)
    step()  # the step as training ran it: dropout drew its mask, grads and running stats changed
    after_grads = [p.grad.clone() for p in model.parameters()]
    after_buffers = [b.clone() for b in model.buffers()]
    after_rng = torch.get_rng_state()

    finding = locate_step(step, before)
    assert (finding.op, finding.phase) == ("aten.sqrt.default", "forward")
    assert_line(finding.source, "step-sqrt")
    assert torch.equal(outputs[0], outputs[1])  # same dropout mask, same batch statistics
    assert counts(finding.outputs[0])[0] == int((outputs[0] < 0).sum())
    assert all(torch.equal(p.grad.nan_to_num(), g.nan_to_num()) and torch.equal(p.grad.isnan(), g.isnan())
               for p, g in zip(model.parameters(), after_grads))
    assert all(torch.equal(b, a) for b, a in zip(model.buffers(), after_buffers))
    assert torch.equal(torch.get_rng_state(), after_rng)


def test_locate_step_restores_values_when_the_step_already_updated_them():
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[-1.0, -1.0]]))
        model.bias.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.tensor([[1.0, 2.0]])

    def step():
        torch.log(model(batch)).sum().backward()

    before = StepState.capture(model, values=True)
    step()  # log(-3): a NaN loss (with finite grads)
    optimizer.step()  # the update already ran: the weights moved
    weights_after = [p.detach().clone() for p in model.parameters()]
    assert model(batch).item() != -3.0

    finding = locate_step(step, before)  # runs on the weights from before the update
    assert (finding.kind, finding.op) == ("producer", "aten.log.default")
    assert finding.inputs[0].min == -3.0
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights_after))


def test_locate_step_returns_none_when_the_fault_does_not_reproduce():
    x = torch.ones(3, requires_grad=True)
    assert locate_step(lambda: x.sum().backward(), StepState.capture([x])) is None
    assert x.grad is None  # restored


@pytest.mark.parametrize("copy_grads", [False, True])
def test_locate_step_starts_from_no_grads_or_the_captured_ones(copy_grads):
    x = torch.ones(3, requires_grad=True)
    x.grad = torch.full((3,), 2.0)  # from an earlier micro-batch
    before = StepState.capture([x], grads=copy_grads)
    x.grad = torch.full((3,), 5.0)  # the step as it ran
    seen = []

    def step():
        seen.append(None if x.grad is None else x.grad.clone())
        x.sum().backward()

    assert locate_step(step, before) is None  # the fault did not reproduce
    assert (seen[0] is None) if not copy_grads else torch.equal(seen[0], torch.full((3,), 2.0))
    assert torch.equal(x.grad, torch.full((3,), 5.0))  # put back


def test_demo_catches_skips_and_locates_the_planted_fault(capsys):
    from nanfast.cli import demo

    assert demo.run() == 0
    out = capsys.readouterr().out
    demo_lines = pathlib.Path(demo.__file__).read_text().splitlines()
    fault = next(i for i, text in enumerate(demo_lines, 1) if text.endswith("# the planted fault: no epsilon"))
    assert f"step {demo.BAD_STEP}: loss nan  <- non-finite" in out
    assert "standardize (Standardize)" in out  # the watch's first place
    assert "parameters unchanged: True" in out
    assert f"nanfast.locate: aten.div.Tensor (forward) at {demo.__file__}:{fault} in forward" in out
    assert "<- aten.std.correction" in out
    assert out.count("<- non-finite") == 1 and out.rstrip().endswith("the parameters stayed finite: True")


def test_catches_what_detect_anomaly_misses():
    """detect_anomaly checks only backward outputs, and only for NaN."""
    x = torch.tensor([0.0, 4.0], requires_grad=True)
    with pytest.warns(UserWarning, match="Anomaly Detection has been enabled"):
        with torch.autograd.detect_anomaly():
            torch.log(torch.tensor([-1.0]))  # forward-only NaN
            sqrt_loss(x).backward()  # an inf gradient
    assert x.grad[0].item() == INF
    x.grad = None
    with pytest.raises(nanfast.NonFiniteError, match="aten.log.default"):
        with nanfast.locate():
            torch.log(torch.tensor([-1.0]))
    assert first_finding(lambda: sqrt_loss(x).backward()).node == "SqrtBackward0"


def test_low_precision_outputs():
    def narrow(t):
        return t.to(torch.float8_e5m2)  # <fp8-cast>

    finding = first_finding(narrow, torch.tensor([1.5, 1e6]))
    assert (finding.op, finding.kind) == ("aten._to_copy.default", "producer")
    assert_line(finding.source, "fp8-cast")
    [out] = finding.outputs
    assert (out.dtype, counts(out), out.min, out.max) == ("float8_e5m2", (0, 1, 0), 1.5, 1.5)
    assert first_finding(lambda: torch.tensor([60000.0]).half() * 2).op == "aten.mul.Tensor"


def test_nan_mx_scale():
    """An e8m0 scale out of range is its NaN (0xFF): the cast that made it is the producer."""
    def to_scale(amax):
        return amax.to(torch.float8_e8m0fnu)  # <e8m0-cast>

    finding = first_finding(to_scale, torch.tensor([2.0**200, 1.0], dtype=torch.float64))
    assert (finding.op, finding.kind) == ("aten._to_copy.default", "producer")
    assert_line(finding.source, "e8m0-cast")
    [out] = finding.outputs
    assert (out.dtype, counts(out), out.min, out.max) == ("float8_e8m0fnu", (1, 0, 0), 1.0, 1.0)
