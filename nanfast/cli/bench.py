"""Benchmark nanfast against the pure-torch ways of finding NaN/inf, side by side in one process.

Every method reads the same tensors and ends with the host knowing the answer (one sync where the
method has one). Methods are interleaved within each repeat, in an order shuffled each repeat, and the
median is reported. The memory ceiling is measured in the same run: one pass (sum, or max) over one
contiguous buffer of the same number of bytes, the faster of the two."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import nanfast
from nanfast.progress import progress

# Suites beyond the core one live in their own modules, each with run_suite(device, repeats) -> dict
# holding "title", "markdown" and "rows"; a module with WORKLOAD_KEYS also takes only= (--workloads).
EXTRA_SUITES = {"watch": "nanfast.cli.bench_watch", "locate": "nanfast.cli.bench_locate"}
# Repeats per suite when --repeats is not given; the watch suite's is issue 19's protocol.
DEFAULT_REPEATS = {"core": 7, "watch": 40, "locate": 7}


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """The 148 parameter shapes of GPT-2 small (124,439,808 elements)."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


CORE_WORKLOADS = ("gpt2-fp32", "gpt2-bf16", "5000x1024-fp32", "256M-fp32", "gpt2-fp32-transposed")


def make_workloads(device: str, scale: float) -> dict[str, list[torch.Tensor]]:
    """Finite random tensors (the common case: a check that finds nothing must still read everything)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    gpt2 = gpt2_small_shapes()
    n_small, big = max(1, int(5000 * scale)), max(1, int(256 * 2**20 * scale))
    workloads = {
        "gpt2-fp32": [randn(*s) for s in gpt2],
        "gpt2-bf16": [randn(*s, dtype=torch.bfloat16) for s in gpt2],
        "5000x1024-fp32": [randn(1024) for _ in range(n_small)],
        "256M-fp32": [randn(big)],
        "gpt2-fp32-transposed": [randn(*reversed(s)).t() if len(s) == 2 else randn(*s) for s in gpt2],
    }
    assert tuple(workloads) == CORE_WORKLOADS
    return workloads


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_methods(tensors: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    device = tensors[0].device
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    # The read ceiling: the same bytes as one contiguous float32 buffer, read once by a reduction.
    flat = torch.randn(max(1, nbytes // 4), generator=torch.Generator().manual_seed(1)).to(device)

    def assert_isnan_isinf():
        for t in tensors:
            assert not torch.any(torch.isnan(t) + torch.isinf(t))

    def assert_isfinite_all():
        for t in tensors:
            assert torch.isfinite(t).all()

    def foreach_norm_isfinite():
        norms = torch._foreach_norm(tensors)
        assert torch.isfinite(torch.stack(norms)).all()

    found_inf = torch.zeros((), device=device)
    inv_scale = torch.ones((), device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)

    def amp_unscale_flag():
        # Flag only; it also writes every tensor (x * inv_scale), as GradScaler.unscale_ does.
        found_inf.zero_()
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        assert found_inf.item() == 0

    def amp_takes(dtype: torch.dtype) -> bool:
        # CUDA's kernel refused bfloat16 in torch 2.11 (as GradScaler.unscale_ would there).
        try:
            torch._amp_foreach_non_finite_check_and_unscale_([torch.zeros(1, dtype=dtype, device=device)],
                                                             found_inf.clone(), inv_scale)
        except (NotImplementedError, RuntimeError):
            return False
        return True

    def sum_per_tensor():
        for t in tensors:
            t.sum()

    def contiguous_sum():
        flat.sum().item()

    def contiguous_max():
        flat.amax().item()

    def nanfast_any_nonfinite():
        assert not nanfast.any_nonfinite(tensors).item()

    def nanfast_stats():
        s = nanfast.stats(tensors)
        assert not s.any_nonfinite.item()

    amp = {AMP: amp_unscale_flag} if all(amp_takes(dtype) for dtype in by_dtype) else {}
    return {
        "torch.any(isnan + isinf) per tensor": assert_isnan_isinf,
        "torch.isfinite(t).all() per tensor": assert_isfinite_all,
        "torch._foreach_norm + isfinite": foreach_norm_isfinite,
        **amp,
        SUM_PER_TENSOR: sum_per_tensor,
        CONTIGUOUS_SUM: contiguous_sum,
        CONTIGUOUS_MAX: contiguous_max,
        "nanfast.any_nonfinite": nanfast_any_nonfinite,
        "nanfast.stats": nanfast_stats,
    }


SUM_PER_TENSOR = "sum per tensor"
CONTIGUOUS_SUM = "sum of one contiguous buffer (read ceiling)"
CONTIGUOUS_MAX = "max of one contiguous buffer (read ceiling)"
BASELINE = "torch.any(isnan + isinf) per tensor"
AMP = "amp _foreach_non_finite_check_and_unscale_"


def time_samples(methods: dict[str, Callable[[], object]], repeats: int, device: str,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each method in each repeat (by `clock`); methods interleaved within each repeat, in an
    order shuffled anew each repeat (a fixed seed), after one warm-up round in the given order."""
    # NOTE: [Each method after any other]
    # In a fixed order (a rotated one too) each method always follows the same one. On a workload that
    # fits in cache (5000 tensors of 1024 floats, 20 MB) that decides the result: any_nonfinite came right
    # after the read ceiling's two passes over another 20 MB buffer and always started cold, stats came
    # after any_nonfinite and always started warm (0.8 against 0.5 ms in the suite; 0.28 against 0.31 ms
    # each after itself). Shuffled, every method follows each other in turn.
    samples: dict[str, list[float]] = {name: [] for name in methods}
    order = list(methods)
    shuffle = random.Random(0).shuffle
    for r in range(repeats + 1):
        if r:
            shuffle(order)
        for name in order:
            fn = methods[name]
            _sync(device)
            start = clock()
            fn()
            _sync(device)
            if r:
                samples[name].append(clock() - start)
    return samples


def time_methods(methods: dict[str, Callable[[], object]], repeats: int, device: str) -> dict[str, float]:
    """Median seconds per method, timed as time_samples() does."""
    return {name: statistics.median(ts) for name, ts in time_samples(methods, repeats, device).items()}


def run_core(device: str, repeats: int, scale: float, only: Sequence[str] = ()) -> list[dict]:
    rows = []
    workloads = {name: tensors for name, tensors in make_workloads(device, scale).items() if not only or name in only}
    for workload in progress(list(workloads), desc="core workloads"):
        tensors = workloads.pop(workload)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        medians = time_methods(make_methods(tensors), repeats, device)
        ceiling = min(medians[CONTIGUOUS_SUM], medians[CONTIGUOUS_MAX])
        for method, seconds in medians.items():
            rows.append({
                "workload": workload,
                "tensors": len(tensors),
                "elements": sum(t.numel() for t in tensors),
                "bytes": nbytes,
                "method": method,
                "median_ms": seconds * 1e3,
                "gb_per_s": nbytes / seconds / 1e9,
                "vs_ceiling": ceiling / seconds,
                "ceiling_gb_per_s": nbytes / ceiling / 1e9,
                "speedup_vs_assert": medians[BASELINE] / seconds,
                # None where the amp check refuses one of the workload's dtypes on this device.
                "speedup_vs_amp": medians[AMP] / seconds if AMP in medians else None,
            })
        del tensors
    return rows


def core_markdown(rows: list[dict]) -> str:
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == workload]
        g = group[0]
        lines += [f"**{workload}**: {g['tensors']} tensors, {g['elements']:,} elements, {g['bytes'] / 1e6:,.0f} MB", "",
                  "| method | median ms | GB/s | x read ceiling | speedup vs per-tensor assert | speedup vs amp check |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in group:
            lines.append(f"| {r['method']} | {r['median_ms']:.2f} | {r['gb_per_s']:.1f} | {r['vs_ceiling']:.2f} "
                         f"| {r['speedup_vs_assert']:.1f} | "
                         + ("n/a" if r["speedup_vs_amp"] is None else f"{r['speedup_vs_amp']:.1f}") + " |")
        lines.append("")
    return "\n".join(lines)


def machine(device: str = "cpu") -> str:
    """The CPU, torch and thread count, and for a CUDA device the GPU too (what the timings ran on)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f"{torch.cuda.get_device_name(torch.device(device))}; " if device.startswith("cuda") else ""
    return (f"{gpu}{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"nanfast CPU ISA {nanfast.ops._C.cpu_isa()}")


def plot(rows: list[dict], path: str, title: str) -> bool:
    """Saves chart(rows, title) as a PNG at `path`. Returns False (and writes nothing) when matplotlib
    is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = chart(rows, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def chart(rows: list[dict], title: str) -> Any:
    """A matplotlib Figure: grouped bars of GB/s per workload and method (log scale), each workload's
    read ceiling drawn as a dashed line over its bars, the legend outside the axes."""
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m not in (CONTIGUOUS_SUM, CONTIGUOUS_MAX)]
    fig, ax = plt.subplots(figsize=(13, 5.5))
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        # NaN (no bar) where a method did not run on a workload (the amp check refuses CUDA bfloat16).
        values = [next((r["gb_per_s"] for r in rows if r["workload"] == w and r["method"] == method), math.nan)
                  for w in workloads]
        ax.bar([i + k * width for i in range(len(workloads))], values, width, label=method)
    for i, w in enumerate(workloads):
        ceiling = next(r["ceiling_gb_per_s"] for r in rows if r["workload"] == w)
        ax.hlines(ceiling, i - width / 2, i + 0.8 - width / 2, colors="black", linestyles="--",
                  label="read ceiling (one contiguous buffer, same bytes)" if i == 0 else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
    ax.set_xlabel("workload (tensors checked)")
    ax.set_ylabel("GB/s read, log scale (higher is better)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a finite number > 0 of `kind` (a bad value is a usage error, exit 2)."""
    def parse(text: str) -> Any:
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def _device(text: str) -> str:
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu, cuda, cuda:1, ...)") from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--repeats", type=_positive(int), default=None,
                        help="timed repeats per method (median reported; default: 7, and 40 for the watch suite)")
    parser.add_argument("--suite", default="core", choices=["core", *EXTRA_SUITES, "all"])
    parser.add_argument("--workloads", default="",
                        help="comma-separated workloads of the core suite, or of the watch suite (mlp, mlp-128, "
                             "transformer-small, transformer-d256, resnet18-64, resnet18-224); default: all")
    parser.add_argument("--scale", type=_positive(float), default=1.0,
                        help="size factor for the 5000-tensor and 256M workloads (e.g. 0.1 for a quick run)")
    parser.add_argument("--out", default="bench-results", help="folder for results.json (and results.png)")


def run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("nanfast bench: --device cuda asked for, but torch sees no GPU")
        return 2
    suites = [n for n in ("core", *EXTRA_SUITES) if args.suite in (n, "all")]
    keys = {n: CORE_WORKLOADS if n == "core" else getattr(importlib.import_module(EXTRA_SUITES[n]), "WORKLOAD_KEYS", ())
            for n in suites}
    only = [w for w in args.workloads.split(",") if w]
    if unknown := [w for w in only if not any(w in k for k in keys.values())]:
        known = [key for k in keys.values() for key in k]
        print(f"nanfast bench: unknown workload(s) {', '.join(unknown)} for --suite {args.suite}; choose from "
              f"{', '.join(known) or 'none: this suite takes no --workloads'}")
        return 2
    if only:  # the suites that hold a named workload, each with those
        suites = [n for n in suites if any(w in keys[n] for w in only)]
    os.makedirs(args.out, exist_ok=True)
    repeats = {n: args.repeats or DEFAULT_REPEATS[n] for n in suites}
    said = ", ".join(f"{n}: {r}" for n, r in repeats.items())
    print(f"# nanfast benchmark\n\nMachine: {machine(args.device)}\n\nDevice: {args.device}; medians of repeats ({said}).\n")
    results: dict = {"machine": machine(args.device), "device": args.device, "repeats": repeats}
    if "core" in suites:
        rows = run_core(args.device, repeats["core"], args.scale, [w for w in only if w in CORE_WORKLOADS])
        print(core_markdown(rows))
        results["core"] = rows
        chart = os.path.join(args.out, "results.png")
        if plot(rows, chart, f"nanfast vs pure-torch NaN/inf checks: {machine(args.device)}"):
            print(f"Chart: {chart}")
        else:
            print("Chart: skipped, matplotlib is not installed (pip install 'nanfast[bench]')")
    for name, module in progress([(n, m) for n, m in EXTRA_SUITES.items() if n in suites], desc="suites"):
        mod = importlib.import_module(module)
        kwargs = {"only": [w for w in only if w in keys[name]]} if only else {}
        suite = mod.run_suite(device=args.device, repeats=repeats[name], **kwargs)
        print(f"## {suite['title']}\n\n{suite['markdown']}\n")
        results[name] = suite["rows"]
        results.update({f"{name}_{key}": value for key, value in suite.items() if key not in ("title", "markdown", "rows")})
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"Results: {os.path.join(args.out, 'results.json')}")
    return 0
