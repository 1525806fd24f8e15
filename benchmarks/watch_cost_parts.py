"""Where a watched step's cost goes, part by part, on a CPU or a GPU (issue 19): the watch with each group
of its checks turned off in turn, down to its glue (nothing read but input, output and loss: its hooks and
step end), against bare Python module hooks on the same modules (what any per-module check pays before it
does anything), against one bare stats call over the gradients at the optimizer step (what the watch's
pass reads) or one per gradient in backward (the same reads while the gradient may be in cache), and
against no checks, beside a second copy without checks (what two copies differ by).

Each variant trains its own copy of the model (same weights and batches) with its watch left on; the
copies' steps are interleaved in a rotating order; overheads are medians of per-repeat ratios to the
unwatched copy (a step is timed from a synchronize to a synchronize on a GPU). The kernels each variant
adds per step: on a GPU as torch.profiler counts them; on a CPU, the ops the same variant would launch
on a GPU, counted with a GPU's bookkeeping (a recorder keeping its counts as tensors, as on a GPU; views
and allocations aside, the read's copy counted, a nanfast call counted once though its stats make two
launches there). With --profile, one torch.profiler table per workload of the watch's host time by
function.

    python benchmarks/watch_cost_parts.py --device cuda --workloads mlp,transformer-small,resnet18-64
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import statistics
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nanfast
from nanfast import _C
from nanfast.cli import bench_watch, watch_workloads
from nanfast.watcher.install import hooked_modules
from nanfast.watcher.options import PASS_THROUGH, fused_records

# Its neighbour in benchmarks/: the watch options that turn the health features off.
from step_end_floor import FEATURES_OFF

# name -> watch options (None: no checks; "hooks": a do-nothing forward pre-hook and forward hook on
# every module the watch would hook; "grad pass" / "grad hooks": no watch, only a stats call over every
# gradient, at the optimizer step or in backward as each is accumulated). "the other fuse" is filled in
# per device (its default fuses on an accelerator: NOTE: [Fused records by default on accelerators]).
# The watch with nothing read but its input, output and loss is its per-step glue: its hooks and step end.
GLUE = dict(modules=False, params=False, grads=False)
VARIANTS = {
    "none": None,
    # Two copies of one model differ in one process (NOTE: [The run's own null] in nanfast/cli/bench_watch.py):
    # variants within this row's distance of each other are not told apart.
    bench_watch.NULL: None,
    "bare module hooks": "hooks",
    "bare gradient pass at the optimizer step": "grad pass",
    "bare gradient checks in backward": "grad hooks",
    "watch": {},
    "watch, the other fuse": "other fuse",
    "watch(sync=lagged)": dict(sync="lagged"),
    "watch(activations=False)": dict(activations=False),
    "watch(modules=False)": dict(modules=False),
    "watch(modules=False, sync=lagged)": dict(modules=False, sync="lagged"),
    "watch(modules=False, params=False, grads=False)": GLUE,
    "the same, health features off": dict(GLUE, **FEATURES_OFF),
}


@contextlib.contextmanager
def bare_hooks(model: torch.nn.Module):
    """Do-nothing hooks where the watch puts its module hooks (see Installation._install)."""
    def before(module, args):
        return None

    def after(module, args, output):
        return None

    handles = []
    for _, module in hooked_modules(model, PASS_THROUGH):
        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def bare_gradient_checks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, in_backward: bool):
    """One stats call over every gradient right before the optimizer step (what the watch's pass reads), or
    one per gradient as backward accumulates it (while it may still be in cache)."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    if in_backward:
        def check(p):
            _C.stats_on([p.grad], device)

        handles = [p.register_post_accumulate_grad_hook(check) for p in params]
    else:
        def check_all(optimizer, args, kwargs):
            _C.stats_on([p.grad for p in params if p.grad is not None], device)

        handles = [optimizer.register_step_pre_hook(check_all)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _installed(stack: contextlib.ExitStack, variant, model, optimizer, device: str) -> None:
    if variant == "hooks":
        stack.enter_context(bare_hooks(model))
    elif variant in ("grad pass", "grad hooks"):
        stack.enter_context(bare_gradient_checks(model, optimizer, in_backward=variant == "grad hooks"))
    elif variant == "other fuse":
        stack.enter_context(nanfast.watch(model, optimizer, fuse=not fused_records(None, torch.device(device))))
    elif variant is not None:
        stack.enter_context(nanfast.watch(model, optimizer, **variant))


# Ops that launch nothing on a GPU: allocations and type queries (views are told by their schema).
_NO_LAUNCH = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
              "aten.promote_types.default", "aten.lift_fresh.default", "aten.result_type.Tensor"}


class _Launches(TorchDispatchMode):
    """Counts the ops a code would launch on a GPU: all but views and _NO_LAUNCH."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        if not view and str(func) not in _NO_LAUNCH:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def kernels_per_step(runs: dict, model: torch.nn.Module, batch, device: str, steps: int = 3) -> dict[str, float]:
    """Device kernels launched per step by each variant: on a GPU, of `runs` (torch.profiler); on a CPU,
    of copies of `model` whose watches keep their counts as tensors, as on a GPU (see the docstring)."""
    if device.startswith("cuda"):
        from torch.profiler import ProfilerActivity, profile

        counts = {}
        for name, (copy_, optimizer) in runs.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    bench_watch._timed_step(copy_, optimizer, batch, device)
            counts[name] = sum(1 for e in prof.events() if str(e.device_type).lower().endswith("cuda")) / steps
        return counts
    as_on_a_gpu = functools.partial(_C.WatchRecorder, counts_as_tensors=True)
    counts = {}
    with mock.patch.object(_C, "WatchRecorder", as_on_a_gpu), contextlib.ExitStack() as stack:
        for name, variant in VARIANTS.items():
            copy_ = copy.deepcopy(model)
            optimizer = bench_watch._optimizer(copy_)
            _installed(stack, variant, copy_, optimizer, device)
            for _ in range(steps):  # a step left on, as timed: past the first step's full reads
                bench_watch._timed_step(copy_, optimizer, batch, device)
            with _Launches() as launches:
                bench_watch._timed_step(copy_, optimizer, batch, device)
            counts[name] = sum(launches.counts.values())
    return counts


def host_profile(model, optimizer, batch, device: str, steps: int = 5, rows: int = 30) -> str:
    """torch.profiler's table of host time by function over `steps` steps of the installed watch."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=False) as prof:
        for _ in range(steps):
            bench_watch._timed_step(model, optimizer, batch, device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def measure(key: str, device: str, repeats: int, profiled: bool) -> list[dict]:
    """Overheads of VARIANTS on workload `key` of the watch suite, and kernels per step."""
    _, model, batch = watch_workloads.make_workloads(device, [key])[0]
    model.train()
    runs = {}
    with contextlib.ExitStack() as stack:
        for name, variant in VARIANTS.items():
            copy_ = copy.deepcopy(model)
            optimizer = bench_watch._optimizer(copy_)
            _installed(stack, variant, copy_, optimizer, device)
            runs[name] = (copy_, optimizer)

        def step(name: str) -> float:
            return bench_watch._timed_step(*runs[name], batch, device)

        for name in runs:
            for _ in range(3):
                step(name)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for repeat in bench_watch.rotated_repeats(list(runs), step, repeats):
            for name, t in repeat.items():
                times[name].append(t)
        kernels = kernels_per_step(runs, model, batch, device)
        if profiled:
            print(f"\n### host time by function, watch, {key}\n\n```\n"
                  f"{host_profile(*runs['watch'], batch, device)}\n```\n", flush=True)
    base = times["none"]
    rows = []
    for name in runs:
        ratios = [t / b for t, b in zip(times[name], base)]
        low, high = bench_watch.median_interval(ratios)
        rows.append({"workload": key, "variant": name, "step_ms": statistics.median(times[name]) * 1e3,
                     "overhead_pct": (statistics.median(ratios) - 1) * 100,
                     "ci95": ((low - 1) * 100, (high - 1) * 100),
                     "added_ms": (statistics.median(times[name]) - statistics.median(base)) * 1e3,
                     "kernels": kernels[name] - kernels["none"]})
    return rows


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options this script and watch_host_costs.py share: --device and --workloads."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workloads", default="mlp,transformer-small,resnet18-64",
                        help=f"comma-separated keys of the watch suite ({', '.join(watch_workloads.KEYS)})")
    return parser


def machine(device: str) -> str:
    """The first line of the output: where it ran."""
    where = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return f"{where}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="print a host-time table per workload")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{machine(args.device)}, {args.repeats} repeats\n")
    table = ["| workload | variant | median step (ms) | added (ms) | overhead: median | 95% interval | "
             "kernels added per step |", "|---|---|---:|---:|---:|---:|---:|"]
    for key in args.workloads.split(","):
        for row in measure(key, args.device, args.repeats, args.profile):
            low, high = row["ci95"]
            table.append(f"| {row['workload']} | {row['variant']} | {row['step_ms']:.2f} | {row['added_ms']:+.2f} | "
                         f"{row['overhead_pct']:+.1f}% | {low:+.1f}..{high:+.1f}% | {row['kernels']:.0f} |")
        print("\n".join(table), flush=True)
        table = table[:2]


if __name__ == "__main__":
    main()
