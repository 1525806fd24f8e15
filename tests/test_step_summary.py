"""nanfast.step_summary (NOTE: [The step's summary in one call]): its CPU kernel and its ATen
implementation (the one other devices run) against a float64 reference written here with Python
numbers, on random inputs; opcheck; no host read; errors that name the argument."""

from __future__ import annotations

import math
import random

import pytest
import torch

import nanfast  # noqa: F401  (registers torch.ops.nanfast)
from op_recorder import OpRecorder

OP = torch.ops.nanfast.step_summary.default
ATEN = torch._C.DispatchKey.CompositeExplicitAutograd


def cpu_kernel(*args):
    return OP(*args)


def aten(*args):
    return OP._op_dk(ATEN, *args)


def unboxed(*args):
    return nanfast._C.step_summary(*args)  # what the watch calls: the same op, without the boxed call


def combined(norms: list[float]) -> float:
    # The norm of a concatenation, scaled by its largest part (the squares may overflow float64).
    if not norms:
        return 0.0
    if any(math.isnan(x) for x in norms):
        return math.nan
    top = max(norms)
    scale = top if math.isfinite(top) and top > 0 else 1.0
    return scale * math.sqrt(sum((x / scale) ** 2 for x in norms))


def reference(recorded, recorded_counted, counts, norm, absmax, n_params, counted, nan_only, found_inf, grad_scale,
              losses, loss_calls, scale, groups, n_groups) -> list[float]:
    rows = [r for part in recorded for r in part.tolist()]
    weights = recorded_counted.tolist() if recorded_counted is not None else [[1, 1, 1]] * len(rows)
    totals = [sum(int(r[k]) * w[k] for r, w in zip(rows, weights)) for k in range(3)]
    grad_norm = grad_max = param_norm = 0.0
    modules = [0.0] * n_groups
    if counts is not None:
        weights = counted.tolist() if counted is not None else [1] * counts.shape[0]
        for row, w in zip(counts.tolist(), weights):
            totals = [t + c * w for t, c in zip(totals, row)]
        norms = norm.tolist()
        param_norm = combined(norms[:n_params])
        grads = norms[n_params:]
        if grads:
            grad_norm = combined(grads)
            grad_max = max(absmax.tolist()[n_params:])
            if groups is not None:
                squares = [0.0] * n_groups
                for g, x in zip(groups.tolist(), grads):
                    squares[g] += x * x
                modules = [math.sqrt(s) for s in squares]
            if grad_scale is not None:
                inverse = 1.0 / float(grad_scale)
                grad_norm, grad_max = grad_norm * inverse, grad_max * inverse
                modules = [m * inverse for m in modules]
    flag = totals[0] if nan_only else sum(totals)
    out = [flag, *totals, grad_norm, grad_max, param_norm, float(found_inf) if found_inf is not None else 0.0]
    values = [float(x) for x in losses]
    first = 0
    for calls in loss_calls:
        out.append(sum(values[first:first + calls]) / calls)
        first += calls
    if scale is not None:
        out.append(float(scale))
    return out + modules


def random_inputs(seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # The records' rows as the fused calls that checked them gave them: one part, or several (some empty).
    recorded = [torch.randint(0, 4, (rng.randint(0, 12), 3), generator=gen) for _ in range(rng.choice([1, 1, 2, 5]))]
    # Which cells count (NOTE: [Cells a record does not count]): all, or some left out.
    rows = sum(part.shape[0] for part in recorded)
    recorded_counted = torch.randint(0, 2, (rows, 3), generator=gen) if rng.random() < 0.5 else None
    args = dict(recorded=recorded, counts=None, norm=None, absmax=None, n_params=0, counted=None, groups=None,
                n_groups=0)
    if rng.random() < 0.8:
        rows = rng.randint(0, 20)
        n_params = rng.randint(0, rows)
        exponents = torch.randint(-30, 300, (rows,), generator=gen).double()  # up to 1e300: squares overflow
        norm = torch.rand(rows, generator=gen, dtype=torch.float64) * 10.0 ** exponents
        args.update(counts=torch.randint(0, 3, (rows, 3), generator=gen), norm=norm, n_params=n_params,
                    absmax=torch.rand(rows, generator=gen, dtype=torch.float64) * 100)
        if rng.random() < 0.5:
            args["counted"] = torch.randint(0, 2, (rows,), generator=gen)
        grads = rows - n_params
        if grads and rng.random() < 0.6:
            n_groups = rng.randint(1, grads)
            args.update(groups=torch.randint(0, n_groups, (grads,), generator=gen), n_groups=n_groups)
    loss_calls = [rng.randint(1, 3) for _ in range(rng.randint(0, 3))]
    losses = [torch.randn((), generator=gen, dtype=torch.float64) for _ in range(sum(loss_calls))]
    scale_dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
    some = rng.random() < 0.5
    return (args["recorded"], recorded_counted, args["counts"], args["norm"], args["absmax"], args["n_params"],
            args["counted"], rng.random() < 0.3, torch.tensor([float(rng.random() < 0.5)]) if some else None,
            torch.tensor(2.0 ** rng.randint(-4, 16), dtype=scale_dtype) if some and rng.random() < 0.5 else None,
            losses, loss_calls, torch.tensor(65536.0, dtype=scale_dtype) if rng.random() < 0.5 else None,
            args["groups"], args["n_groups"])


@pytest.mark.parametrize("impl", [cpu_kernel, aten, unboxed], ids=["cpu-kernel", "aten", "unboxed"])
def test_matches_a_float64_reference_on_random_inputs(impl):
    for seed in range(300):
        args = random_inputs(seed)
        got = impl(*args)
        assert got.dtype == torch.float64 and got.shape == (len(reference(*args)),), seed
        for i, (g, want) in enumerate(zip(got.tolist(), reference(*args))):
            assert g == pytest.approx(want, rel=1e-12, abs=0) or (math.isnan(g) and math.isnan(want)), (seed, i)


def test_norm_parts_that_are_nan_or_inf_make_the_norm_so():
    for impl in (cpu_kernel, aten):
        for bad in (math.nan, math.inf):
            norm = torch.tensor([1.0, bad, 3.0, 4.0], dtype=torch.float64)
            args = ([torch.zeros(0, 3, dtype=torch.long)], None, torch.zeros(4, 3, dtype=torch.long), norm,
                    torch.zeros(4, dtype=torch.float64), 2, None, False, None, None, [], [], None, None, 0)
            out = impl(*args).tolist()
            assert out[4] == 5.0  # the gradients' rows: 3 and 4
            assert math.isnan(out[6]) if math.isnan(bad) else out[6] == math.inf


def test_opcheck():
    for seed in (1, 2, 5):
        torch.library.opcheck(OP, random_inputs(seed))


@pytest.mark.parametrize("impl", [cpu_kernel, unboxed], ids=["boxed", "unboxed"])
def test_the_cpu_kernel_reads_nothing_on_the_host_and_calls_no_other_op(impl):
    args = random_inputs(3)
    with OpRecorder() as ops:  # the unboxed binding goes through the dispatcher too: modes see it
        impl(*args)
    assert ops.host_syncs == 0
    assert dict(ops.counts) == {"nanfast.step_summary.default": 1}


@pytest.mark.parametrize("change,message", [
    (dict(recorded=[torch.zeros(1, 3, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long)]),
     "recorded\\[1\\] must be int64 \\[rows, 3\\]"),
    (dict(recorded=[]), "recorded is empty"),
    (dict(recorded_counted=torch.ones(2, 3, dtype=torch.long)), "recorded_counted must have 3 elements, got 6"),
    (dict(recorded_counted=torch.ones(1, 3)), "recorded_counted must be Long"),
    (dict(norm=None), "counts, norm and absmax come together"),
    (dict(norm=torch.zeros(3)), "norm must be Double"),
    (dict(absmax=torch.zeros(5, dtype=torch.float64)), "absmax must have 4 elements, got 5"),
    (dict(n_params=5), "n_params=5 is not within the pass's 4 rows"),
    (dict(counted=torch.ones(4)), "counted must be Long"),
    (dict(groups=torch.tensor([0, 3]), n_groups=2), "groups\\[1\\]=3 is not a module number below n_groups=2"),
    (dict(found_inf=torch.zeros(2)), "found_inf must have 1 elements, got 2"),
    (dict(losses=[torch.tensor(1.0, dtype=torch.float64)]), "loss_calls sum to 0, but 1 losses were given"),
    (dict(losses=[torch.tensor(1.0)], loss_calls=[1]), "losses\\[i\\] must be Double"),
], ids=lambda x: "" if isinstance(x, dict) else x[:24])
def test_bad_inputs_are_named(change, message):
    args = dict(recorded=[torch.zeros(1, 3, dtype=torch.long)], recorded_counted=None,
                counts=torch.zeros(4, 3, dtype=torch.long),
                norm=torch.ones(4, dtype=torch.float64), absmax=torch.ones(4, dtype=torch.float64), n_params=2,
                counted=None, nan_only=False, found_inf=None, grad_scale=None, losses=[], loss_calls=[], scale=None,
                groups=None, n_groups=0)
    args.update(change)
    with pytest.raises(RuntimeError, match=f"nanfast.step_summary: {message}"):
        OP(*args.values())


# --- the eager read of a summary (NOTE: [One read per step]) --------------------------------------


@pytest.mark.parametrize("flag", [0.0, 3.0])
def test_read_summary_gives_every_value_with_exactly_one_host_sync(flag):
    summary = torch.randn(40, dtype=torch.float64)
    summary[0] = flag
    summary[6], summary[8] = math.nan, -math.inf  # rows 3 and 4 of the view below
    summary = summary[::2]  # a strided view: the values are read where they are
    with OpRecorder() as ops:
        bad, values = nanfast._C.read_summary(summary)
    assert bad is (flag > 0)
    assert ops.host_syncs == 1  # the flag's item(): the read a test of the watch counts per step
    expected = summary.tolist()
    assert len(values) == len(expected) == 20 and all(type(v) is float for v in values)
    assert all(v == e or (math.isnan(v) and math.isnan(e)) for v, e in zip(values, expected))
    assert math.isnan(values[3]) and values[4] == -math.inf and values[0] == flag


@pytest.mark.parametrize("summary,message", [
    (torch.zeros(3), "Float of shape \\[3\\]"),
    (torch.zeros(0, dtype=torch.float64), "Double of shape \\[0\\]"),
    (torch.zeros(2, 2, dtype=torch.float64), "Double of shape \\[2, 2\\]"),
])
def test_read_summary_names_a_bad_summary(summary, message):
    with pytest.raises(RuntimeError, match="nanfast._C.read_summary: summary must be a non-empty 1-d float64 tensor, got " + message):
        nanfast._C.read_summary(summary)
