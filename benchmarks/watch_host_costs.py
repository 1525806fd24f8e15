"""The host time of the watch's calls and of its step end's phases (issue 19): on a GPU a small step is
bound by its host, so what the watch costs there is the host time it adds.

Two tables. Per call, in a loop with nothing else between calls (the caches warm: a floor): a one-element
add_ (one launch), the ops the watch calls each step over real gradients (nanfast's and, for reference,
torch's `_foreach_norm` and the amp check), the summary and its read. Per phase of the step end, timed
inside real steps of the watch suite's workloads (perf_counter around the watch's own methods, medians):
the pass over parameters and gradients, the summary (Step.pack), the read with its wait for the device
(verdict) and the rest of the evaluation, and the step end as a whole.

    python benchmarks/watch_host_costs.py --device cuda
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

import nanfast
from nanfast import _C
from nanfast.cli import bench_watch, watch_workloads
from nanfast.cli.bench import _sync
from nanfast.watcher import step as steps

# Its neighbours in benchmarks/: the options and the machine line they share, and the timing of a
# method inside the steps.
import watch_cost_parts
from step_end_floor import _timed

VARIANTS = {"watch": {}, "watch(activations=False, grads=False)": dict(activations=False, grads=False)}


def per_call_us(fn, device: str, calls: int = 300) -> tuple[float, float]:
    """(host time per call, time per call with the device's work finished), in microseconds."""
    for _ in range(20):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    _sync(device)
    return host / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


@contextlib.contextmanager
def _summary_args():
    """The arguments of the watch's _C.step_summary calls, kept as they are made."""
    made, call = [], _C.step_summary

    def keep(*args):
        made.append(args)
        return call(*args)

    _C.step_summary = keep
    try:
        yield made
    finally:
        _C.step_summary = call


def calls_table(device: str, keys: list[str]) -> list[str]:
    rows = ["| call | host us per call | us per call, device work included |", "|---|---:|---:|"]
    one = torch.zeros(1, device=device)
    rows.append("| add_ on one element (one launch) | %.1f | %.1f |" % per_call_us(lambda: one.add_(1), device))
    for key in keys:
        _, model, batch = watch_workloads.make_workloads(device, [key])[0]
        optimizer = bench_watch._optimizer(model)
        with _summary_args() as made, nanfast.watch(model, optimizer):
            bench_watch._step(model, optimizer, *batch())
        grads, where = [p.grad for p in model.parameters()], torch.device(device)
        found, scale = torch.zeros((), device=device), torch.ones((), device=device)
        summary = _C.step_summary(*made[-1])
        for name, fn in ((f"_C.stats_on ({len(grads)} gradients)", lambda: _C.stats_on(grads, where)),
                         ("_C.any_nonfinite", lambda: _C.any_nonfinite(grads)),
                         ("torch._foreach_norm", lambda: torch._foreach_norm(grads)),
                         ("amp _foreach_non_finite_check_and_unscale_",
                          lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale)),
                         ("_C.step_summary", lambda: _C.step_summary(*made[-1])),
                         ("_C.read_summary (the read: waits for the device)", lambda: _C.read_summary(summary)),
                         ("_C.loss_mean", lambda: _C.loss_mean(one))):
            rows.append(f"| {key}: {name} | %.1f | %.1f |" % per_call_us(fn, device))
    return rows


def phases_table(device: str, keys: list[str], steps_timed: int = 50) -> list[str]:
    phases = ("pass", "summary", "read", "evaluation", "step end")
    rows = ["| workload | watch | step without it (ms) | with it (ms) | " + " | ".join(f"{p} (us)" for p in phases) + " |",
            "|---|---|---:|---:|" + "---:|" * len(phases)]
    pack, verdict = steps.Step.pack, steps.verdict
    spent: dict[str, list[float]] = {phase: [] for phase in phases}
    steps.Step.pack = _timed(pack, spent["summary"])
    steps.verdict = _timed(verdict, spent["read"])
    try:
        for key in keys:
            for name, options in VARIANTS.items():
                _, model, batch = watch_workloads.make_workloads(device, [key])[0]
                optimizer = bench_watch._optimizer(model)
                plain = [bench_watch._timed_step(model, optimizer, batch, device) for _ in range(steps_timed + 10)][10:]
                with nanfast.watch(model, optimizer, **options) as w:
                    w._end_step = _timed(w._end_step, spent["step end"])
                    w._fused_pass = _timed(w._fused_pass, spent["pass"])
                    w._evaluate = _timed(w._evaluate, spent["evaluation"])
                    for _ in range(10):
                        bench_watch._timed_step(model, optimizer, batch, device)
                    for times in spent.values():
                        times.clear()
                    watched = [bench_watch._timed_step(model, optimizer, batch, device) for _ in range(steps_timed)]
                medians = [statistics.median(spent[p]) * 1e6 for p in phases]
                rows.append(f"| {key} | {name} | {statistics.median(plain) * 1e3:.2f} | "
                            f"{statistics.median(watched) * 1e3:.2f} | " + " | ".join(f"{m:.0f}" for m in medians) + " |")
    finally:
        steps.Step.pack, steps.verdict = pack, verdict
    return rows


def main() -> None:
    args = watch_cost_parts.arguments(__doc__).parse_args()
    keys = args.workloads.split(",")
    print(f"{watch_cost_parts.machine(args.device)}\n")
    print("\n".join(calls_table(args.device, list(dict.fromkeys(keys[:1] + keys[-1:])))) + "\n", flush=True)
    print("\n".join(phases_table(args.device, keys)))


if __name__ == "__main__":
    main()
