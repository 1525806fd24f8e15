"""The diagnosis table (nanfast.locator.diagnosis.DIAGNOSES): each entry, on the op that shows its pattern,
gives the finding its reason in words; ops that show no known pattern get none."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nanfast
from nanfast.locator.diagnosis import DIAGNOSES

INF = float("inf")


def _masked_rows():
    x = torch.randn(32, 4)
    x[5] = -INF  # a mask made before locate: allowed
    x[9] = -INF
    return x


def _ctc():
    log_probs = torch.randn(2, 1, 5).log_softmax(-1)
    return lambda: F.ctc_loss(log_probs, torch.tensor([[1, 1, 2]]), torch.tensor([2]), torch.tensor([3]))


def _half(value, *shape):
    return torch.full(shape, value, dtype=torch.float16)


def _fast_attention(kind: str) -> None:
    """Eval mode under no_grad: torch's fused path, with sequence 1 all padding."""
    torch.manual_seed(0)
    x, padding = torch.randn(2, 4, 8), torch.zeros(2, 4, dtype=torch.bool)
    padding[1] = True
    with torch.no_grad():
        if kind == "mha":
            torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()(x, x, x, key_padding_mask=padding,
                                                                       need_weights=False)
        else:
            torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()(x, src_key_padding_mask=padding)


CASES = [
    # (op packet, what runs under locate, the op reported, words the diagnosis holds)
    ("_softmax", lambda x=_masked_rows(): F.softmax(x, dim=-1), "aten._softmax.default",
     "row 5 of 32 along dim 1 is fully masked (every entry -inf) (2 rows in all)"),
    ("_log_softmax", lambda x=_masked_rows(): F.log_softmax(x, dim=1), "aten._log_softmax.default",
     "row 5 of 32 along dim 1 is fully masked"),
    ("div", lambda: torch.tensor([0.0, 1.0, 2.0]) / torch.tensor([0.0, 0.0, 1.0]), "aten.div.Tensor",
     "divides by exact zeros: 2 of 3 elements of the divisor `other` are 0 (0/0 at 1 of the quotient's 3 elements)"),
    ("div_", lambda: torch.tensor([1.0, 2.0]).div_(torch.tensor([1.0, 0.0])), "aten.div_.Tensor",
     "divides by exact zeros: 1 of 2 elements"),
    ("reciprocal", lambda: torch.tensor([0.0, 2.0]).reciprocal(), "aten.reciprocal.default",
     "1/x of exact zeros: 1 of 2 elements of `self` is 0"),
    ("log", lambda: torch.log(torch.tensor([1.0, -2.0, 0.0])), "aten.log.default",
     "log at the edge of its domain: 2 of 3 elements of `self` are <= 0 (min -2, max 0)"),
    ("log2", lambda: torch.log2(torch.tensor([0.0, 1.0])), "aten.log2.default", "log2 at the edge"),
    ("log10", lambda: torch.log10(torch.tensor([-1.0, 1.0])), "aten.log10.default", "log10 at the edge"),
    ("log1p", lambda: torch.log1p(torch.tensor([-1.0, 1.0])), "aten.log1p.default", "is <= -1"),
    ("sqrt", lambda: torch.sqrt(torch.tensor([4.0, -9.0])), "aten.sqrt.default",
     "sqrt at the edge of its domain: 1 of 2 elements of `self` is < 0 (min -9, max -9)"),
    ("rsqrt", lambda: torch.rsqrt(torch.tensor([0.0, 4.0])), "aten.rsqrt.default", "rsqrt at the edge"),
    ("acos", lambda: torch.acos(torch.tensor([0.5, 1.5])), "aten.acos.default", "outside [-1, 1] (min 1.5"),
    # A cosine rounded just past 1 (a probe: "(min 1, max 1)" hid it): the digits of float32 are shown.
    ("acos", lambda: torch.acos(torch.tensor([0.5, 1.0000001])), "aten.acos.default",
     "is outside [-1, 1] (min 1.00000012, max 1.00000012)"),
    ("asin", lambda: torch.asin(torch.tensor([-2.0, 0.5])), "aten.asin.default", "outside [-1, 1]"),
    ("atanh", lambda: torch.atanh(torch.tensor([1.0, 0.5])), "aten.atanh.default", "outside (-1, 1)"),
    ("pow", lambda: torch.tensor([0.0, 2.0]).pow(-1), "aten.pow.Tensor_Scalar",
     "pow of 0 to the negative exponent -1: 1 of 2 elements of `self` is 0"),
    # pytorch/pytorch#75405's gamma: the exponent 2.2 - 1 = 1.2000000000000002 was shown with all its digits.
    ("pow", lambda: torch.tensor([-1.0, 2.0]).pow(2.2 - 1), "aten.pow.Tensor_Scalar",
     "pow of negative values to the fractional exponent 1.2: 1 of 2 elements of `self` are < 0"),
    ("exp", lambda: torch.exp(torch.tensor([1.0, 100.0])), "aten.exp.default",
     "exp overflow: the largest input 100 exceeds 88.7228, the largest whose exp torch.float32 holds"),
    ("exp_", lambda: torch.tensor([1.0, 100.0]).exp_(), "aten.exp_.default", "exp overflow"),
    ("expm1", lambda: torch.expm1(torch.tensor([90.0])), "aten.expm1.default", "largest input 90"),
    ("exp2", lambda: torch.exp2(torch.tensor([130.0])), "aten.exp2.default", "exceeds 128"),
    ("nll_loss_forward", lambda: F.cross_entropy(torch.randn(4, 3), torch.full((4,), -100)),
     "aten.nll_loss_forward.default",
     "a mean loss over zero elements: every one of the 4 targets is ignore_index (-100)"),
    ("nll_loss2d_forward",
     lambda: F.cross_entropy(torch.randn(2, 3, 4, 4), torch.full((2, 4, 4), 255), ignore_index=255),
     "aten.nll_loss2d_forward.default", "every one of the 32 targets is ignore_index (255)"),
    ("mean", lambda: torch.empty(0).mean(), "aten.mean.default", "a mean over zero elements"),
    # pytorch/pytorch#115500: the running variance a training batch norm writes (NOTE: [writes an op does
    # not return]) passes float16's max while its output stays finite.
    ("native_batch_norm", lambda: F.batch_norm(_half(60000, 8, 10).mul_(torch.rand(8, 10).half()), _half(0, 10),
                                               _half(1, 10), training=True), "aten.native_batch_norm.default",
     "passes float16's largest finite value 65504: 10 of 10 elements of `running_var` are +inf"),
    ("_ctc_loss", _ctc(), "aten._ctc_loss.Tensor",
     "CTC with impossible alignments: sample 0 needs at least 4 frames (3 labels, 1 repeated) but its input "
     "length is 2"),
    ("_to_copy", lambda: torch.tensor([1e5, 1.0]).half(), "aten._to_copy.default",
     "cast overflow: the largest |x| 100000 exceeds 65504"),
    ("mm", lambda: _half(300, 2, 4) @ _half(300, 4, 2), "aten.mm.default",
     "torch.float16 overflow in a matmul: the inputs' max |x| are 300 and 300 over 4 terms, while torch.float16 "
     "holds at most 65504"),
    ("bmm", lambda: torch.bmm(_half(300, 1, 2, 4), _half(300, 1, 4, 2)), "aten.bmm.default", "over 4 terms"),
    ("addmm", lambda: F.linear(_half(300, 2, 4), _half(300, 2, 4), _half(0, 2)), "aten.addmm.default",
     "float16 overflow in a matmul"),
    ("baddbmm", lambda: torch.baddbmm(_half(0, 1, 2, 2), _half(300, 1, 2, 4), _half(300, 1, 4, 2)),
     "aten.baddbmm.default", "float16 overflow in a matmul"),
    # Found without a diagnosis by a probe (session 43): float16 overflow in elementwise arithmetic, as in
    # huggingface/transformers#17306 (a score plus finfo.min) and ConvNeXt's LayerNorm ((x - u).pow(2)).
    ("add", lambda: _half(-60000, 2) + _half(-60000, 2), "aten.add.Tensor",
     "torch.float16 overflow in add: `self` max |x| 60000, `other` max |x| 60000 give a result past 65504"),
    ("add_", lambda: _half(40000, 2).add_(_half(40000, 2)), "aten.add_.Tensor", "overflow in add: "),
    ("sub", lambda: _half(40000, 2) - _half(-40000, 2), "aten.sub.Tensor", "(2 of 2 elements are ±inf)"),
    ("sub_", lambda: _half(40000, 2).sub_(_half(-40000, 2)), "aten.sub_.Tensor", "overflow in sub"),
    ("mul", lambda: torch.tensor([0.0, 1.0]) * torch.tensor([1e38, 1e38]) * 10, "aten.mul.Tensor",
     "torch.float32 overflow in mul: `self` max |x| 1e+38, `other` 10 give a result past 3.40282e+38"),
    ("mul_", lambda: _half(300, 2).mul_(300), "aten.mul_.Tensor", "`other` 300"),
    ("pow", lambda: _half(300, 2).pow(2), "aten.pow.Tensor_Scalar",
     "torch.float16 overflow in pow: `self` max |x| 300, `exponent` 2 give a result past 65504"),
    # A probe (session 52): a negative exponent overflows from the smallest base (the sentence named the
    # largest, 5 ** -1 = 0.2); tensor exponents had no diagnosis; nor in-place ops (log_), nor a float16
    # quotient past 65504 from a tiny divisor (scores over a temperature, 1/x).
    ("pow", lambda: torch.tensor([1e-5, 5.0]).half() ** -1, "aten.pow.Tensor_Scalar",
     "torch.float16 overflow in pow: `self` min |x| 1.00136e-05, `exponent` -1 give a result past 65504"),
    ("pow", lambda: torch.pow(torch.tensor([-8.0, 2.0]), torch.tensor([1 / 3, 0.5])), "aten.pow.Tensor_Tensor",
     "pow of negative values to fractional exponents: at 1 of 2 elements of the result `self` is < 0"),
    ("pow", lambda: torch.pow(torch.tensor([0.0, 2.0]), torch.tensor([-1.0, -1.0])), "aten.pow.Tensor_Tensor",
     "pow of 0 to negative exponents: at 1 of 2 elements of the result `self` is 0 and `exponent` < 0"),
    ("log_", lambda: torch.tensor([0.0, 2.0]).log_(), "aten.log_.default",
     "log at the edge of its domain: 1 of 2 elements of `self` is <= 0"),
    ("div", lambda: _half(4000, 2) / 0.05, "aten.div.Tensor",
     "torch.float16 overflow in div: `self` max |x| 4000, `other` 0.05 give a result past 65504"),
    ("div", lambda: _half(4000, 2) / torch.tensor([1e-3, 1.0]).half(), "aten.div.Tensor",
     "overflow in div: `self` max |x| 4000, `other` min |x| 0.0010004 give a result past 65504"),
    ("reciprocal", lambda: torch.tensor([1e-5, 1.0]).half().reciprocal(), "aten.reciprocal.default",
     "torch.float16 overflow in 1/x: `self` min |x| 1.00136e-05 give a result past 65504"),
    # Found without a diagnosis by a probe (session 45), in public bug reports: float16 sums, an exploding
    # float32 RNN's matmul, Beta.log_prob at 0 (pytorch/pytorch#92260), Adam's eps rounding to 0 in float16
    # (afiaka87/glide-finetune#5), 0 * inf and logsumexp's backward over a row all -inf (pytorch/pytorch#31829).
    ("sum", lambda: _half(30000, 4).sum(), "aten.sum.default",
     "torch.float16 overflow in sum: `self` max |x| 30000 give a result past 65504"),
    ("mm", lambda: torch.full((2, 4), 1e20) @ torch.full((4, 2), 1e20), "aten.mm.default",
     "torch.float32 overflow in a matmul: the inputs' max |x| are 1e+20 and 1e+20 over 4 terms"),
    ("xlogy", lambda: torch.distributions.Beta(torch.tensor(2.0), torch.tensor(2.0)).log_prob(torch.tensor(0.0)),
     "aten.xlogy.Tensor", "x * log(y) at y = 0 with x != 0: log(0) is -inf"),
    ("addcdiv", lambda: torch.addcdiv(_half(1, 2), _half(1, 2), torch.tensor([1e-8, 1.0]).half()),
     "aten.addcdiv.default", "divides by exact zeros: 1 of 2 elements of the divisor `tensor2` is 0"),
    ("addcdiv_", lambda: _half(1, 2).addcdiv_(_half(1, 2), torch.tensor([1e-8, 1.0]).half()), "aten.addcdiv_.default",
     "of the divisor `tensor2` is 0"),
    ("mul", lambda: torch.tensor([0.0, -INF]) * torch.zeros(2), "aten.mul.Tensor",
     "0 * inf at 1 of 2 elements: infinities it was given (a mask's, an input's) meet"),
    ("sub", lambda x=torch.tensor([-INF, 0.0]): x - x, "aten.sub.Tensor", "inf - inf at 1 of 2 elements"),
    ("add", lambda: torch.tensor([-INF, 1.0]) + torch.tensor([INF, 1.0]), "aten.add.Tensor", "inf - inf at 1 of 2"),
    # An output with inf beside the NaN: the infinities were given, not an overflow (GPT-2's attention with an
    # inf weight was said to overflow from its inputs' finite max, a probe, session 45).
    ("add", lambda: torch.tensor([INF, -INF, 1.0]) + torch.tensor([-INF, 1.0, 1.0]), "aten.add.Tensor",
     "inf - inf at 1 of 3 elements"),
    ("sub", lambda: torch.logsumexp(torch.full((2,), -INF, requires_grad=True), 0).backward(), "aten.sub.Tensor",
     "inf - inf at 2 of 2 elements"),
    # Found without a diagnosis by a probe (session 38): LayerNorm(eps=0), std of one sample, the fused
    # attention of MultiheadAttention and TransformerEncoderLayer in eval mode with a row all padding.
    ("native_layer_norm", lambda: torch.nn.LayerNorm(4, eps=0.0)(torch.tensor([[1.0, 2, 3, 4], [5.0, 5, 5, 5]])),
     "aten.native_layer_norm.default", "layer norm with eps=0 over constant rows: 1 of 2 rows is constant"),
    ("std", lambda: torch.randn(1, 5).std(dim=0), "aten.std.correction",
     "a variance over 1 element with correction 1: 1 - 1 = 0 degrees of freedom"),
    ("var", lambda: torch.tensor([2.0, 3.0]).var(correction=2), "aten.var.correction",
     "a variance over 2 elements with correction 2"),
    ("std_mean", lambda: torch.std_mean(torch.tensor([2.0]))[0], "aten.std_mean.correction", "0 degrees of freedom"),
    ("var_mean", lambda: torch.var_mean(torch.ones(1, 3), dim=0), "aten.var_mean.correction", "over 1 element"),
    ("_native_multi_head_attention", lambda: _fast_attention("mha"), "aten._native_multi_head_attention.default",
     "row 1 of the attention mask masks every one of its 4 keys"),
    ("_transformer_encoder_layer_fwd", lambda: _fast_attention("encoder"),
     "aten._transformer_encoder_layer_fwd.default", "row 1 of the attention mask masks every one of its 4 keys"),
]


@pytest.mark.parametrize("packet, run, op, words", CASES, ids=[c[0] for c in CASES])
def test_each_diagnosis_names_its_pattern(packet, run, op, words):
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            run()
    finding = raised.value.report
    assert finding.op == op
    assert finding.diagnosis is not None and words in finding.diagnosis, finding.diagnosis
    assert finding.diagnosis in finding.summary() and finding.to_dict()["diagnosis"] == finding.diagnosis


def test_every_table_entry_has_a_test():
    """In-place ops (add_, log_) are looked up as their out-of-place forms."""
    assert set(DIAGNOSES) == {c[0].removesuffix("_") for c in CASES}


def test_a_finding_without_a_known_pattern_has_no_diagnosis():
    # An overflowing cumulative sum of finite values is in no table entry.
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            torch.cumsum(torch.tensor([3e38, 3e38]), 0)
    assert raised.value.report.op == "aten.cumsum.default" and raised.value.report.diagnosis is None


def test_a_backward_finding_gets_its_diagnosis():
    x = torch.tensor([0.0, 4.0], requires_grad=True)
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            torch.sqrt(x).sum().backward()
    finding = raised.value.report
    assert (finding.op, finding.node) == ("aten.div.Tensor", "SqrtBackward0")
    assert "divides by exact zeros: 1 of 2 elements of the divisor `other` is 0" in finding.diagnosis


@pytest.mark.parametrize("run, op, words", [
    # pytorch/pytorch#18287: cos of +inf padding
    (lambda: torch.cos(torch.tensor([1.0, INF])), "aten.cos.default",
     "cos of infinite values: 1 of 2 elements of `self` is infinite"),
    # pytorch/pytorch#49844: binary_cross_entropy_with_logits of a -inf logit with target 0
    (lambda: F.binary_cross_entropy_with_logits(torch.tensor([-INF, 1.0]), torch.tensor([0.0, 1.0])),
     "aten.binary_cross_entropy_with_logits.default",
     "binary_cross_entropy_with_logits of infinite values: 1 of 2 elements of `self` is infinite"),
], ids=["cos", "bce_with_logits"])
def test_nan_an_op_makes_of_infinities_names_the_inputs_holding_them(run, op, words):
    """Ops with no pattern of their own said only "made NaN from inputs without NaN" (a probe, session 51)."""
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            run()
    finding = raised.value.report
    assert (finding.op, finding.reason, finding.diagnosis) == (op, "made NaN from inputs without NaN", words)
