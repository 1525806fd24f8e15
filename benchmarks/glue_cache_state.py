"""What the watch's per-step glue costs with its caches warm and cold (issue 19): the same watch (nothing
read but the model's input, output and loss, health features off: its hooks and step end) on the watch
suite's MLP and on the same MLP made narrow, whose step leaves the caches warm. The glue runs the same
Python and C++ either way; the difference is what the wide step's memory traffic (its weights,
gradients and momentum, ~25 MB) evicted before each hook runs: the glue's code and data, read again
from farther away.

Each width trains an unwatched and a watched copy (same weights and batches), steps interleaved; the
glue's cost is the median over repeats of (watched step - unwatched step) in microseconds.

    python benchmarks/glue_cache_state.py --repeats 400
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

import nanfast
from nanfast.cli import bench_watch, watch_workloads

# Its neighbour in benchmarks/: the options that turn the health features off.
from step_end_floor import FEATURES_OFF

GLUE = dict(modules=False, params=False, grads=False, **FEATURES_OFF)
WIDTHS = {"narrow (caches stay warm)": 8, "the watch suite's (width 850)": watch_workloads.MLP["width"]}


def measure(width: int, repeats: int) -> tuple[float, float]:
    """(median unwatched step, median added by the glue), microseconds, for the MLP of `width`."""
    spec = dict(watch_workloads.MLP, width=width)
    model = watch_workloads.MLP4(**spec)
    x = torch.randn(spec["batch"], spec["features"])
    y = torch.randint(0, spec["classes"], (spec["batch"],))
    runs = {}
    for watched in (False, True):
        copy_ = copy.deepcopy(model)
        optimizer = bench_watch._optimizer(copy_)  # the watch suite's: SGD with momentum
        if watched:
            nanfast.watch(copy_, optimizer, **GLUE)
        runs[watched] = (copy_, optimizer)

    def step(watched: bool) -> float:
        return bench_watch._timed_step(*runs[watched], lambda: (x, y), "cpu")  # the watch suite's timed step

    for watched in runs:
        for _ in range(5):
            step(watched)
    bare, added = [], []
    for times in bench_watch.rotated_repeats(list(runs), step, repeats):
        bare.append(times[False])
        added.append(times[True] - times[False])
    return statistics.median(bare) * 1e6, statistics.median(added) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| MLP | step without the watch (us) | added by the watch's glue (us, median) |")
    print("|---|---:|---:|")
    for name, width in WIDTHS.items():
        bare, added = measure(width, args.repeats)
        print(f"| {name} | {bare:.0f} | {added:.0f} |", flush=True)


if __name__ == "__main__":
    main()
