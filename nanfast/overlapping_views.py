"""The counts and norms of a view whose elements overlap, read from the storage it covers, each element
weighted by how many times the view holds it: a scan's time in proportion to the file, not to the view.

NOTE: [Views that name their elements many times]
A pickle can save a view of a small storage with any shape and strides: shape (256,) * 5 and strides
(1,) * 5 over 1280 elements is a 7 KB file of a view of 10^12 elements, and the scan read every one of
them (hours; a probe, session 52). Broadcast dimensions (stride 0) were already read once and counted
again by the kernels; a view whose other dimensions overlap is read here instead: the storage span it
covers once, and each element's multiplicity (how many of the view's indices land on it), built one
dimension at a time as a box sum over a strided prefix sum (time in proportion to the span per
dimension). The counts are the view's exactly (NaN at an element held 10 times counts 10); the norm is of
the view's finite elements, as the kernels give it."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .report import Entry

__all__ = ["overlapping_view_entry", "reads_faster_by_storage"]


def _span_and_dims(t: torch.Tensor) -> Optional[tuple[int, list[tuple[int, int]]]]:
    """The storage elements from t's offset that its non-broadcast dimensions reach, and those dimensions
    as (size, stride); None for a view with a negative stride (which torch does not make)."""
    dims = [(size, stride) for size, stride in zip(t.shape, t.stride()) if size > 1 and stride != 0]
    if any(stride < 0 for _, stride in dims):
        return None
    return 1 + sum((size - 1) * stride for size, stride in dims), dims


def reads_faster_by_storage(t: torch.Tensor) -> bool:
    """Whether the elements of `t` are better counted from the storage they cover (overlapping_view_entry)
    than read one by one: a real floating or integer view whose multiplicities cost less to build than
    its elements (after its broadcast dimensions, which the kernels read once) cost to read."""
    if t.layout != torch.strided or t.is_complex() or t.is_meta or t.numel() == 0:
        return False
    found = _span_and_dims(t)
    if found is None:
        return False
    span, dims = found
    elements = math.prod(size for size, _ in dims)
    return elements > span and len(dims) * span < elements


def _multiplicities(span: int, dims: list[tuple[int, int]]) -> torch.Tensor:
    """int64 [span]: how many indices of the view (dimensions `dims`) land on each storage element."""
    counts = torch.zeros(span, dtype=torch.int64)
    counts[0] = 1
    for size, stride in dims:
        # new[i] = sum_{j < size} old[i - j * stride]: a prefix sum along i mod stride, less itself
        # size * stride back.
        rows = -(-span // stride)
        padded = torch.zeros(rows * stride, dtype=torch.int64)
        padded[:span] = counts
        prefix = padded.view(rows, stride).cumsum(0)
        boxed = prefix.clone()
        if size < rows:
            boxed[size:] -= prefix[:-size]
        counts = boxed.view(-1)[:span]
    return counts


def overlapping_view_entry(name: str, t: torch.Tensor) -> Entry:
    """The Entry of view `t` (see reads_faster_by_storage), as check_all would make it, from the storage
    span it covers and each element's multiplicity (NOTE: [Views that name their elements many times]).

    Args:
        name: the entry's name.
        t: a strided real tensor on the CPU.

    Returns:
        An Entry: the counts of the view's elements (with multiplicity), the norm and max |x| of its finite
        elements."""
    span, dims = _span_and_dims(t)
    repeats = t.numel() // math.prod(size for size, _ in dims)  # the broadcast dimensions
    weights = _multiplicities(span, dims) * repeats
    values = t.as_strided((span,), (1,), t.storage_offset()).double()
    held = weights > 0
    nan, posinf, neginf = (int(weights[held & test(values)].sum()) for test in (torch.isnan, torch.isposinf,
                                                                                    torch.isneginf))
    held_finite = held & torch.isfinite(values)
    finite = values[held_finite].abs()
    absmax = float(finite.max()) if finite.numel() else 0.0
    weights = weights[held_finite].double()
    norm = absmax * math.sqrt(float((weights * (finite / absmax) ** 2).sum())) if absmax else 0.0
    return Entry(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), t.numel(), nan, posinf,
                 neginf, norm, absmax)
