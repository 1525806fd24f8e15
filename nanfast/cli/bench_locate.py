"""Cost of `nanfast.locate` on one training step (forward and backward), side by side in one process
with no checks and with `torch.autograd.detect_anomaly()`, on an MLP and a small transformer. Methods
are interleaved across repeats; medians are reported."""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..locator import locate

METHODS = ("none", "nanfast.locate", "detect_anomaly")


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _mlp(device: str) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10)).to(device)
    x = torch.randn(256, 1024, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    return model, lambda: F.cross_entropy(model(x), y)


def _transformer(device: str) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.1, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 128),
                                torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.Linear(128, 1000)).to(device)
    tokens = torch.randint(0, 1000, (8, 64), device=device)
    return model, lambda: F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


WORKLOADS = {
    "MLP 4x1024, batch 256": _mlp,
    "transformer 2 layers d=128, 8x64 tokens": _transformer,
}


def _context(method: str) -> contextlib.AbstractContextManager:
    if method == "nanfast.locate":
        return locate()
    if method == "detect_anomaly":
        return torch.autograd.detect_anomaly()
    return contextlib.nullcontext()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_suite(device: str = "cpu", repeats: int = 5) -> dict:
    torch.manual_seed(0)
    rows = []
    for workload, make in WORKLOADS.items():
        model, loss_fn = make(device)

        def step(method: str) -> float:
            model.zero_grad(set_to_none=True)
            _sync(device)
            start = time.perf_counter()
            with _context(method):
                loss_fn().backward()
            _sync(device)
            return time.perf_counter() - start

        counter = _OpCounter()
        with counter:
            loss_fn().backward()
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # detect_anomaly warns on every entry
            for r in range(repeats + 1):  # the first round warms up
                for method in METHODS:
                    seconds = step(method)
                    if r:
                        samples[method].append(seconds)
        medians = {m: statistics.median(s) for m, s in samples.items()}
        for method in METHODS:
            rows.append({
                "workload": workload, "ops_per_step": counter.ops, "method": method,
                "median_ms": medians[method] * 1e3,
                "x_none": medians[method] / medians["none"],
                "speedup_vs_detect_anomaly": medians["detect_anomaly"] / medians[method],
            })
    lines = ["| workload | ATen ops per step | method | median ms | x no checks | speedup vs detect_anomaly |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['ops_per_step']} | {r['method']} | {r['median_ms']:.1f} | "
                     f"{r['x_none']:.2f} | {r['speedup_vs_detect_anomaly']:.2f} |")
    return {"title": f"nanfast.locate vs detect_anomaly: one training step (forward + backward), {device}",
            "markdown": "\n".join(lines), "rows": rows}
