"""What a leaner step end could buy (issue 19): the watch as it is, the same with its health features off,
and a floor where the step's end is nothing but the five C++ calls a healthy eager step needs.

The floor replaces `Watch._end_step` of its copy (features off) by: the parameter list
(`ParamGrads.gather`), the pass over the gradients (`_C.stats_on`), the records (`WatchRecorder.take`),
the summary (`_C.step_summary`) and its read (`_C.read_summary`), then the next step's reset. It keeps
every hook and kernel the watch runs in forward and backward; it names nothing and acts on nothing, so
it is not a watch: it bounds what moving the healthy step's end into C++ could save (the timeline,
spike and headroom features would still cost what they cost).

Each variant trains its own copy of the model (same weights and batches) with its watch left on; the
copies' steps are interleaved in a rotating order; overheads are medians of per-repeat ratios to the
unwatched copy, and the step end is timed inside the steps (perf_counter around `_end_step`).

    python benchmarks/step_end_floor.py --workloads transformer-small,mlp-128 --repeats 300
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import nanfast
from nanfast import _C
from nanfast.cli import bench_watch, watch_workloads

FEATURES_OFF = dict(headroom=None, spikes=False, history=0)
VARIANTS = ("watch", "watch, features off", "floor: five C++ calls")


def _floor_end(w: nanfast.watcher.Watch):
    """The floor's step end for watch `w` (see the module's docstring)."""
    def end_step(found_inf=None, grad_scale=None, scaler_skipped=False, fused_pass=True, defer_undo=False):
        _, _, grads, _ = w._params.gather(w.optimizer.param_groups, groups=True)
        counts, norm, absmax = _C.stats_on(grads, w._device)
        recorded, counted, _, _, _ = w._recorder.take()
        summary = _C.step_summary(recorded, counted, counts, norm, absmax, 0, None, False, None, None, [], [], None,
                                  None, 0)
        _C.read_summary(summary)
        w.step_count += 1
        w._reset_step()
    return end_step


def _timed(fn, spent: list):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)
    return timed


def measure(key: str, repeats: int) -> list[dict]:
    """Overheads and in-step step-end times of VARIANTS on workload `key` of the watch suite."""
    _, model, batch = watch_workloads.make_workloads("cpu", [key])[0]
    model.train()
    runs, ends = {}, {}
    for variant in ("none", *VARIANTS):
        copy_ = copy.deepcopy(model)
        opt = bench_watch._optimizer(copy_)  # the watch suite's: SGD with momentum
        if variant != "none":
            w = nanfast.watch(copy_, opt, **({} if variant == "watch" else FEATURES_OFF))
            end = _floor_end(w) if variant.startswith("floor") else w._end_step
            ends[variant] = []
            w._end_step = _timed(end, ends[variant])
        runs[variant] = (copy_, opt)

    def step(variant: str) -> float:
        return bench_watch._timed_step(*runs[variant], batch, "cpu")  # the watch suite's timed step

    order = list(runs)
    for variant in order:
        for _ in range(3):
            step(variant)
    for spent in ends.values():
        spent.clear()
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for times in bench_watch.rotated_repeats(order, step, repeats):
        for variant in VARIANTS:
            ratios[variant].append(times[variant] / times["none"])
    return [{"workload": key, "variant": v, "overhead_pct": (statistics.median(ratios[v]) - 1) * 100,
             "step_end_us": statistics.median(ends[v]) * 1e6} for v in VARIANTS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,mlp-128,transformer-small,resnet18-64",
                        help=f"comma-separated keys of the watch suite ({', '.join(watch_workloads.KEYS)})")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| workload | variant | overhead: median of per-repeat ratios | step end inside the step (us, median) |")
    print("|---|---|---:|---:|")
    for key in args.workloads.split(","):
        for row in measure(key, args.repeats):
            print(f"| {row['workload']} | {row['variant']} | {row['overhead_pct']:+.2f}% | {row['step_end_us']:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
