"""A plain float64 reference for nanfast's statistics, and the comparison the tests share.

The reference reads a tensor the way a user sees it (conjugate and negative views resolved, complex
as real and imaginary parts, integers and bools as their values) and computes everything with
ordinary torch ops in float64, one tensor at a time."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def _copyable(dtype):
    """dtype, where torch can copy its tensors (the tests clone and move their inputs), else None."""
    try:
        torch.zeros(2, dtype=torch.uint8).view(dtype).clone()
    except (NotImplementedError, RuntimeError):  # torch 2.8 has float4_e2m1fn_x2 but no copy kernel for it
        return None
    return dtype


# The MX dtypes: float8_e8m0fnu, and float4_e2m1fn_x2 where torch can copy it (2.8 cannot).
FLOAT8_E8M0FNU = torch.float8_e8m0fnu
FLOAT4_E2M1FN_X2 = _copyable(torch.float4_e2m1fn_x2)
MX_DTYPES = tuple(d for d in (FLOAT8_E8M0FNU, FLOAT4_E2M1FN_X2) if d is not None)

# The fp4 e2m1 magnitudes of the OCP MX spec (v1.0, section 5.3.3), indexed by exponent and mantissa bits.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class ReferenceStats(NamedTuple):
    nan: int
    posinf: int
    neginf: int
    norm: float
    absmax: float

    @property
    def counts(self) -> list[int]:
        return [self.nan, self.posinf, self.neginf]


def _mx_values(t: torch.Tensor) -> torch.Tensor:
    """The values of an MX tensor, decoded from its bytes by the formats' definitions (torch has no
    float4 conversion): e8m0 byte e is 2^(e - 127), NaN at 0xFF; a float4_e2m1fn_x2 byte holds two
    e2m1 values, the first in its low nibble."""
    negated = t.is_neg()
    bits = (torch._neg_view(t) if negated else t).view(torch.uint8).reshape(-1).to(torch.int64)
    if t.dtype == FLOAT8_E8M0FNU:
        values = torch.where(bits == 255, math.nan, torch.exp2(bits.double() - 127))
    else:
        nibbles = torch.stack([bits & 0xF, bits >> 4], dim=1).reshape(-1)
        magnitudes = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float64)[nibbles & 7]
        values = torch.where(nibbles & 8 != 0, -magnitudes, magnitudes)
    return -values if negated else values


def reference_values(t: torch.Tensor) -> torch.Tensor:
    """The values the ops count, as a flat float64 tensor."""
    if t.dtype in MX_DTYPES:
        return _mx_values(t)
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.resolve_neg().reshape(-1).to(torch.float64)


def reference_stats(t: torch.Tensor) -> ReferenceStats:
    x = reference_values(t)
    finite = x[torch.isfinite(x)]
    absmax = finite.abs().max().item() if finite.numel() else 0.0
    # Scaled by absmax so that the reference itself neither overflows nor underflows in float64.
    norm = absmax * torch.linalg.vector_norm(finite / absmax).item() if absmax > 0 else 0.0
    return ReferenceStats(
        int(torch.isnan(x).sum()), int(torch.isposinf(x).sum()), int(torch.isneginf(x).sum()), norm, absmax
    )


def norm_rel_tol(t: torch.Tensor) -> float:
    """float32-like inputs are summed in float within blocks of eight squares (see simd_body.h): 1e-6
    is the project's promise. float64 and integer inputs are summed in double all the way."""
    real = t.real.dtype if t.is_complex() else t.dtype
    return 1e-9 if real == torch.float64 or not real.is_floating_point else 1e-6


def assert_stats_match(counts: torch.Tensor, norm: torch.Tensor, absmax: torch.Tensor, tensors) -> None:
    """counts/norm/absmax (the op's outputs) against the reference, tensor by tensor: counts and absmax
    exactly (absmax is a max of values), norms within norm_rel_tol."""
    assert counts.shape == (len(tensors), 3) and counts.dtype == torch.int64
    assert norm.shape == (len(tensors),) and norm.dtype == torch.float64
    assert absmax.shape == (len(tensors),) and absmax.dtype == torch.float64
    got_counts, got_norm, got_absmax = counts.tolist(), norm.tolist(), absmax.tolist()
    for i, t in enumerate(tensors):
        ref = reference_stats(t)
        where = f"tensors[{i}] ({t.dtype}, shape {tuple(t.shape)}, strides {t.stride()}, offset {t.storage_offset()})"
        assert got_counts[i] == ref.counts, f"{where}: counts {got_counts[i]} != reference {ref.counts}"
        assert got_absmax[i] == ref.absmax, f"{where}: absmax {got_absmax[i]!r} != reference {ref.absmax!r}"
        assert math.isclose(got_norm[i], ref.norm, rel_tol=norm_rel_tol(t), abs_tol=0.0), (
            f"{where}: norm {got_norm[i]!r} != reference {ref.norm!r}"
        )


def reference_any_nonfinite(tensors) -> bool:
    return any(sum(reference_stats(t).counts) > 0 for t in tensors)


def torch_total_norm(tensors) -> torch.Tensor:
    """torch's L2 norm of the tensors' L2 norms (torch.nn.utils.get_total_norm)."""
    return torch.nn.utils.get_total_norm(list(tensors))


def unsupported_dtype_tensor() -> torch.Tensor:
    """Two elements of a dtype the ops reject (bits16)."""
    return torch.zeros(2, dtype=torch.int16).view(torch.bits16)
