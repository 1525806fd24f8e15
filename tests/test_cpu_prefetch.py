"""The CPU kernels with and without their software prefetches (see NOTE: [Prefetching the next page]
in csrc/cpu/simd_body.h): the same results bit for bit, on by default, and
NANFAST_CPU_PREFETCH to decide otherwise."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from reference import assert_stats_match

import nanfast

CPU_ISAS = ("avx512", "avx2", "baseline")
K_SEGMENT = 4096  # kSegment, csrc/cpu/simd_body.h
K_ITEM = 16384  # kItemElements, csrc/cpu/stats_cpu.cpp


def varied_tensors() -> list[torch.Tensor]:
    """Every SIMD dtype, from a few elements to several items, clean, tiny, huge, with non-finite values,
    and 5000-ish small tensors whose prefetches run past their ends into their neighbours."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        for n in (5, 1024, K_SEGMENT + 3, 2 * K_ITEM + 17):
            x = torch.randn(n, generator=gen, dtype=torch.float64)
            bad = x.clone()
            bad[n // 3], bad[-1] = math.nan, -math.inf
            out += [x.to(dtype), (x * 1e-20).to(dtype), (x * (6e4 if dtype == torch.float16 else 1e30)).to(dtype),
                    bad.to(dtype)]
    return out + [torch.randn(1024, generator=gen) for _ in range(300)]


def bits(t: torch.Tensor) -> list:
    return (t.view(torch.int64) if t.dtype == torch.float64 else t).tolist()


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_prefetches_change_no_result(restore_cpu_isa, isa):
    tensors = varied_tensors()
    nanfast._C.set_cpu_isa(isa)
    results = []
    for prefetch in (True, False):
        assert nanfast._C.set_cpu_prefetch(prefetch) is prefetch
        assert nanfast._C.cpu_prefetch() is prefetch
        counts, norm, absmax = torch.ops.nanfast.stats(tensors)
        anys = [torch.ops.nanfast.any_nonfinite([t]).item() for t in tensors[:64]]
        results.append((bits(counts), bits(norm), bits(absmax), anys))
    assert results[0] == results[1]
    assert_stats_match(*torch.ops.nanfast.stats(tensors[:64]), tensors[:64])


def test_set_cpu_isa_keeps_the_prefetch_setting(restore_cpu_isa):
    for prefetch in (True, False):
        nanfast._C.set_cpu_prefetch(prefetch)
        for isa in CPU_ISAS:
            nanfast._C.set_cpu_isa(isa)
            assert nanfast._C.cpu_prefetch() is prefetch


_PROBE = "import nanfast; print(nanfast._C.cpu_prefetch())"


def _probe(value: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("NANFAST_CPU_PREFETCH", None)
    if value is not None:
        env["NANFAST_CPU_PREFETCH"] = value
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True)


def test_prefetches_are_on_by_default():
    out = _probe(None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("value", ["0", "1"])
def test_prefetch_environment_variable(value):
    out = _probe(value)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(value == "1")


def test_unknown_prefetch_environment_variable_is_an_error_at_import():
    out = subprocess.run([sys.executable, "-c", "import nanfast"], env=dict(os.environ, NANFAST_CPU_PREFETCH="yes"),
                         capture_output=True, text=True)
    assert out.returncode != 0 and "NANFAST_CPU_PREFETCH is 'yes' (expected 0 or 1)" in out.stderr
