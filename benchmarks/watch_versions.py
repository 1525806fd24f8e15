"""The watch's overhead in two checkouts of nanfast, to show that a change made it no slower.

Each checkout runs in its own process (two builds of the extension cannot share one); within a process
a watched and an unwatched step alternate, so each overhead is a ratio taken side by side. The two
checkouts' processes alternate too, and the report gives per checkout the median over processes of
the median overhead, and the median of the per-repeat differences (B - A).

    python benchmarks/watch_versions.py /path/to/before /path/to/after --repeats 6

Each path is a checkout with its extension built in place (`python setup.py build_ext --inplace`).
The workloads are those of `python -m nanfast bench --suite watch` in that checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def child(steps: int, workloads: list[str]) -> None:
    """Prints {workload: median overhead ratio} for the nanfast on sys.path: a watched and an unwatched
    copy of each model (same weights, same batches), the watch left on as a user leaves it (as the
    suite measures it: NOTE: [Measuring a watch left on]), their steps alternating after 3 untimed ones."""
    import copy

    import torch

    try:
        from nanfast.cli import bench_watch
    except ImportError:  # checkouts from before nanfast/cli/
        from nanfast import bench_watch
    torch.manual_seed(0)
    result = {}
    for name, model, batch in bench_watch._workloads("cpu"):
        if not any(w in name for w in workloads):
            continue
        runs = {}
        for method in ("none", "nanfast.watch"):
            copy_ = copy.deepcopy(model)
            runs[method] = (copy_, torch.optim.SGD(copy_.parameters(), lr=1e-3, momentum=0.9))
        watched = bench_watch._method("nanfast.watch", *runs["nanfast.watch"])
        with watched:
            for method in runs:
                for _ in range(3):
                    bench_watch._step(*runs[method], *batch())
            ratios = []
            for s in range(steps):
                times = {}
                for method in (("none", "nanfast.watch") if s % 2 == 0 else ("nanfast.watch", "none")):
                    times[method] = bench_watch._timed_step(*runs[method], batch, "cpu")
                ratios.append(times["nanfast.watch"] / times["none"])
        result[name] = statistics.median(ratios)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs=2, help="checkout A (before) and checkout B (after)")
    parser.add_argument("--repeats", type=int, default=6, help="processes per checkout, alternating")
    parser.add_argument("--steps", type=int, default=6, help="watched/unwatched step pairs per process")
    parser.add_argument("--workloads", default="transformer,ResNet-18 (batch 16x3x64x64)",
                        help="comma-separated substrings of the workload names")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if args.child:
        child(args.steps, workloads)
        return
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    for r in range(args.repeats):
        for tree in (args.trees if r % 2 == 0 else args.trees[::-1]):
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *args.trees, "--child",
                                  "--steps", str(args.steps), "--workloads", args.workloads],
                                 env=env, cwd=tree, capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
    a, b = args.trees
    for name in runs[a][0]:
        over_a = [(run[name] - 1) * 100 for run in runs[a]]
        over_b = [(run[name] - 1) * 100 for run in runs[b]]
        diffs = [y - x for x, y in zip(over_a, over_b)]
        print(f"{name}: A {statistics.median(over_a):+.1f}%  B {statistics.median(over_b):+.1f}%  "
              f"B-A median {statistics.median(diffs):+.1f} points (range {min(diffs):+.1f} to {max(diffs):+.1f}), "
              f"{args.repeats} processes each")


if __name__ == "__main__":
    main()
