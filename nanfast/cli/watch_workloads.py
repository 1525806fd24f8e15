"""The training steps the watch suite (bench_watch.py) times: a small MLP at two batch sizes, a small and a
d=256 transformer, and ResNet-18 at two input sizes, each a model with a fixed batch, by short key."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch

# From the fastest step to the slowest (2 threads, CPU; steps as measured on the 2-vCPU AMD EPYC VM of
# issue 19): the MLP with a batch of 32 (2.1 M parameters, a ~4 ms step, where the watch's fixed cost
# per module call and per step weighs most), the same MLP with the batch issue 19 sized for a ~10 ms
# step there (128), a small transformer (~20 ms), the d=256 one (~0.35 s), ResNet-18 on small images
# (~60 ms, where reading the 11.7 M parameters' gradients weighs most) and on ImageNet's 224x224 (~0.6 s).
MLP = dict(features=784, width=850, layers=4, classes=10, batch=32)
MLP_10MS_BATCH = 128
SMALL_TRANSFORMER = dict(layers=2, d_model=128, nhead=4, dim_feedforward=512, vocab=1000, batch=8, seq=64)
TRANSFORMER = dict(layers=4, d_model=256, nhead=4, dim_feedforward=1024, vocab=1000, batch=16, seq=128)
CNNS = (dict(batch=16, image=64, classes=100), dict(batch=16, image=224, classes=1000))
KEYS = ("mlp", "mlp-128", "transformer-small", "transformer-d256", "resnet18-64", "resnet18-224")

Batch = Callable[[], tuple[torch.Tensor, torch.Tensor]]


class MLP4(torch.nn.Module):
    """`layers` Linear layers (features -> width -> ... -> classes) with GELU between them."""

    def __init__(self, features: int, width: int, layers: int, classes: int, **_):
        super().__init__()
        sizes = [features] + [width] * (layers - 1) + [classes]
        blocks: list[torch.nn.Module] = []
        for i, (cin, cout) in enumerate(zip(sizes, sizes[1:])):
            blocks.append(torch.nn.Linear(cin, cout))
            if i < layers - 1:
                blocks.append(torch.nn.GELU())
        self.net = torch.nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TinyTransformer(torch.nn.Module):
    def __init__(self, layers: int, d_model: int, nhead: int, dim_feedforward: int, vocab: int, **_):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class BasicBlock(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.relu = torch.nn.ReLU(inplace=True)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(torch.nn.Module):
    """ResNet-18's layout (torchvision is not a dependency): a 7x7 stem, four stages of two basic blocks."""

    def __init__(self, classes: int, **_):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(64)
        self.relu = torch.nn.ReLU(inplace=True)
        self.maxpool = torch.nn.MaxPool2d(3, 2, 1)
        widths = [64, 128, 256, 512]
        stages, cin = [], 64
        for i, w in enumerate(widths):
            stages.append(torch.nn.Sequential(BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _mlp(device: str, batch: Optional[int] = None) -> tuple[str, torch.nn.Module, Batch]:
    m = MLP if batch is None else dict(MLP, batch=batch)
    model = MLP4(**m).to(device)
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(m["batch"], m["features"], device=device)
    y = torch.randint(0, m["classes"], (m["batch"],), device=device)
    return (f"MLP ({m['layers']} Linear, width {m['width']}, {params / 1e6:.1f}M params, batch {m['batch']})",
            model, lambda: (x, y))


def _transformer(t: dict, device: str) -> tuple[str, torch.nn.Module, Batch]:
    tokens = torch.randint(0, t["vocab"], (t["batch"], t["seq"]), device=device)
    return (f"transformer ({t['layers']} layers, d={t['d_model']}, batch {t['batch']}x{t['seq']})",
            TinyTransformer(**t).to(device), lambda: (tokens, tokens))


def _resnet(c: dict, device: str) -> tuple[str, torch.nn.Module, Batch]:
    images = torch.randn(c["batch"], 3, c["image"], c["image"], device=device)
    labels = torch.randint(0, c["classes"], (c["batch"],), device=device)
    return (f"ResNet-18 (batch {c['batch']}x3x{c['image']}x{c['image']})", ResNet18(**c).to(device),
            lambda: (images, labels))


def make_workloads(device: str, only: Sequence[str] = ()) -> list[tuple[str, torch.nn.Module, Batch]]:
    """The workloads as (name, model, batch), in KEYS order.

    Args:
        device: where the models and batches live.
        only: keys from KEYS to build (default: all).

    Returns:
        A list of (name, model, batch), where batch() returns the (input, target) of every step.

    Raises:
        ValueError: a key in `only` is not in KEYS."""
    unknown = [k for k in only if k not in KEYS]
    if unknown:
        raise ValueError(f"nanfast bench --suite watch: unknown workload(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(KEYS)}")
    makers = {"mlp": lambda: _mlp(device), "mlp-128": lambda: _mlp(device, MLP_10MS_BATCH),
              "transformer-small": lambda: _transformer(SMALL_TRANSFORMER, device),
              "transformer-d256": lambda: _transformer(TRANSFORMER, device),
              "resnet18-64": lambda: _resnet(CNNS[0], device), "resnet18-224": lambda: _resnet(CNNS[1], device)}
    return [makers[key]() for key in KEYS if not only or key in only]
