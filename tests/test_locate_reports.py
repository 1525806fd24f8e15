"""locate on real NaN/inf bug reports from public trackers, reproduced here on the running torch. Each
case cites its source and names the expected first producer (op, phase, autograd node, source line);
an independent tracer (tests/grounding.py, no nanfast code) grounds the op, phase and node."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
import torch.nn.functional as F

import nanfast
from grounding import first_made

_SOURCE = pathlib.Path(__file__).read_text().splitlines()


def cross_entropy_all_ignored():
    # pytorch/pytorch#70348: nn.CrossEntropyLoss returns nan when every label is ignore_index
    logits = torch.rand(10, 5, requires_grad=True)
    F.cross_entropy(logits, torch.full((10,), -100)).backward()  # <ce-ignored>


def sft_loss_all_masked_labels():
    # nvidia-cosmos/cosmos-rl#155: SFT loss NaN when every label of a sample is -100
    model = torch.nn.Linear(8, 16)
    hidden = torch.randn(2, 4, 8)
    labels = torch.tensor([[3, 5, -100, -100], [-100, -100, -100, -100]])
    losses = [F.cross_entropy(model(h), y) for h, y in zip(hidden, labels)]  # <sft-masked>
    sum(losses).backward()


def mha_fully_padded_sequence():
    # pytorch/pytorch#40932: MultiheadAttention NaN when key_padding_mask is all True for a sequence
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(4, 2)
    x = torch.randn(3, 2, 4)
    padding = torch.tensor([[False, False, False], [True, True, True]])
    out, _ = attention(x, x, x, key_padding_mask=padding)  # <mha-padded>
    out.sum().backward()


def mha_fully_masked_head():
    # pytorch/pytorch#160064: MultiheadAttention all NaN when attn_mask fully masks a head, need_weights=True
    torch.manual_seed(0)
    x = torch.randn(1, 5, 3)
    mask = torch.tensor([False, False, True]).view(-1, 1, 1).expand(-1, 5, 5)
    attention = torch.nn.MultiheadAttention(3, 3, batch_first=True)
    y, _ = attention(x, x, x, attn_mask=mask, average_attn_weights=False, need_weights=True)  # <mha-head>
    y.sum().backward()


def weight_norm_of_zero_weights():
    # pytorch/pytorch#19126: weight_norm returns nan for zero weights
    layer = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(3, 2))
    with torch.no_grad():
        layer.parametrizations.weight.original1.zero_()
    layer(torch.randn(4, 3)).sum().backward()  # <weight-norm>


def distance_transform_log_of_zero():
    # kornia/kornia#4183: distance_transform NaN gradients, log(0) of an all-zero convolution
    x = torch.zeros(1, 1, 4, 4, requires_grad=True)
    kernel = torch.ones(1, 1, 3, 3) / 9
    cdt = F.conv2d(x, kernel, padding=1)
    cdt = -0.35 * torch.log(cdt)  # <kornia-log>
    torch.nan_to_num(cdt, nan=0.0, posinf=0.0, neginf=0.0).sum().backward()


def normuon_zero_gradient_ratio():
    # microsoft/dion#24: NorMuon NaN loss when a weight's gradients are zero (norm_U / norm_U_new = 0/0)
    update = torch.zeros(4, 4, requires_grad=True)
    normalized = update * 2.0
    ratio = update.norm() / normalized.norm()  # <normuon>
    (normalized * ratio).sum().backward()


def euclidean_similarity_of_identical_embeddings():
    # huggingface/sentence-transformers#4033: NaN gradients of sqrt(sum(diff^2)) for identical embeddings
    anchor = torch.randn(3, 4, requires_grad=True)
    positive = anchor.detach().clone()
    positive[1] = torch.randn(4)
    distance = torch.sqrt(((anchor - positive) ** 2).sum(-1))  # <euclid>
    F.relu(distance + 1.0).sum().backward()


def pow_of_zero_magnitudes():
    # asteroid-team/asteroid#121: torch.pow backward NaN on zero values (PMSQE loss)
    spectrum = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
    loudness = spectrum ** 0.23  # <pmsqe-pow>
    loudness.sum().backward()


def std_over_a_dim_of_one():
    # pytorch/pytorch#4320 (comment): torch.std over a dimension with a single entry returns nan
    a = torch.randn(1, 10, 10, requires_grad=True)
    torch.std(a, dim=0).sum().backward()  # <std-one>


def ctc_target_longer_than_input():
    # ypwhs/captcha_break#29: CTC loss nan/inf when target_length is too long for input_length
    log_probs = torch.randn(6, 2, 10).log_softmax(-1).detach().requires_grad_()
    targets = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 0, 0, 0, 0, 0]])
    F.ctc_loss(log_probs, targets, torch.tensor([6, 6]), torch.tensor([8, 3])).backward()  # <ctc-long>


def fp16_attention_scores_overflow():
    # pytorch/pytorch#40497 (comment of 2022-06-21): in fp16 the attention matmul overflows before the softmax
    q = torch.full((1, 4, 64), 40.0, dtype=torch.float16, requires_grad=True)
    k = torch.full((1, 4, 64), 40.0, dtype=torch.float16)
    scores = torch.bmm(q, k.transpose(1, 2))  # <fp16-scores>
    scores.float().softmax(-1).sum().backward()


def cross_entropy_sequence_all_ignored():
    # pytorch/pytorch#116349: CrossEntropyLoss(reduction='mean') is nan when every label is -100
    logits = torch.randn(1, 5, 10, requires_grad=True)
    labels = torch.full((1, 5), -100)
    F.cross_entropy(logits.view(-1, 10), labels.view(-1)).backward()  # <ce-seq>


def fp16_residual_overflow():
    # huggingface/transformers#12225: Pegasus in fp16, the layer's output is inf though fc2's is 6.06e4
    fc2_out = torch.full((2, 4), 6.06e4, dtype=torch.float16, requires_grad=True)
    residual = torch.full((2, 4), 3.0e4, dtype=torch.float16)
    hidden = residual + fc2_out  # <pegasus-add>
    hidden.float().sum().backward()


def attention_rows_sliced_away():
    # pytorch/pytorch#41508: MultiheadAttention NaN gradients with key_padding_mask and attn_mask,
    # although the NaN rows are removed later in the forward
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(4, 1)
    x = torch.randn(4, 1, 4)
    causal = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)
    causal[2, :] = True  # bucketed attention: a query that sees nothing
    out, _ = attention(x, x, x, attn_mask=causal)  # <mha-bucket>
    out[:2].sum().backward()


def mha_3d_mask_with_padding():
    # pytorch/pytorch#63271: a 3D attn_mask with key_padding_mask makes NaN rows (softmax of all -inf)
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(4, 2)
    x = torch.randn(5, 1, 4)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1).expand(2, 5, 5).clone()
    causal[:, 4, :] = True  # the padded position's row, masked whole as the report's mask does
    out, _ = attention(x, x, x, attn_mask=causal)  # <mha-3d>
    out.sum().backward()


def unnormalized_fp16_attention_scores():
    # plemeri/InSPyReNet#36: query and key are not normalized, and bmm makes inf in float16
    query = torch.full((1, 16, 128), 30.0, dtype=torch.float16)
    key = torch.full((1, 16, 128), 30.0, dtype=torch.float16, requires_grad=True)
    scores = torch.bmm(query, key.transpose(1, 2))  # <inspyre-bmm>
    scores.float().sum().backward()


def favor_normalizer_underflow():
    # facebookresearch/xformers#96: Favor attention's normalization step underflows in fp16, then divides
    features = torch.full((4, 8), 1e-4, dtype=torch.float16, requires_grad=True)
    normalizer = features * features  # 1e-8 underflows to 0 in float16
    out = features / normalizer  # <favor-div>
    out.float().sum().backward()


def l2_normalize_through_rsqrt():
    # keras-team/keras#23075: ops.normalize(order=2) on torch, rsqrt(0) = inf for a zero vector
    x = torch.zeros(2, 3)
    x[0] = torch.tensor([1.0, 2.0, 2.0])
    x.requires_grad_()
    inv_norm = torch.rsqrt((x * x).sum(-1, keepdim=True))  # <keras-rsqrt>
    (x * torch.minimum(inv_norm, torch.tensor(1e12))).sum().backward()


def where_does_not_protect_the_off_branch():
    # Ciela-Institute/caustics#83: torch.where does not protect from NaN in the off branch (NFW lens)
    x = torch.tensor([0.5, 2.0], requires_grad=True)
    inside = torch.acos(1 / x)  # <caustics-acos>
    outside = torch.acosh(1 / x)
    torch.where(x > 1, inside, outside).sum().backward()


def ring_attention_sft_all_ignored():
    # OpenRLHF/OpenRLHF#583: SFT with ring attention, a ring group whose labels are all IGNORE_INDEX
    logits = torch.tensor([[0.2, 1.0, 0.5], [0.1, 0.3, 0.6]], requires_grad=True)
    F.cross_entropy(logits, torch.tensor([-100, -100]), ignore_index=-100).backward()  # <openrlhf>



def log_of_softmax_underflow():
    # pytorch/pytorch#1620: torch.log(softmax(x)) instead of log_softmax, a pointer network's loss: the
    # softmax underflows to 0 (the report's logits [0, 50, -50] through a random Linear), and log(0) = -inf
    layer = torch.nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(3))
    log_p = torch.log(F.softmax(layer(torch.tensor([[0.0, 100.0, -100.0]])), dim=-1))  # <log-softmax>
    F.nll_loss(log_p, torch.tensor([1])).backward()


def gumbel_softmax_at_zero_temperature():
    # pytorch/pytorch#184031: F.gumbel_softmax with tau=0 (an annealed temperature reaching 0) is all NaN
    torch.manual_seed(0)
    logits = torch.nn.Linear(4, 5)(torch.randn(2, 4))
    F.gumbel_softmax(logits, tau=0.0, hard=True).sum().backward()  # <gumbel-tau>


CASES = [
    (cross_entropy_all_ignored, "aten.nll_loss_forward.default", "forward", None, "ce-ignored",
     "every one of the 10 targets is ignore_index (-100)"),
    (sft_loss_all_masked_labels, "aten.nll_loss_forward.default", "forward", None, "sft-masked",
     "every one of the 4 targets is ignore_index"),
    (mha_fully_padded_sequence, "aten._softmax.default", "forward", None, "mha-padded", "fully masked"),
    (mha_fully_masked_head, "aten._softmax.default", "forward", None, "mha-head", "fully masked"),
    (weight_norm_of_zero_weights, "aten._weight_norm_interface.default", "forward", None, "weight-norm", None),
    (distance_transform_log_of_zero, "aten.log.default", "forward", None, "kornia-log",
     "log at the edge of its domain"),
    (normuon_zero_gradient_ratio, "aten.div.Tensor", "forward", None, "normuon", "0/0"),
    (euclidean_similarity_of_identical_embeddings, "aten.div.Tensor", "backward", "SqrtBackward0", "euclid",
     "divides by exact zeros"),
    (pow_of_zero_magnitudes, "aten.pow.Tensor_Scalar", "backward", "PowBackward0", "pmsqe-pow",
     "pow of 0 to the negative exponent"),
    (std_over_a_dim_of_one, "aten.std.correction", "forward", None, "std-one",
     "a variance over 1 element with correction 1: 1 - 1 = 0 degrees of freedom"),
    (ctc_target_longer_than_input, "aten._ctc_loss.Tensor", "forward", None, "ctc-long",
     "CTC with impossible alignments: sample 0 needs at least 8 frames"),
    (cross_entropy_sequence_all_ignored, "aten.nll_loss_forward.default", "forward", None, "ce-seq",
     "every one of the 5 targets is ignore_index (-100)"),
    (fp16_residual_overflow, "aten.add.Tensor", "forward", None, "pegasus-add", "float16 overflow in add"),
    (attention_rows_sliced_away, "aten._softmax.default", "forward", None, "mha-bucket",
     "row 2 of 4 along dim 2 is fully masked"),
    (mha_3d_mask_with_padding, "aten._softmax.default", "forward", None, "mha-3d", "fully masked"),
    (unnormalized_fp16_attention_scores, "aten.bmm.default", "forward", None, "inspyre-bmm",
     "the inputs' max |x| are 30 and 30 over 128 terms"),
    (favor_normalizer_underflow, "aten.div.Tensor", "forward", None, "favor-div",
     "divides by exact zeros: 32 of 32 elements"),
    (l2_normalize_through_rsqrt, "aten.rsqrt.default", "forward", None, "keras-rsqrt",
     "rsqrt at the edge of its domain: 1 of 2 elements of `self` is <= 0"),
    (where_does_not_protect_the_off_branch, "aten.acos.default", "forward", None, "caustics-acos",
     "acos at the edge of its domain: 1 of 2 elements of `self` is outside [-1, 1] (min 2, max 2)"),
    (ring_attention_sft_all_ignored, "aten.nll_loss_forward.default", "forward", None, "openrlhf",
     "every one of the 2 targets is ignore_index (-100)"),
    (fp16_attention_scores_overflow, "aten.bmm.default", "forward", None, "fp16-scores",
     "torch.float16 overflow in a matmul"),
    (log_of_softmax_underflow, "aten.log.default", "forward", None, "log-softmax", "log at the edge of its domain"),
    (gumbel_softmax_at_zero_temperature, "aten.div.Tensor", "forward", None, "gumbel-tau", "divides by the number 0"),
]


def located(report, op: str, phase: str, node, marker: str):
    """The finding locate raises on report(): its op, phase and node as given, at the line marked <marker>."""
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            report()
    finding = raised.value.report
    assert (finding.op, finding.phase, finding.node) == (op, phase, node)
    assert finding.where is not None and finding.where.filename == __file__
    assert _SOURCE[finding.where.lineno - 1].endswith(f"# <{marker}>")
    assert finding.where.called_from is None  # the user's own line: no library line to look past
    return finding


@pytest.mark.filterwarnings("ignore:std\\(\\)")
@pytest.mark.parametrize("report, op, phase, node, marker, words", CASES, ids=[c[0].__name__ for c in CASES])
def test_locate_names_the_grounded_first_producer(report, op, phase, node, marker, words):
    grounded = first_made(report)
    assert grounded is not None and tuple(grounded) == (op, phase, node)  # the tracer agrees with the table
    finding = located(report, op, phase, node, marker)
    if words is None:
        assert finding.diagnosis is None
    else:
        assert finding.diagnosis is not None and words in finding.diagnosis, finding.diagnosis


_BACKWARD_CASES = [c for c in CASES if c[2] == "backward"]


@pytest.mark.filterwarnings("ignore:Error detected in")
@pytest.mark.parametrize("report, op, phase, node, marker, words", _BACKWARD_CASES,
                         ids=[c[0].__name__ for c in _BACKWARD_CASES])
def test_backward_findings_name_the_forward_line_without_node_creation_hook(
        monkeypatch, report, op, phase, node, marker, words):
    """torch 2.11 has no torch.autograd.graph.node_creation_hook (on it these findings had no line):
    locate takes the line from anomaly mode's stack of the node instead (NOTE: [Forward lines without
    node_creation_hook]), and leaves anomaly mode as it found it."""
    monkeypatch.delattr(torch.autograd.graph, "node_creation_hook", raising=False)
    located(report, op, phase, node, marker)
    assert not torch.is_anomaly_enabled()


def test_a_fault_inside_a_library_adds_the_users_line_that_called_it():
    """transformers' own causal-LM loss (loss_utils.fixed_cross_entropy) divides the summed loss by
    num_items_in_batch, which is 0 when every label of the accumulation window is -100: 0/0, the pattern
    of NVIDIA-NeMo/Automodel#3796. The op's line is the library's; the finding adds the line of the
    user's code that called into it (a probe, session 38: only the library line was given)."""
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.full((2, 5), -100)
    with pytest.raises(nanfast.NonFiniteError) as raised, nanfast.locate():
        loss_utils.ForCausalLMLoss(logits, labels, vocab_size=11, num_items_in_batch=torch.tensor(0))  # <hf-loss>
    finding = raised.value.report
    assert (finding.op, finding.phase) == ("aten.div.Tensor", "forward")
    assert (finding.where.filename, finding.where.function) == (loss_utils.__file__, "fixed_cross_entropy")
    caller = finding.where.called_from
    assert caller is not None and caller.filename == __file__ and _SOURCE[caller.lineno - 1].endswith("# <hf-loss>")
    assert f"(called from {caller})" in finding.summary() and finding.to_dict()["source"] == str(finding.where)


def test_frozen_modules_are_library_code_and_the_demo_is_not(monkeypatch):
    """Run as `python -m nanfast demo` from an installed package, the demo's own line (user code by
    design) was said to be "called from <frozen runpy>:88": the package sits in site-packages, and a frozen
    standard-library module was taken for the user's. Both are told apart now."""
    from nanfast.locator import source

    installed = os.path.dirname(source._NANFAST_DIR.rstrip(os.sep)) + os.sep  # as if in site-packages
    monkeypatch.setattr(source, "_LIBRARY_DIRS", (installed,))
    monkeypatch.setattr(source, "_library_by_filename", {})
    assert source._in_library("<frozen runpy>") and source._in_library(os.path.join(installed, "pkg", "mod.py"))
    assert not source._in_library(source._USER_FILES_IN_PACKAGE[0])
    assert not source._in_library("<stdin>") and not source._in_library(os.path.join(os.sep, "home", "me", "train.py"))
