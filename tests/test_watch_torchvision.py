"""The watch on torchvision's own models (random init, nothing downloaded), code no one here wrote: healthy
training steps and an evaluation pass never raise, and faults planted the way real runs meet them are
named where they are: a non-finite weight, a BatchNorm whose running variance went negative (a corrupted
checkpoint), and a detection target whose box has a NaN coordinate. torchvision's degenerate-box check
(pytorch/vision#2240, made for the "loss is nan" reports #997, #1176, #1994) compares coordinates, and
NaN compares false, so that box trains into a NaN loss (loss_box_reg and loss_rpn_box_reg)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast
from op_recorder import OpRecorder
from training_state import equal, state_of

torchvision = pytest.importorskip("torchvision")  # in the `test` extra: CI installs it
from torchvision import models  # noqa: E402

# Each test runs with the recorder's counts on the host and as tensors, as on a GPU (conftest.py).
pytestmark = pytest.mark.usefixtures("recorder_counts")


def _vit() -> torch.nn.Module:
    return models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                    mlp_dim=64, num_classes=10)


# name -> (model maker, image size): convolutions with BatchNorm and in-place ReLU, depthwise and
# squeeze-excitation blocks, concatenation (DenseNet), auxiliary outputs (GoogLeNet's namedtuple), a
# vision transformer, shifted-window attention with its masks (Swin).
CLASSIFIERS = {
    "resnet18": (lambda: models.resnet18(num_classes=10), 64),
    "mobilenet_v3_small": (lambda: models.mobilenet_v3_small(num_classes=10), 64),
    "densenet121": (lambda: models.densenet121(num_classes=10), 32),
    "googlenet": (lambda: models.googlenet(num_classes=10, aux_logits=True, init_weights=True), 64),
    "vit": (_vit, 32),
    "swin_t": (lambda: models.swin_t(num_classes=10), 64),
}


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out[0]  # GoogLeNet in training: (logits, aux2, aux1)


def _train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, **options) -> nanfast.watcher.Watch:
    # A small step: at lr 1e-3 with momentum DenseNet-121 on a batch of 2 really does overflow in evaluation
    # two steps later (its BatchNorms' running statistics lag the weights; the watch named
    # denselayer8.conv2 in a first version of this test, as forward hooks confirm without it).
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    with nanfast.watch(model, optimizer, **options) as w:
        for _ in range(steps):
            optimizer.zero_grad()
            loss = w.loss(torch.nn.functional.cross_entropy(_logits(model(x)), y))
            loss.backward()
            optimizer.step()
    return w


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_healthy_classifier_never_raises(name):
    torch.manual_seed(0)
    make, size = CLASSIFIERS[name]
    model = make()
    x, y = torch.randn(2, 3, size, size), torch.tensor([1, 7])
    # Inference on the untrained copy: after two steps on a batch of 2 the running statistics lag the
    # weights, and DenseNet-121 in eval mode really overflows on one thread (BatchNorm outputs +-inf in
    # denseblock2, confirmed by plain isinf hooks without nanfast), not on two.
    untrained = copy.deepcopy(model).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a warning
        w = _train(model, x, y, steps=2, action="raise")
        with nanfast.watch(untrained, action="raise") as inference, torch.no_grad():
            untrained(x)
    assert w.events == [] and w.step_count == 2
    assert inference.events == [] and inference.step_count == 1
    # It looked: every step's record counts what it read (a watch that read nothing would say nothing).
    assert len(w.history) == 2 and all(record.nan == 0 for record in w.history)
    assert all(record.grad_norm > 0 for record in w.history)


def test_inf_weight_in_resnet_is_named_as_the_first_place():
    torch.manual_seed(0)
    model = models.resnet18(num_classes=10)
    with torch.no_grad():
        model.layer3[0].conv1.weight[0, 0, 0, 0] = float("inf")
    with pytest.warns(RuntimeWarning):
        w = _train(model, torch.randn(2, 3, 64, 64), torch.tensor([1, 7]), steps=1, action="warn")
    event = w.events[0]
    assert (event.phase, event.name, event.posinf, event.nan) == ("param", "layer3.0.conv1.weight", 1, 0)
    # The first activation it reached is that convolution's output.
    assert event.later[0].where() == "output of layer3.0.conv1 (Conv2d)"


def test_negative_running_var_names_the_batchnorm_in_evaluation():
    torch.manual_seed(0)
    model = models.resnet18(num_classes=10).eval()
    with torch.no_grad():
        model.layer2[1].bn2.running_var[3] = -1.0  # finite, so no parameter check sees it: its output does
    with nanfast.watch(model, action="warn") as w, pytest.warns(RuntimeWarning), torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    assert w.events[0].first.where() == "output of layer2.1.bn2 (BatchNorm2d)"
    assert w.events[0].nan > 0


@pytest.mark.parametrize("fuse", [False, True], ids=["default", "fused"])
def test_a_batchnorm_nan_kept_by_mobilenets_in_place_hardswish_names_the_batchnorm(fuse):
    """mobilenet_v3's blocks are Conv2d, BatchNorm2d, Hardswish(inplace=True): the Hardswish rewrites the
    BatchNorm's output and keeps its NaN. The fused watch (the default on GPUs) named the Hardswish (a
    probe, session 54); both watches name the BatchNorm (NOTE: [Non-finite values an in-place activation
    keeps] in csrc/python/deferred_records.h)."""
    torch.manual_seed(0)
    model = models.mobilenet_v3_small(num_classes=10).eval()
    assert isinstance(model.features[0][2], torch.nn.Hardswish) and model.features[0][2].inplace
    with torch.no_grad():
        model.features[0][1].running_var[3] = -1.0
    with nanfast.watch(model, action="warn", fuse=fuse) as w, pytest.warns(RuntimeWarning), torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    assert w.events[0].first.where() == "output of features.0.1 (BatchNorm2d)"
    assert w.events[0].later[0].where() == "output of features.0.2 (Hardswish)"


def _first_place_of_a_resnet18_inference(fuse: bool, plant) -> str:
    torch.manual_seed(0)
    model = models.resnet18(num_classes=10).eval()
    with torch.no_grad():
        plant(model)
    with nanfast.watch(model, action="warn", fuse=fuse) as w, pytest.warns(RuntimeWarning), torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    return w.events[0].first.where()


def _negative_running_var(bn):
    def plant(model):
        model.get_submodule(bn).running_var[3] = -1.0
    return plant


def _nan_weight(conv):
    def plant(model):
        model.get_submodule(conv).weight[0, 0, 0, 0] = float("nan")
    return plant


@pytest.mark.parametrize("fuse", [False, True], ids=["default", "fused"])
@pytest.mark.parametrize("place,plant", [("layer1.0.bn2 (BatchNorm2d)", _negative_running_var("layer1.0.bn2")),
                                         ("layer2.0.downsample.0 (Conv2d)", _nan_weight("layer2.0.downsample.0"))],
                         ids=["bn2", "downsample"])
def test_a_nan_made_in_a_resnet_block_is_named_where_it_was_made(fuse, place, plant):
    """BasicBlock ends `out = self.bn2(...); out += identity; out = self.relu(out)` (in place) and returns
    `out`: the fused watch (the default on GPUs) named the block for bn2's NaN (a probe, session 55); both
    watches name bn2 (NOTE: [A child's output a module changes in place and returns] in
    csrc/python/deferred_records.h), and a NaN the downsampling branch brings in through the add is named
    there, not at bn2."""
    assert _first_place_of_a_resnet18_inference(fuse, plant) == f"output of {place}"


def test_what_the_fused_watch_gives_up_bn2_of_a_downsampling_block_is_named_at_the_block():
    """Documented: in a block whose downsampling branch runs between bn2 and the add, the fused watch
    cannot tell bn2's NaN from one the branch brought in, and names the block that holds both (the
    default watch names bn2)."""
    plant = _negative_running_var("layer2.0.bn2")
    assert _first_place_of_a_resnet18_inference(False, plant) == "output of layer2.0.bn2 (BatchNorm2d)"
    assert _first_place_of_a_resnet18_inference(True, plant) == "output of layer2.0 (BasicBlock)"


@pytest.mark.parametrize("bound", [None, 1 << 20], ids=["one flush", "a flush per MiB"])
def test_a_fused_resnet_step_leaves_its_rewritten_rows_uncounted_without_an_op(bound, monkeypatch):
    """Each ResNet block rewrites its bn2 output in place, so every flush of a fused watch keeps less of
    those rows' counts: on a GPU that was a zero_ launch per row, 17 per step of ResNet-18 (49 of
    ResNet-50) on a step its host bounds, then one multiply per flush by a mask. The summary now leaves
    those cells out as it sums (NOTE: [Cells a record does not count]), by a mask made and copied once
    while the step's cells stay the same, however many flushes a step makes; on a CPU the counts are
    numbers and zeroed there. No op is made for them. A NaN in a block's bn2 is still named there."""
    if bound is not None:
        monkeypatch.setattr(nanfast.watcher, "FUSE_BYTES", bound)
    torch.manual_seed(0)
    model = models.resnet18(num_classes=10)
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([1, 2])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanfast.watch(model, optimizer, fuse=True) as w:
        for _ in range(3):
            with OpRecorder() as ops:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
        flushes = ops.counts["nanfast.stats.default"]
        assert (flushes > 2) == (bound is not None)
        assert "aten.zero_.default" not in ops.counts and "aten.ones.default" not in ops.counts  # no mask made again
        assert "aten.mul_.Tensor" not in ops.counts and "aten._to_copy.default" not in ops.counts
        assert w.events == []
    assert _first_place_of_a_resnet18_inference(True, _negative_running_var("layer1.0.bn2")) == \
        "output of layer1.0.bn2 (BatchNorm2d)"


@pytest.mark.parametrize("where", ["between steps", "inside the accumulation window"])
def test_validating_at_every_step_makes_no_mask_again(where, recorder_counts):
    """A loop that validates (or makes a rollout) at every step alternates two sets of cells a record does
    not count: the training step's and the evaluation's (each ResNet block's rewritten bn2 output). The
    recorder kept only the last mask, so it made both anew at each step (on a GPU two copies a step); it
    keeps a few now. The evaluation inside the accumulation window is taken out of the step
    (take(first_slot): NOTE: [An evaluation inside a training step])."""
    torch.manual_seed(0)
    model = models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y, x_val = torch.randn(2, 3, 64, 64), torch.tensor([1, 2]), torch.randn(2, 3, 64, 64)

    def validate():
        model.eval()
        with torch.no_grad():
            model(x_val)
        model.train()

    masks = []
    with nanfast.watch(model, optimizer, fuse=True) as w:
        for _ in range(4):
            with OpRecorder() as ops:
                optimizer.zero_grad()
                if where == "between steps":
                    validate()
                    F.cross_entropy(model(x), y).backward()
                else:
                    F.cross_entropy(model(x[:1]), y[:1]).backward()
                    validate()
                    F.cross_entropy(model(x[1:]), y[1:]).backward()
                optimizer.step()
            masks.append(ops.counts["aten.ones.default"])
        assert w.events == [] and w.step_count == 4
    # Counts as tensors (as on a GPU): both masks made in the first step, none after it; on the host the
    # counts are numbers, zeroed there, and no mask is made.
    assert masks == ([2, 0, 0, 0] if recorder_counts else [0, 0, 0, 0])


def _detection_batch(nan_box: bool):
    images = [torch.rand(3, 120, 140), torch.rand(3, 100, 130)]
    second = [30.0, float("nan") if nan_box else 40.0, 90.0, 95.0]
    targets = [{"boxes": torch.tensor([[10.0, 20.0, 100.0, 110.0]]), "labels": torch.tensor([1])},
               {"boxes": torch.tensor([second]), "labels": torch.tensor([2])}]
    return images, targets


def test_detection_target_with_a_nan_box_is_a_dirty_input_and_skipped():
    torch.manual_seed(0)
    model = models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=96, max_size=128)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    w = nanfast.watch(model, optimizer, action="skip")
    losses = []
    for nan_box in (False, True, False):
        before = state_of(model, optimizer)
        optimizer.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_dict = model(*_detection_batch(nan_box))
            losses.append({k: v.item() for k, v in loss_dict.items()})
            w.loss(sum(loss_dict.values())).backward()
            optimizer.step()
        if nan_box:
            assert [str(c.message) for c in caught if "skipped" in str(c.message)]
            assert equal(state_of(model, optimizer), before)  # as if the batch never came
    w.remove()
    # torchvision let the box through: the regression losses of that step are NaN, the others finite.
    assert losses[1]["loss_box_reg"] != losses[1]["loss_box_reg"]
    assert all(v == v for step in (losses[0], losses[2]) for v in step.values())
    assert len(w.events) == 1 and w.skipped_steps == 1
    event = w.events[0]
    assert event.step == 1 and event.dirty_input and event.nan == 1
    # Named by FasterRCNN.forward(images, targets): the second image's target, its boxes.
    assert [(e.name, e.nan) for e in event.first.entries] == [("targets[1].boxes", 1)]
    assert "the input batch is dirty: targets[1].boxes (nan=1, +inf=0, -inf=0)" in event.summary()


def test_healthy_detection_training_and_inference_never_raise():
    torch.manual_seed(0)
    model = models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=96, max_size=128)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanfast.watch(model, optimizer, action="raise") as w:
        for _ in range(2):
            optimizer.zero_grad()
            w.loss(sum(model(*_detection_batch(False)).values())).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            detections = model(_detection_batch(False)[0])
    assert w.events == [] and w.step_count == 2 and len(detections) == 2
