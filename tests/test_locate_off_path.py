"""locate and the values a training step computes on the side of its gradient path (NOTE: [off the
gradient path]): an inf made there and thrown away is a note; one that reaches the gradient path, the
host or the region's end alive is reported, naming the op that made it."""

from __future__ import annotations

import math

import pytest
import torch

import nanfast

MAX_EXACT, BUCKETS = 4, 8


def relative_buckets(n: int) -> torch.Tensor:
    """huggingface/transformers' T5 relative position buckets (modeling_t5.py _relative_position_bucket,
    copied into mt5, longt5, switch_transformers, ...): log(0) on the diagonal, cast to an integer and
    dropped by the where()."""
    position = torch.arange(n)
    relative = (position[None, :] - position[:, None]).abs()
    large = MAX_EXACT + (torch.log(relative.float() / MAX_EXACT) / math.log(32 / MAX_EXACT)  # <t5-log>
                         * (BUCKETS - MAX_EXACT)).to(torch.long)
    return torch.where(relative < MAX_EXACT, relative, torch.clamp(large, max=BUCKETS - 1))


class RelativeBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.bias = torch.nn.Embedding(BUCKETS, 1)

    def forward(self, x):
        h = self.proj(x)
        scores = h @ h.transpose(-1, -2) + self.bias(relative_buckets(x.shape[-2])).squeeze(-1)
        return scores.softmax(-1) @ h


def test_an_inf_computed_beside_the_gradient_path_and_dropped_is_a_note():
    """T5's buckets stopped every healthy T5 step at aten.log (a probe, session 43)."""
    torch.manual_seed(0)
    model = RelativeBias()
    with nanfast.locate(action="record") as region:
        model(torch.randn(2, 6, 4)).sum().backward()
    assert region.findings == []
    assert [(note.op, note.phase) for note in region.masked] == [("aten.log.default", "forward")]
    with nanfast.locate():  # the default action raises on nothing
        model(torch.randn(2, 6, 4)).sum().backward()
    assert all(p.grad.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize("checkpointing", [None, False, True, "frozen encoder"],
                         ids=["plain", "checkpointed", "reentrant", "frozen-encoder"])
def test_the_real_t5_model_trains_under_locate(checkpointing):
    """With gradient checkpointing (a probe, session 44) the log(0) ran again in backward (phase
    "recompute"), or first under no_grad (use_reentrant=True), and was reported there. With the encoder
    and the shared embedding frozen (a probe, session 52), it ran before any op read a tensor that
    requires grad, and was reported at once."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    model = transformers.T5ForConditionalGeneration(config)
    if checkpointing == "frozen encoder":
        model.get_encoder().requires_grad_(False)
        model.shared.requires_grad_(False)
    elif checkpointing is not None:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    optimizer = torch.optim.AdamW(model.parameters())
    ids, labels = torch.randint(1, 100, (2, 8)), torch.randint(1, 100, (2, 5))
    with nanfast.locate(action="record") as region:
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    assert region.findings == [] and {note.op for note in region.masked} == {"aten.log.default"}
    assert all(p.isfinite().all() for p in model.parameters())
    with torch.no_grad():  # a real fault after the buckets: the first finding is its, not the log's
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight[0, 0] = float("inf")
    with nanfast.locate(action="record") as region:
        model(input_ids=ids, labels=labels).loss.backward()
    assert region.findings and region.findings[0].op != "aten.log.default"
    assert "aten.log.default" not in {f.op for f in region.findings}


def test_faster_rcnn_with_an_image_without_boxes_trains_under_locate():
    """torchvision encodes the regression targets of an image without boxes as log(0) and reads only the
    positive rows (a probe, session 43: four findings on a healthy step)."""
    detection = pytest.importorskip("torchvision.models.detection")
    torch.manual_seed(0)
    model = detection.fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, num_classes=3,
                                                            min_size=96, max_size=96).train()
    images = [torch.rand(3, 96, 96), torch.rand(3, 96, 96)]
    targets = [{"boxes": torch.tensor([[10.0, 10.0, 60.0, 70.0]]), "labels": torch.tensor([1])},
               {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}]
    with nanfast.locate(action="record") as region:
        sum(model(images, targets).values()).backward()
    assert region.findings == [] and region.masked
    assert all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())


def _step_with(use):
    """A step of a model with a gradient path, and log(0) of data on the side, used by `use`."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 3)
    x = torch.rand(4, 3)
    x[1, 2] = 0.0
    h = linear(x)  # the gradient path exists
    side = torch.log(x)  # <side-log>
    return use(h, side)


@pytest.mark.parametrize("use", [
    pytest.param(lambda h, side: (h + side).sum().backward(), id="enters the gradient path"),
    pytest.param(lambda h, side: side.sum().item(), id="read to the host"),
    pytest.param(lambda h, side: side, id="alive at the region's end"),
    pytest.param(lambda h, side: (side * 2)[1:], id="a view of what it tainted, alive at the end"),
])
def test_an_inf_beside_the_gradient_path_that_matters_is_reported_at_its_op(use):
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            kept = _step_with(use)  # noqa: F841  (kept alive to the region's end)
    finding = raised.value.report
    assert (finding.op, finding.phase, finding.kind) == ("aten.log.default", "forward", "producer")
    assert "<side-log>" in open(finding.source.filename).read().splitlines()[finding.source.lineno - 1]


def test_an_inf_beside_the_gradient_path_is_not_raised_over_the_exception_that_left_the_region():
    with pytest.raises(KeyError):
        with nanfast.locate() as region:
            kept = _step_with(lambda h, side: side)  # noqa: F841
            raise KeyError("the loop's own error")
    assert region.findings == [] and [note.op for note in region.masked] == ["aten.log.default"]


def test_without_a_gradient_path_a_finding_is_reported():
    """Ops under no_grad have no gradient path to be off: reported at once. Ops on plain tensors in grad
    mode are held until the region ends (a trained parameter might still be read: see the frozen test
    below), then reported, though the value was dropped: the region never had a gradient path."""
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            relative_buckets(6)
    assert raised.value.report.op == "aten.log.default"
    with nanfast.locate(action="record") as region:
        relative_buckets(6)
    assert [f.op for f in region.findings] == ["aten.log.default"] and region.masked == []
    with torch.no_grad(), pytest.raises(nanfast.NonFiniteError):
        with nanfast.locate():
            RelativeBias()(torch.randn(2, 6, 4))
            raise AssertionError("not reached: under no_grad the log raises at its op")


def test_an_inf_beside_the_gradient_path_before_any_trained_parameter_is_a_note():
    """A frozen prefix (a T5 whose encoder is frozen, a probe, session 52) runs the buckets' log(0) before
    any op reads a tensor that requires grad: it was reported at once, and every healthy step stopped."""
    torch.manual_seed(0)
    model = RelativeBias()
    model.proj.requires_grad_(False)
    with nanfast.locate(action="record") as region:
        model(torch.randn(2, 6, 4)).sum().backward()
    assert region.findings == [] and [note.op for note in region.masked] == ["aten.log.default"]
    assert model.bias.weight.grad is not None and model.bias.weight.grad.isfinite().all()


def test_an_optimizer_update_that_makes_inf_is_reported_at_its_op():
    """optimizer.step() runs under no_grad, beside no gradient path: an update that divides by zero (Adam
    with eps 0 on a zero gradient's square root) is reported at its op, not held to the region's end."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 3)
    optimizer = torch.optim.Adam(linear.parameters(), eps=0.0, foreach=False)
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            (linear(torch.randn(2, 3)) * 0).sum().backward()  # zero gradients: 0 / (0 + 0)
            optimizer.step()
            raise AssertionError("not reached: the update raises at its op")
    assert raised.value.report.phase == "forward" and "optimizer" not in raised.value.report.op
