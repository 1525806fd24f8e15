"""nanfast.step_summary's CUDA kernel (one block; NOTE: [The step's summary in one call]) against the
CPU kernel, which test_step_summary.py compares with a float64 reference: on a GPU (skipped without
one) and on the CPU emulation of CUDA (tests/cuda_emulation), under every thread order it offers."""

from __future__ import annotations

import math

import cuda_emulation
import pytest
import torch

import nanfast  # noqa: F401  (registers torch.ops.nanfast)
from test_step_summary import random_inputs

CPU_KERNEL = torch.ops.nanfast.step_summary.default


def on(device, args):
    return tuple(a.to(device) if isinstance(a, torch.Tensor)
                 else [t.to(device) for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                 else a for a in args)


class Emulated:
    """The emulation's kernel: a function of CPU inputs, as the GPU's below."""

    def __init__(self, ops):
        self.op = ops.step_summary

    def __call__(self, *args):
        return self.op(*args)


@pytest.fixture(scope="module", params=["gpu", "emulated"])
def summary(request):
    """The CUDA kernel as a function of CPU inputs returning a CPU result."""
    if request.param == "gpu":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        return lambda *args: CPU_KERNEL(*on("cuda", args)).cpu()
    return Emulated(cuda_emulation.ops_for_test())


def same(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-12, abs=0) or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffled"])
def test_matches_the_cpu_kernel_on_random_inputs(summary, order):
    if not isinstance(summary, Emulated) and order != "forward":
        pytest.skip("thread orders are the emulation's")
    if order != "forward":
        torch.ops.nanfast_emu.configure(order, 7)
    try:
        for seed in range(120):
            args = random_inputs(seed)
            want, got = CPU_KERNEL(*args).tolist(), summary(*args).tolist()
            assert len(got) == len(want), seed
            assert all(same(g, w) for g, w in zip(got, want)), (seed, got, want)
    finally:
        if order != "forward":
            torch.ops.nanfast_emu.configure("forward", 0)


def test_one_launch(summary):
    if not isinstance(summary, Emulated):
        pytest.skip("counts the emulation's launches")
    for seed in range(10):
        summary(*random_inputs(seed))
        assert torch.ops.nanfast_emu.last_launches() == [1, 1], seed


@pytest.mark.parametrize("parts", [1, 3, 20], ids=lambda n: f"{n}-parts")
def test_nonfinite_norms_and_many_rows(summary, parts):
    # More rows and modules than the block has threads; a NaN and an inf among the norms; the records'
    # rows in `parts` parts (more than the kernel's arguments hold: joined first).
    rows, n_params, n_groups = 1000, 300, 300
    gen = torch.Generator().manual_seed(0)
    norm = torch.rand(rows, generator=gen, dtype=torch.float64)
    for bad_at in (None, 5, 700):
        for bad in (math.nan, math.inf):
            n = norm.clone()
            if bad_at is not None:
                n[bad_at] = bad
            recorded = list(torch.randint(0, 5, (700, 3), generator=gen).tensor_split(parts))
            recorded_counted = torch.randint(0, 2, (700, 3), generator=gen)
            args = (recorded, recorded_counted, torch.randint(0, 5, (rows, 3), generator=gen), n,
                    torch.rand(rows, generator=gen, dtype=torch.float64), n_params,
                    torch.randint(0, 2, (rows,), generator=gen), False, None, torch.tensor(512.0),
                    [torch.tensor(1.5, dtype=torch.float64)], [1], None,
                    torch.randint(0, n_groups, (rows - n_params,), generator=gen), n_groups)
            want, got = CPU_KERNEL(*args).tolist(), summary(*args).tolist()
            assert all(same(g, w) for g, w in zip(got, want)), (bad_at, bad)


@pytest.mark.parametrize("calls", [[1], [3, 2], [20, 13, 7]], ids=["one", "two-names", "stacked"])
def test_losses_read_where_they_lie_or_stacked_past_32(summary, calls):
    # Up to 32 loss means are read through their own pointers; more are stacked into one tensor first.
    gen = torch.Generator().manual_seed(len(calls))
    losses = [torch.randn((), generator=gen, dtype=torch.float64) * 100 for _ in range(sum(calls))]
    args = ([torch.randint(0, 3, (5, 3), generator=gen)], None, None, None, None, 0, None, False, None, None,
            losses, calls, None, None, 0)
    want, got = CPU_KERNEL(*args).tolist(), summary(*args).tolist()
    assert len(got) == 8 + len(calls) and all(same(g, w) for g, w in zip(got, want)), (got, want)
    first = 0
    for j, n in enumerate(calls):  # each name's mean over its calls, against a float64 reference
        assert got[8 + j] == pytest.approx(sum(float(x) for x in losses[first:first + n]) / n, rel=1e-12)
        first += n
