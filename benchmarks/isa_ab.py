"""The CPU kernels' instruction sets and prefetch settings side by side, in one process, against the
read ceiling of `python -m nanfast bench` (the faster of sum and amax over one contiguous float32
buffer of the same bytes). Each repeat runs every method once, in a newly shuffled order; a
ratio is reported both as bench.py computes it (from medians) and as the median of per-repeat
ratios with its range, which a shared machine makes wide.

    python benchmarks/isa_ab.py [--repeats 15] [--workloads gpt2-fp32,gpt2-bf16,5000x1024-fp32]
        [--configs avx2+pf,avx2,avx512+pf,avx512] [--threads N] [--clock wall|thread]

`--threads 1 --clock thread` times the calling thread's CPU time, which other processes on a shared
machine disturb far less than wall time (with more threads, the work of the others is not counted).

A config is an instruction set, `+pf` for the software prefetches on (see NOTE: [Prefetching the
next page] in csrc/cpu/simd_body.h)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

import nanfast
from nanfast import _C
from nanfast.cli.bench import make_workloads, time_samples


def _configure(config: str) -> None:
    isa, _, prefetch = config.partition("+")
    _C.set_cpu_isa(isa)
    _C.set_cpu_prefetch(prefetch == "pf")


def _methods(tensors: list[torch.Tensor], configs: list[str]) -> dict[str, Callable[[], object]]:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.randn(max(1, nbytes // 4), generator=torch.Generator().manual_seed(1))

    def per_tensor_assert():
        for t in tensors:
            assert not torch.any(torch.isnan(t) + torch.isinf(t))

    def stats_with(config: str) -> Callable[[], None]:
        def stats():
            _configure(config)
            assert not nanfast.stats(tensors).any_nonfinite.item()
        return stats

    methods = {"sum": lambda: flat.sum().item(), "amax": lambda: flat.amax().item()}
    methods.update({config: stats_with(config) for config in configs})
    if len(tensors) > 1000:  # the per-tensor assert of the small-tensor target; seconds on the others
        methods["assert"] = per_tensor_assert
    return methods


def run(workload: str, tensors: list[torch.Tensor], configs: list[str], repeats: int,
        clock: Callable[[], float] = time.perf_counter) -> None:
    """Prints, per config, its ratio to the read ceiling (and to the per-tensor assert when timed)."""
    # Shuffled as the benchmark's own timing is (see NOTE: [Each method after any other]): in a rotated
    # order the second config always ran right after the first had read the same tensors, and on the
    # 20 MB of 5000 x 1024 floats that alone made it 25% faster.
    samples = time_samples(_methods(tensors, configs), repeats, "cpu", clock)
    median = {name: statistics.median(ts) for name, ts in samples.items()}
    ceiling = [min(s, m) for s, m in zip(samples["sum"], samples["amax"])]
    print(f"{workload}: ceiling {min(median['sum'], median['amax']) * 1e3:.2f} ms")
    for config in configs:
        ratios = sorted(c / t for c, t in zip(ceiling, samples[config]))
        line = (f"  {config:10s} {median[config] * 1e3:8.2f} ms  x ceiling {min(median['sum'], median['amax']) / median[config]:.2f}"
                f" (per repeat {statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}])")
        if "assert" in samples:
            speedups = sorted(a / t for a, t in zip(samples["assert"], samples[config]))
            line += (f"  x per-tensor assert {median['assert'] / median[config]:.1f}"
                     f" (per repeat {statistics.median(speedups):.1f} [{speedups[0]:.1f}-{speedups[-1]:.1f}])")
        print(line)


def main(argv: list[str]) -> int:
    """Runs the comparison. Args: argv, the options above. Returns: the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--workloads", default="gpt2-fp32,gpt2-bf16,5000x1024-fp32")
    parser.add_argument("--configs", default="avx2+pf,avx2,avx512+pf,avx512")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    configs = args.configs.split(",")
    isa, prefetch = _C.cpu_isa(), _C.cpu_prefetch()
    print(f"{torch.get_num_threads()} threads, {args.clock} clock; this CPU runs {isa}, prefetch {'on' if prefetch else 'off'} by default")
    wanted = args.workloads.split(",")
    for workload, tensors in make_workloads("cpu", 1.0).items():
        if workload in wanted:
            run(workload, tensors, configs, args.repeats, clock)
    _C.set_cpu_isa(isa)
    _C.set_cpu_prefetch(prefetch)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
