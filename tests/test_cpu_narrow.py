"""The CPU kernels' 16-bit path (bfloat16 and float16): magnitudes and NaN/inf read from the 16-bit
patterns without widening (narrow_abs_bits() in csrc/cpu/simd_body.h), every pattern through every
ISA's fast path, against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from reference import assert_stats_match, reference_stats

import nanfast

CPU_ISAS = ("avx512", "avx2", "baseline")
NARROW_DTYPES = (torch.bfloat16, torch.float16)
BLOCK = 512  # elements: several blocks of 8 registers for every ISA, so the fast path reads them all


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", NARROW_DTYPES, ids=str)
def test_every_finite_pattern_with_every_cpu_isa(restore_cpu_isa, dtype):
    """Every finite pattern, in tensors of a few blocks each: counts, norm and the exact max |x|."""
    patterns = every_pattern(dtype)
    finite = patterns[torch.isfinite(patterns)]
    tensors = list(finite.split(BLOCK)) + list(finite.flip(0).split(BLOCK))
    for isa in CPU_ISAS:
        nanfast._C.set_cpu_isa(isa)
        counts, norm, absmax = torch.ops.nanfast.stats(tensors)
        assert_stats_match(counts, norm, absmax, tensors)
        assert torch.ops.nanfast.any_nonfinite(tensors).item() is False, isa


@pytest.mark.parametrize("dtype", NARROW_DTYPES, ids=str)
def test_every_nonfinite_pattern_at_every_lane_with_every_cpu_isa(restore_cpu_isa, dtype):
    """Every NaN and inf pattern (either sign, every payload), one per tensor of finite values, at
    lanes that cycle through a 64-byte register: found by any_nonfinite and counted by stats."""
    patterns = every_pattern(dtype)
    bad = patterns[~torch.isfinite(patterns)]
    clean = torch.randn(BLOCK, generator=torch.Generator().manual_seed(0)).to(dtype)
    tensors = []
    for k, value in enumerate(bad):
        t = clean.clone()
        t[k % 64 + 64] = value
        tensors.append(t)
    expected = [reference_stats(t) for t in tensors]
    for isa in CPU_ISAS:
        nanfast._C.set_cpu_isa(isa)
        counts, _, absmax = torch.ops.nanfast.stats(tensors)
        assert counts.sum(1).tolist() == [1] * len(tensors), isa
        assert absmax.tolist() == [ref.absmax for ref in expected], isa
        for t in tensors:
            assert torch.ops.nanfast.any_nonfinite([t]).item() is True, (isa, t)
