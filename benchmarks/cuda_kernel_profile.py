"""The CUDA kernels under Nsight Compute: one call of each op on the core suite's GPT-2 fp32 tensors
(148 tensors, 498 MB), between torch.cuda.profiler.start() and stop(), after warm-up calls, so that
`ncu --profile-from-start off` reports only those launches (why stats reads at ~0.45x the read ceiling
where any_nonfinite, with the same launches, reads at ~0.7-0.8x: benchmarks/results/cuda-h200.md).

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python benchmarks/cuda_kernel_profile.py [--ops stats,any_nonfinite] [--workload gpt2-fp32]

With --timeline (no ncu), each op's call instead, timed: wall time per call to a synchronized end, host
time per call (until the call returns), and under torch.profiler the kernels it launches and their summed
GPU time, which tells a host-bound call from a device-bound one (on an H200, any_nonfinite on 5000 small
tensors took 3.96 ms against stats' 1.48 ms with fewer launches: benchmarks/results/cuda-h200.md, section 6)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import nanfast
from nanfast.cli.bench import make_workloads


def main(argv: list[str]) -> int:
    """Runs the profiled calls. Args: argv, the options above. Returns: the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="stats,any_nonfinite")
    parser.add_argument("--workload", default="gpt2-fp32")
    parser.add_argument("--timeline", action="store_true", help="time the calls instead of marking them for ncu")
    parser.add_argument("--calls", type=int, default=20, help="calls timed per op with --timeline")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_kernel_profile: no CUDA device", file=sys.stderr)
        return 2
    tensors = make_workloads("cuda", 1.0)[args.workload]
    ops = {"stats": nanfast.stats, "any_nonfinite": nanfast.any_nonfinite}
    if args.timeline:
        print(f"{args.workload}: {len(tensors)} tensors; medians of {args.calls} calls")
        for name in args.ops.split(","):
            print(timeline(name, ops[name], tensors, args.calls))
        return 0
    for name in args.ops.split(","):
        op = ops[name]
        warm_up(op, tensors)
        torch.cuda.profiler.start()
        op(tensors)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


def warm_up(op, tensors: list[torch.Tensor]) -> None:
    """Three calls of `op` and a sync, so that what is measured next is a warm call."""
    for _ in range(3):
        op(tensors)
    torch.cuda.synchronize()


def timeline(name: str, op, tensors: list[torch.Tensor], calls: int) -> str:
    """One line: the op's wall and host time per call, its kernels per call and their GPU time."""
    warm_up(op, tensors)
    wall, host = [], []
    for _ in range(calls):
        start = time.perf_counter()
        op(tensors)
        returned = time.perf_counter()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
        host.append(returned - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            op(tensors)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / calls
    return (f"{name}: wall {statistics.median(wall) * 1e3:.3f} ms, host {statistics.median(host) * 1e3:.3f} ms, "
            f"{len(kernels) / calls:.0f} kernels summing {gpu_ms:.3f} ms of GPU time per call")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
