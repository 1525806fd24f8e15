"""Nested tensors (`torch.nested`, strided and jagged layouts) in the public ops: the kernels take plain
strided tensors, so such an entry is read through the strided tensors that hold exactly its values, and
its rows are merged back into one. Reached only once the op has refused a list (the fast path pays
nothing): for strided nested tensors (jagged ones, Python subclasses, are read in C++ by the unboxed
nanfast._C.stats, as the watch reads every nested tensor, in _C.stats_on), and under torch.compile."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _C


def any_nested(tensors: Sequence[torch.Tensor]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_nested for t in tensors)


def parts(t: torch.Tensor) -> list[torch.Tensor]:
    """Strided tensors whose elements are exactly those of `t` (views, no copy): a plain tensor itself,
    a contiguous jagged tensor's values() buffer, else the components. A jagged tensor made by narrow()
    has a buffer wider than its components, which torch splits by reading its offsets and lengths to the
    host: the one case that syncs."""
    if not t.is_nested:
        return [t]
    t = t.detach()
    if t.layout == torch.jagged and t.lengths() is None:
        return [t.values()]
    return list(t.unbind())


def shape(t: torch.Tensor) -> tuple[int, ...]:
    """`t.shape` as ints; a nested tensor's ragged dimensions are -1."""
    if not t.is_nested:
        return tuple(t.shape)
    sizes = []
    for dim in range(t.dim()):
        try:
            size = t.size(dim)
        except RuntimeError:  # a strided nested tensor's irregular dimension
            size = -1
        sizes.append(size if isinstance(size, int) else -1)  # a jagged one's is a symbolic int
    return tuple(sizes)


def _split(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The parts of all entries, and the entry each belongs to (int64, on the entries' device)."""
    flat, owners = [], []
    for i, t in enumerate(tensors):
        pieces = parts(t)
        flat += pieces
        owners += [i] * len(pieces)
    return flat, torch.tensor(owners, dtype=torch.int64).to(tensors[0].device, non_blocking=True)


def stats_rows(op, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stats op's (counts, norm, absmax), one row per entry, nested entries included. No host sync."""
    n, device = len(tensors), tensors[0].device
    flat, owners = _split(tensors)
    if not flat:
        return (torch.zeros((n, 3), dtype=torch.int64, device=device), torch.zeros(n, dtype=torch.float64, device=device),
                torch.zeros(n, dtype=torch.float64, device=device))
    return _C.merge_rows(*op(flat), owners, n)


def any_nonfinite(op, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The any_nonfinite op's flag over all entries, nested entries included. No host sync."""
    flat = [p for t in tensors for p in parts(t)]
    return op(flat) if flat else torch.zeros((), dtype=torch.bool, device=tensors[0].device)
