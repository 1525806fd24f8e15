"""The CUDA kernels under Nsight Compute: one call of each op on the core suite's GPT-2 fp32 tensors
(148 tensors, 498 MB), between torch.cuda.profiler.start() and stop(), after warm-up calls, so that
`ncu --profile-from-start off` reports only those launches (why stats reads at ~0.45x the read ceiling
where any_nonfinite, with the same launches, reads at ~0.7-0.8x: benchmarks/results/cuda-h200.md).

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python benchmarks/cuda_kernel_profile.py [--ops stats,any_nonfinite] [--workload gpt2-fp32]"""

from __future__ import annotations

import argparse
import sys

import torch

import nanfast
from nanfast.cli.bench import make_workloads


def main(argv: list[str]) -> int:
    """Runs the profiled calls. Args: argv, the options above. Returns: the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="stats,any_nonfinite")
    parser.add_argument("--workload", default="gpt2-fp32")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_kernel_profile: no CUDA device", file=sys.stderr)
        return 2
    tensors = make_workloads("cuda", 1.0)[args.workload]
    ops = {"stats": nanfast.stats, "any_nonfinite": nanfast.any_nonfinite}
    for name in args.ops.split(","):
        op = ops[name]
        for _ in range(3):
            op(tensors)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        op(tensors)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
