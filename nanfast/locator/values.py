"""The values locate checks and counts: floating tensors (a nested tensor's values), their NaN/inf
counts per device with nanfast's fused kernels, finite ranges, and number arguments."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Optional

import torch

from ..ops import dispatch_subclass, reads_dtype  # importing ops registers torch.ops.nanfast.*
from .._tree import group_by_device, leaves
from ..check import SPARSE_LAYOUTS, stored_values


def _can_hold_nonfinite(dtype: torch.dtype) -> bool:
    """Whether `dtype` can hold NaN/inf and the kernels read it (complex32 included; packed
    float4_e2m1fn_x2 values, all finite, are read and count nothing)."""
    return (dtype.is_floating_point or dtype.is_complex) and reads_dtype(dtype)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """The strided tensor holding t's values: a nested tensor's values() (jagged: its values; strided:
    its buffer), or t."""
    return t.values() if t.is_nested else t


def values_label(name: str, t: torch.Tensor) -> str:
    """How a finding names tensor `t` passed as `name`: a nested or sparse one by the values read of it."""
    return name + ".values()" if t.is_nested or t.layout in SPARSE_LAYOUTS else name


def _values(t: Any) -> Optional[torch.Tensor]:
    """What locate checks of `t`: its dense values when they can hold NaN/inf (a sparse tensor's stored
    values: unread, an op fed a NaN in one was said to make NaN from inputs without NaN), else None (not
    a tensor, an integer dtype, a meta tensor). A torch.func wrapper (vmap's batched tensor, grad's
    tracking tensor) reaching a backward node's hook is read through the tensor it wraps, which holds
    every sample's values (the kernels have no batching rule). A tensor subclass with a dispatch of its
    own (MaskedTensor, DTensor, a wrapper) is not read: what its values mean is its own (a MaskedTensor's
    masked-out NaN are no fault), and the op under the mode is the subclass's, whose inner ops the mode
    does not see; its values are checked where they become a plain tensor."""
    while isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    if not isinstance(t, torch.Tensor) or not _can_hold_nonfinite(t.dtype) or t.is_meta or dispatch_subclass(t):
        return None
    if t.layout in SPARSE_LAYOUTS:  # its stored values (their storage is the tensor's values' own)
        return stored_values(t, coalesced=False)
    return _dense(t) if t.is_nested or t.layout == torch.strided else None


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's argument or output: a Tensor, a list of them, or a tuple of both."""
    return (t for t in leaves(value) if isinstance(t, torch.Tensor))



_any_nonfinite_op = torch.ops.nanfast.any_nonfinite.default
_stats_op = torch.ops.nanfast.stats.default


def _any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    # NOTE: [locate syncs]
    # Reading the flag is a host sync per checked op on CUDA (free on CPU). locate is a debugging
    # tool that must stop at the op itself, so it pays that; the always-on watch does not.
    groups = list(group_by_device(tensors).values())
    if len(groups) == 1:
        return _any_nonfinite_op(tensors).item()
    return any(_any_nonfinite_op([tensors[i] for i in group]).item() for group in groups)


def _any_nonfinite_values(tensors: list[torch.Tensor]) -> bool:
    """_any_nonfinite over the tensors' checked values (integer, sparse and meta ones left out)."""
    values = [v for t in tensors for v in (_values(t),) if v is not None]
    return bool(values) and _any_nonfinite(values)


def _counts(tensors: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    rows: list[tuple[int, int, int]] = [(0, 0, 0)] * len(tensors)
    for group in group_by_device(tensors).values():
        counts = _stats_op([tensors[i] for i in group])[0].tolist()
        for i, c in zip(group, counts):
            rows[i] = tuple(c)
    return rows


def finite_min_max(t: torch.Tensor) -> tuple[Optional[float], Optional[float]]:
    """The smallest and largest finite values of `t` (None, None for none, a complex or non-strided
    tensor). Reductions over `t` with the non-finite values replaced, no copy of the finite ones: a
    boolean index built an index list of 8 bytes per element and a copy, 7x a 256 MB input and 6 s for
    one finding (a probe, session 44)."""
    if t.is_complex() or t.numel() == 0 or t.layout != torch.strided or t.is_meta:
        return None, None
    if t.dtype == torch.bool or t.element_size() == 1 and t.is_floating_point():  # float8: no aminmax kernel
        t = t.to(torch.float32 if t.is_floating_point() else torch.uint8)
    if not t.is_floating_point():
        lo, hi = torch.aminmax(t)
        return float(lo), float(hi)
    finite = torch.isfinite(t)
    if not bool(finite.any()):
        return None, None
    return float(torch.where(finite, t, math.inf).amin()), float(torch.where(finite, t, -math.inf).amax())


def finite_absmax(t: torch.Tensor) -> Optional[float]:
    """The largest |x| of the finite values of a real tensor `t` (one fused pass, no copy); None for none."""
    counts, _, absmax = _stats_op([t])
    return None if int(counts.sum()) >= t.numel() else float(absmax[0])


def _scalar_text(value: Any) -> Optional[str]:
    if isinstance(value, (bool, int, float, complex)):
        return repr(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (bool, int, float)) for v in value):
        return repr(list(value))
    if isinstance(value, (torch.dtype, torch.device, str)):
        return str(value)
    return None


def _scalar_nonfinite(value: Any) -> tuple[bool, bool]:
    """(holds NaN, holds inf) for a non-tensor argument (a number or a list of numbers)."""
    values = value if isinstance(value, (list, tuple)) else (value,)
    nan = inf = False
    for v in values:
        if isinstance(v, complex):
            parts = (v.real, v.imag)
        elif isinstance(v, float):
            parts = (v,)
        else:
            continue
        nan |= any(math.isnan(p) for p in parts)
        inf |= any(math.isinf(p) for p in parts)
    return nan, inf


def _at_dtype_limit(inputs: list[Optional[torch.Tensor]], numbers: list[Any], outputs: list[torch.Tensor],
                    pointwise: bool) -> bool:
    """Whether the infinities of `outputs` can be a mask's: an input tensor holds its dtype's largest
    finite magnitude, or a number argument is that of the outputs' dtype: the value code writes in place
    of -inf as a mask (see NOTE: [a mask at the dtype's limit] in examine.py). For a pointwise op, only
    if every infinite element of the outputs lies where an input holds such a value (broadcast): scores
    masked with finfo.min, then divided by a temperature that overflows an unmasked one, made that
    overflow look intended (a probe, session 52)."""
    limits = {torch.finfo(t.dtype).max for t in outputs if t.is_floating_point()}
    if any(isinstance(v, float) and abs(v) in limits for v in numbers):
        return True
    masks = [t.abs() == torch.finfo(t.dtype).max for t in inputs if t is not None and t.is_floating_point()]
    masks = [m for m in masks if bool(m.any())]
    if not masks or not pointwise:
        return bool(masks)
    for out in outputs:
        infinite = torch.isinf(out)
        at_mask = torch.zeros_like(infinite)
        for m in masks:
            try:
                at_mask |= torch.broadcast_to(m, out.shape)
            except RuntimeError:  # an input the output does not broadcast from: judged as a non-pointwise op's
                return True
        if bool((infinite & ~at_mask).any()):
            return False
    return True
