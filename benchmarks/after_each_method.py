"""What the core suite's shuffled order mixes into a median (issue 19's 5000 x 1024 target): the time of
one method right after each other method of `python -m nanfast bench --suite core`, and right after
itself. bench.py shuffles the methods each repeat (NOTE: [Each method after any other]), so its median
is taken over every predecessor in turn.

    python benchmarks/after_each_method.py --workload 5000x1024-fp32 --method nanfast.stats
"""

from __future__ import annotations

import argparse
import statistics
import time


from nanfast.cli import bench


def after_each(workload: str, method: str, repeats: int) -> dict[str, float]:
    """Median seconds of `method` right after each method of the suite (the pair repeated `repeats` times)."""
    tensors = bench.make_workloads("cpu", 1.0)[workload]
    methods = bench.make_methods(tensors)
    if method not in methods:
        raise SystemExit(f"unknown method {method!r}; choose from {', '.join(methods)}")
    timed = methods[method]
    medians = {}
    for name, before in methods.items():
        samples = []
        for _ in range(repeats):
            before()
            start = time.perf_counter()
            timed()
            samples.append(time.perf_counter() - start)
        medians[name] = statistics.median(samples)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="5000x1024-fp32")
    parser.add_argument("--method", default="nanfast.stats")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    print(f"{bench.machine('cpu')}, {args.workload}, {args.repeats} pairs each\n")
    print(f"| right after | {args.method} (ms) |\n|---|---:|")
    for name, seconds in after_each(args.workload, args.method, args.repeats).items():
        print(f"| {name} | {seconds * 1e3:.3f} |")


if __name__ == "__main__":
    main()
