"""The CPU kernels' own speed, apart from memory: one thread reads one tensor that fits in L2, many
times, timed by the thread's CPU time (which other processes on a shared machine disturb far less than
wall time). GB/s per dtype, op and instruction set; each figure includes the op's fixed cost per call
(about 3.5 us on a 2-vCPU AMD EPYC).

    python benchmarks/kernel_throughput.py [--elements 262144] [--isas avx2,avx512] [--calls 200]"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from nanfast import _C


def main(argv: list[str]) -> int:
    """Prints the table. Args: argv, the options above. Returns: the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=256 * 1024)
    parser.add_argument("--isas", default="avx2,avx512")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    isa = _C.cpu_isa()
    ops = {"stats": torch.ops.nanfast.stats, "any": torch.ops.nanfast.any_nonfinite}
    print(f"1 thread, {args.elements} elements per call, thread CPU time; GB/s per ISA")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensors = [torch.randn(args.elements, generator=torch.Generator().manual_seed(0)).to(dtype)]
        nbytes = args.elements * tensors[0].element_size()
        for name, op in ops.items():
            row = []
            for config in args.isas.split(","):
                _C.set_cpu_isa(config)
                seconds = []
                for _ in range(7):
                    start = time.thread_time()
                    for _ in range(args.calls):
                        op(tensors)
                    seconds.append((time.thread_time() - start) / args.calls)
                row.append(f"{_C.cpu_isa()} {nbytes / statistics.median(seconds) / 1e9:6.1f}")
            print(f"{str(dtype):15s} {name:6s}", "  ".join(row))
    _C.set_cpu_isa(isa)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
