"""Cost of an always-on `nanfast.watch` on a training step, side by side in one process with no checks,
hand-written per-module `torch.any(isnan + isinf)` hooks and `torch.autograd.detect_anomaly()`, on a small
transformer and ResNet-18 at two input sizes. Methods are interleaved across repeats; medians are reported."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ..watcher import watch

METHODS = ("none", "nanfast.watch", "isnan hooks", "detect_anomaly")

# The workloads: the transformer the issue names, and ResNet-18 at two input sizes: small images (a
# ~0.2 s step on 2 cores, where reading the 11.7 M parameters and their gradients weighs most) and
# ImageNet's 224x224 (a ~1.7 s step).
TRANSFORMER = dict(layers=4, d_model=256, nhead=4, dim_feedforward=1024, vocab=1000, batch=16, seq=128)
CNNS = (dict(batch=16, image=64, classes=100), dict(batch=16, image=224, classes=1000))


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


@contextlib.contextmanager
def isnan_hooks(model: torch.nn.Module) -> Iterator[None]:
    """The hand-written check: a forward hook on every module that tests its output(s) right away."""

    def check(module, args, output):
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and torch.any(torch.isnan(t) + torch.isinf(t)):
                raise FloatingPointError(f"non-finite output of {type(module).__name__}")

    handles = [m.register_forward_hook(check) for m in model.modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _method(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    if name == "nanfast.watch":
        return watch(model, optimizer)
    if name == "isnan hooks":
        return isnan_hooks(model)
    if name == "detect_anomaly":
        return torch.autograd.detect_anomaly(check_nan=True)
    return contextlib.nullcontext()


def _workloads(device: str) -> list[tuple[str, torch.nn.Module, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    t = TRANSFORMER
    tokens = torch.randint(0, t["vocab"], (t["batch"], t["seq"]), device=device)
    workloads = [(f"transformer ({t['layers']} layers, d={t['d_model']}, batch {t['batch']}x{t['seq']})",
                  TinyTransformer(**t).to(device), lambda: (tokens, tokens))]
    for c in CNNS:
        images = torch.randn(c["batch"], 3, c["image"], c["image"], device=device)
        labels = torch.randint(0, c["classes"], (c["batch"],), device=device)
        workloads.append((f"ResNet-18 (batch {c['batch']}x3x{c['image']}x{c['image']})", ResNet18(**c).to(device),
                          lambda images=images, labels=labels: (images, labels)))
    return workloads


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
    loss.backward()
    optimizer.step()


def _timed_step(model, optimizer, batch, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    _step(model, optimizer, *batch())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _measure(device: str, repeats: int) -> list[dict]:
    rows = []
    for workload, model, batch in _workloads(device):
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        ratios: dict[str, list[float]] = {m: [] for m in METHODS}
        _step(model, optimizer, *batch())
        for r in range(repeats):
            this_repeat = {}
            for k in range(len(METHODS)):
                method = METHODS[(r + k) % len(METHODS)]
                with _method(method, model, optimizer):
                    this_repeat[method] = _timed_step(model, optimizer, batch, device)
            for method, t in this_repeat.items():
                times[method].append(t)
                ratios[method].append(t / this_repeat["none"])
        for method in METHODS:
            low, high = median_interval(ratios[method])
            rows.append({"workload": workload, "method": method, "median_ms": statistics.median(times[method]) * 1e3,
                         "overhead_pct": (statistics.median(ratios[method]) - 1) * 100,
                         "overhead_pct_ci95": [(low - 1) * 100, (high - 1) * 100],
                         "overhead_pct_range": [(min(ratios[method]) - 1) * 100, (max(ratios[method]) - 1) * 100],
                         "samples": len(times[method])})
    return rows


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A confidence interval for the median that assumes nothing about the distribution: the order
    statistics x(j) and x(n+1-j) for the largest j with P(Binomial(n, 1/2) < j) <= (1 - level) / 2.
    With too few values for that level, (min, max)."""
    xs = sorted(values)
    n = len(xs)
    outside, j = 0.0, 0  # j values are left out below the interval (and j above)
    while j < n // 2 and outside + math.comb(n, j) / 2**n <= (1 - level) / 2:
        outside += math.comb(n, j) / 2**n
        j += 1
    return xs[max(j - 1, 0)], xs[n - max(j, 1)]


def _measure_inside(device: str, steps: int = 6) -> list[dict]:
    """Per step: the time spent inside the watch (hooks and read) and in its kernels, and the bytes they
    read, with the part of them in the fused pass over parameters and gradients (what the watch reads
    every step whatever the batch: a floor on its cost), as a watch made with profile=True counts them
    (Watch.costs(), the public hook: no patching). Measured within the same steps, so it does
    not move with the machine's load as the difference of two step times does; it leaves out
    nn.Module's slower call path once hooks exist."""
    rows = []
    for workload, model, batch in _workloads(device):
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        _step(model, optimizer, *batch())
        plain = statistics.median(_timed_step(model, optimizer, batch, device) for _ in range(steps))
        with watch(model, optimizer, profile=True) as w:
            _step(model, optimizer, *batch())
            start = w.costs()
            watched = sum(_timed_step(model, optimizer, batch, device) for _ in range(steps)) / steps
            spent = {key: (value - start[key]) / steps for key, value in w.costs().items()}
        rows.append({"workload": workload, "step_ms": plain * 1e3, "watched_step_ms": watched * 1e3,
                     "inside_ms": spent["hooks"] * 1e3, "kernels_ms": spent["kernels"] * 1e3,
                     "mb_read": spent["bytes"] / 1e6, "pass_ms": spent["pass"] * 1e3,
                     "pass_mb": spent["pass_bytes"] / 1e6})
    return rows


def run_suite(device: str = "cpu", repeats: int = 10) -> dict:
    """Step time of each method on each workload, and its overhead over no checks.

    Each repeat times one step of every method, back to back, rotating the order from repeat to
    repeat. The overhead is the median over repeats of the ratio to no checks within the same repeat
    (with a 95% interval for that median): on a shared machine, load that comes and goes then cancels
    out instead of landing on whichever method ran during it."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Anomaly Detection has been enabled")  # said on every use otherwise
        rows = _measure(device, repeats)
        inside = _measure_inside(device)
    lines = ["| workload | method | median step (ms) | overhead vs no checks: median | its 95% interval | "
             "min..max over repeats |", "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        if row["method"] == "none":
            overhead = "- | - | -"
        else:
            (ci_low, ci_high), (low, high) = row["overhead_pct_ci95"], row["overhead_pct_range"]
            overhead = f"{row['overhead_pct']:+.1f}% | {ci_low:+.1f}..{ci_high:+.1f}% | {low:+.0f}..{high:+.0f}%"
        lines.append(f"| {row['workload']} | {row['method']} | {row['median_ms']:.1f} | {overhead} |")
    lines += ["", "Inside the watch (timed within the watched steps themselves):", "",
              "| workload | step without the watch (ms) | in the watch per step (ms) | of which fused kernels (ms) | "
              "MB the kernels read per step | in the watch / step | parameter and gradient pass (ms, MB) | "
              "that pass / step |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in inside:
        lines.append(f"| {row['workload']} | {row['step_ms']:.1f} | {row['inside_ms']:.1f} | {row['kernels_ms']:.1f} | "
                     f"{row['mb_read']:.0f} | {row['inside_ms'] / row['step_ms'] * 100:.1f}% | "
                     f"{row['pass_ms']:.1f} ms, {row['pass_mb']:.0f} MB | {row['pass_ms'] / row['step_ms'] * 100:.1f}% |")
    return {"title": f"nanfast.watch: cost per training step ({device}, {torch.get_num_threads()} threads, "
                     f"{repeats} repeats of one step each)",
            "markdown": "\n".join(lines), "rows": rows, "inside": inside}


if __name__ == "__main__":
    import sys

    suite = run_suite(*(sys.argv[1:2] or ["cpu"]), **({"repeats": int(sys.argv[2])} if len(sys.argv) > 2 else {}))
    print(f"## {suite['title']}\n\n{suite['markdown']}")
