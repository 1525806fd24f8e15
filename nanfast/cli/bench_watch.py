"""Cost of an always-on `nanfast.watch` on a training step, side by side in one process with no checks,
hand-written per-module `torch.any(isnan + isinf)` hooks and `torch.autograd.detect_anomaly()`, and,
for a loop that clips its gradients, the watch's `w.clip_grad_norm_` against torch's `clip_grad_norm_`
without checks, on the workloads of watch_workloads.py (an MLP, two transformers, ResNet-18 at two
input sizes). Each method trains its own copy of the model and stays installed, as a watch left on
does; their steps are interleaved across repeats; medians are reported. Per watched step, the suite
also reports what the watch itself spends: host time, kernel time, fused-op calls (the launches a GPU
step would pay) and bytes read."""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..watcher import watch
from ..watcher.options import fused_records
# make_workloads is also benchmarks/watch_versions.py's entry point, by the name _workloads.
from .watch_workloads import KEYS as WORKLOAD_KEYS, Batch, make_workloads as _workloads

TORCH_CLIP = "torch clip_grad_norm_"
WATCH_CLIP = "nanfast.watch + w.clip_grad_norm_"
# NOTE: [The run's own null]
# Each method is a copy of the model, and two copies of one model stepped alike in one process do not
# run alike: where their tensors and the allocator's chunks land differs. Timed against each other, four
# unwatched copies of the batch-32 MLP differed by -1.1..+0.4% (medians of 200 per-repeat ratios, four
# processes), the small transformer's by -0.4..+0.6% (session 58, 2-vCPU AMD EPYC): a bias that a
# run's interval does not show, since every repeat carries it. So every run times a second copy with no
# checks against the first, and reports that: an overhead is told from the copies' own difference only
# beyond it.
NULL = "none, a second copy"
METHODS = ("none", NULL, "nanfast.watch", "nanfast.watch(fuse=True)", "isnan hooks", "detect_anomaly", TORCH_CLIP,
           WATCH_CLIP)
# The watch with the other `fuse` than its default on the device (NOTE: [Fused records by default on
# accelerators]): fused on a CPU, each check at once on an accelerator.
OTHER_FUSE = {True: "nanfast.watch(fuse=True)", False: "nanfast.watch(fuse=False)"}
# What each method's overhead is taken against (the others: "none"). A loop that clips its gradients
# reads them for the norm anyway: with Watch.clip_grad_norm_ the watch's pass is that read.
BASELINES = {WATCH_CLIP: TORCH_CLIP}
MAX_NORM = 1.0


def methods(device: str) -> tuple[str, ...]:
    """METHODS as timed on `device`: the watch beside the one with the other `fuse`."""
    other = OTHER_FUSE[not fused_records(None, torch.device(device))]
    return tuple(other if m == OTHER_FUSE[True] else m for m in METHODS)


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
    if name in ("nanfast.watch", WATCH_CLIP):
        return watch(model, optimizer)
    if name in OTHER_FUSE.values():  # see NOTE: [Fused records]
        return watch(model, optimizer, fuse=name == OTHER_FUSE[True])
    if name == "isnan hooks":
        return isnan_hooks(model)
    if name == "detect_anomaly":
        return torch.autograd.detect_anomaly(check_nan=True)
    return contextlib.nullcontext()


def _clip(name: str, model: torch.nn.Module, installed: Any) -> Optional[Callable[[], object]]:
    """What a method runs between backward and optimizer.step(): a gradient clipping, or nothing."""
    if name == TORCH_CLIP:
        return lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if name == WATCH_CLIP:
        return lambda: installed.clip_grad_norm_(MAX_NORM)
    return None


# A process-wide switch: entered around each of its own steps, so that it leaves the others' alone.
PER_STEP_METHODS = ("detect_anomaly",)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
          clip: Optional[Callable[[], object]] = None) -> None:
    optimizer.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
    loss.backward()
    if clip is not None:
        clip()
    optimizer.step()


def _timed_step(model, optimizer, batch, device: str, clip: Optional[Callable[[], object]] = None) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    _step(model, optimizer, *batch(), clip=clip)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


Workload = tuple[str, torch.nn.Module, Batch]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _measure(workloads: list[Workload], device: str, repeats: int, warmup: int = 3) -> list[dict]:
    # NOTE: [Measuring a watch left on]
    # Each method trains its own copy of the model (same weights, same batches, its own optimizer) and
    # keeps its hooks for the whole run, as a user leaves the watch on: the timed steps are a watch's
    # steps `warmup` + 1 onwards, not the first step after an install, which pays what a run pays once
    # (the parameters' full read, every params_every=100 steps after it, the first copies of module
    # buffers, the first records' allocations). Installing a watch around each timed step measured that
    # first step: +17% instead of +9% on the MLP, +7.3% instead of +5.8% on ResNet-18 at 64x64 (one
    # process, interleaved, 2026-11-24).
    rows, names = [], methods(device)
    for workload, model, batch in workloads:
        model.train()
        with contextlib.ExitStack() as installed:
            runs = {}
            for method in names:
                copy_ = copy.deepcopy(model)
                optimizer = _optimizer(copy_)
                entered = None if method in PER_STEP_METHODS else installed.enter_context(_method(method, copy_, optimizer))
                runs[method] = (copy_, optimizer, _clip(method, copy_, entered))

            def timed(method: str) -> float:
                model, optimizer, clip = runs[method]
                with _method(method, model, optimizer) if method in PER_STEP_METHODS else contextlib.nullcontext():
                    return _timed_step(model, optimizer, batch, device, clip)

            for method in names:
                for _ in range(warmup):
                    timed(method)
            times: dict[str, list[float]] = {m: [] for m in names}
            ratios: dict[str, list[float]] = {m: [] for m in names}
            for this_repeat in rotated_repeats(names, timed, repeats):
                for method, t in this_repeat.items():
                    times[method].append(t)
                    ratios[method].append(t / this_repeat[BASELINES.get(method, "none")])
        for method in names:
            low, high = median_interval(ratios[method])
            rows.append({"workload": workload, "method": method, "baseline": BASELINES.get(method, "none"),
                         "median_ms": statistics.median(times[method]) * 1e3,
                         "overhead_pct": (statistics.median(ratios[method]) - 1) * 100,
                         "overhead_pct_ci95": [(low - 1) * 100, (high - 1) * 100],
                         "overhead_pct_range": [(min(ratios[method]) - 1) * 100, (max(ratios[method]) - 1) * 100],
                         "samples": len(times[method])})
    return rows


def rotated_repeats(names: Sequence[str], timed: Callable[[str], float], repeats: int) -> Iterator[dict[str, float]]:
    """Per repeat, `timed(name)` of each name once, back to back, in an order rotated by one each repeat.

    Yields:
        {name: seconds} of one repeat."""
    for r in range(repeats):
        order = [names[(r + k) % len(names)] for k in range(len(names))]
        yield {name: timed(name) for name in order}


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


def _measure_inside(workloads: list[Workload], device: str, steps: int = 6) -> list[dict]:
    """Per watched step (medians over `steps`): the host time spent inside the watch (hooks and read),
    the time in its kernels, the number of its fused-op calls (each a kernel launch on a GPU) and the
    bytes they read, with the
    part of them in the fused pass over gradients (and parameters, every `params_every` steps: not in
    the median step; what the watch reads every step whatever the batch: a floor on its cost), as a watch made with profile=True counts them
    (Watch.costs(), the public hook: no patching). Measured within the same steps, so it does
    not move with the machine's load as the difference of two step times does; it leaves out
    nn.Module's slower call path once hooks exist."""
    rows = []
    for workload, model, batch in workloads:
        model.train()
        optimizer = _optimizer(model)
        _step(model, optimizer, *batch())
        plain = statistics.median(_timed_step(model, optimizer, batch, device) for _ in range(steps))
        per_step: list[dict] = []
        with watch(model, optimizer, profile=True) as w:
            _step(model, optimizer, *batch())
            before = w.costs()
            for _ in range(steps):
                per_step.append({"step": _timed_step(model, optimizer, batch, device)})
                after = w.costs()
                per_step[-1].update({key: value - before[key] for key, value in after.items()})
                before = after
        # Medians over the steps: a step that other jobs slowed down moves them less than a mean.
        spent = {key: statistics.median(s[key] for s in per_step) for key in per_step[0]}
        rows.append({"workload": workload, "step_ms": plain * 1e3, "watched_step_ms": spent["step"] * 1e3,
                     "inside_ms": spent["hooks"] * 1e3, "kernels_ms": spent["kernels"] * 1e3,
                     "calls": spent["calls"], "mb_read": spent["bytes"] / 1e6, "pass_ms": spent["pass"] * 1e3,
                     "pass_mb": spent["pass_bytes"] / 1e6})
    return rows


def _per_step_table(rows: list[dict], inside: list[dict]) -> list[str]:
    """The issue's summary, one line per workload: the watch's overhead side by side, with what it
    spends per watched step."""
    lines = ["| workload | step without the watch (ms) | nanfast.watch overhead: median | its 95% interval | "
             "host time in the watch (ms) | in its kernels (ms) | fused-op calls (kernel launches) | MB read | "
             "clipping gradients: the watch with w.clip_grad_norm_ against torch's clip_grad_norm_ | "
             "a second copy without checks (the run's null) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in inside:
        side, none, clipped, null = (
            next(r for r in rows if r["workload"] == row["workload"] and r["method"] == method)
            for method in ("nanfast.watch", "none", WATCH_CLIP, NULL))
        low, high = side["overhead_pct_ci95"]
        lines.append(f"| {row['workload']} | {none['median_ms']:.1f} | {side['overhead_pct']:+.1f}% | "
                     f"{low:+.1f}..{high:+.1f}% | {row['inside_ms']:.2f} | {row['kernels_ms']:.2f} | "
                     f"{row['calls']:.0f} | {row['mb_read']:.1f} | {_with_interval(clipped)} | {_with_interval(null)} |")
    return lines


def _with_interval(row: dict) -> str:
    """A row's overhead with its 95% interval, as the tables give it."""
    low, high = row["overhead_pct_ci95"]
    return f"{row['overhead_pct']:+.1f}% ({low:+.1f}..{high:+.1f}%)"


def run_suite(device: str = "cpu", repeats: int = 40, only: Sequence[str] = ()) -> dict:
    """Step time of each method on each workload, and its overhead over its baseline (no checks; for
    the watch clipping gradients with Watch.clip_grad_norm_, no checks and torch's clip_grad_norm_),
    beside a second copy without checks timed against the first (NOTE: [The run's own null]); then,
    per watched step, what the watch spends (host time, kernel time, fused-op calls, bytes read).

    Each method trains its own copy of the model with its hooks left on (see NOTE: [Measuring a watch
    left on]); each repeat times one step of every method, back to back, rotating the order from repeat
    to repeat. The overhead is the median over repeats of the ratio to the method's baseline (BASELINES:
    no checks, or torch's clipping for the watch that clips) within the same repeat (with a 95% interval
    for that median): on a shared machine, load that comes and goes then cancels out instead of landing
    on whichever method ran during it.

    Args:
        device: "cpu" or a CUDA device.
        repeats: repeats of one step per method (the issue's protocol: 40), after 3 untimed steps each.
        only: workload keys (watch_workloads.KEYS) to run; default all.

    Returns:
        A dict with the title, the markdown tables, "rows" (per workload and method) and "inside" (per
        workload, per watched step).

    Raises:
        ValueError: an unknown workload key."""
    torch.manual_seed(0)
    workloads = _workloads(device, only)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Anomaly Detection has been enabled")  # said on every use otherwise
        rows = _measure(workloads, device, repeats)
        inside = _measure_inside(workloads, device)
    lines = ["Per watched step:", "", *_per_step_table(rows, inside), "", "Side by side:", "",
             "| workload | method | median step (ms) | against | overhead: median | its 95% interval | "
             "min..max over repeats |", "|---|---|---:|---|---:|---:|---:|"]
    for row in rows:
        if row["method"] == "none":
            overhead = "- | - | - | -"
        else:
            (ci_low, ci_high), (low, high) = row["overhead_pct_ci95"], row["overhead_pct_range"]
            overhead = (f"{row['baseline']} | {row['overhead_pct']:+.1f}% | {ci_low:+.1f}..{ci_high:+.1f}% | "
                        f"{low:+.0f}..{high:+.0f}%")
        lines.append(f"| {row['workload']} | {row['method']} | {row['median_ms']:.1f} | {overhead} |")
    lines += ["", "Inside the watch (timed within the watched steps themselves):", "",
              "| workload | step without the watch (ms) | in the watch per step (ms) | of which fused kernels (ms) | "
              "MB the kernels read per step | in the watch / step | its kernels / step (the reads alone) | "
              "parameter and gradient pass (ms, MB) | that pass / step |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in inside:
        lines.append(f"| {row['workload']} | {row['step_ms']:.1f} | {row['inside_ms']:.2f} | {row['kernels_ms']:.2f} | "
                     f"{row['mb_read']:.0f} | {row['inside_ms'] / row['step_ms'] * 100:.1f}% | "
                     f"{row['kernels_ms'] / row['step_ms'] * 100:.1f}% | "
                     f"{row['pass_ms']:.2f} ms, {row['pass_mb']:.0f} MB | {row['pass_ms'] / row['step_ms'] * 100:.1f}% |")
    return {"title": f"nanfast.watch: cost per training step ({device}, {torch.get_num_threads()} threads, "
                     f"{repeats} repeats of one step each, every method left on its own copy of the model)",
            "markdown": "\n".join(lines), "rows": rows, "inside": inside}


if __name__ == "__main__":
    import sys

    suite = run_suite(*(sys.argv[1:2] or ["cpu"]), **({"repeats": int(sys.argv[2])} if len(sys.argv) > 2 else {}))
    print(f"## {suite['title']}\n\n{suite['markdown']}")
