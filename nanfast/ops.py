"""The fused kernels: `torch.ops.nanfast.*`, their fake (meta) implementations, and `stats` /
`any_nonfinite`, the Python entry points. Nothing here syncs the host."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Union

import torch

from . import _C  # loading it registers torch.ops.nanfast.*; it also has their unboxed bindings
from . import _nested, distributed

TensorOrTensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def _check_device(api: str, i: int, t: torch.Tensor, first: torch.Tensor) -> None:
    if t.device != first.device:
        raise ValueError(f"{api}: entry {i} is on {t.device} but entry 0 is on {first.device}; "
                         "pass tensors of one device (nanfast.check_all groups them by device)")


def _check_one_device(tensors, api):
    for i, t in enumerate(tensors):
        _check_device(api, i, t, tensors[0])


@torch.library.register_fake("nanfast::stats")
def _stats_fake(tensors):
    _check_one_device(tensors, "nanfast.stats")
    n = len(tensors)
    device = tensors[0].device if n else torch.device("cpu")
    return (
        torch.empty((n, 3), dtype=torch.int64, device=device),
        torch.empty((n,), dtype=torch.float64, device=device),
        torch.empty((n,), dtype=torch.float64, device=device),
    )


@torch.library.register_fake("nanfast::any_nonfinite")
def _any_nonfinite_fake(tensors):
    _check_one_device(tensors, "nanfast.any_nonfinite")
    device = tensors[0].device if len(tensors) else torch.device("cpu")
    return torch.empty((), dtype=torch.bool, device=device)


@torch.library.register_fake("nanfast::step_summary")
def _step_summary_fake(recorded, recorded_counted, counts, norm, absmax, n_params, counted, nan_only, found_inf,
                       grad_scale, losses, loss_calls, scale, groups, n_groups):
    # The watch's per-step summary (see NOTE: [The step's summary in one call]): 8 values, one per loss
    # name, the scale, one per module.
    size = 8 + len(loss_calls) + (scale is not None) + n_groups
    return torch.empty((size,), dtype=torch.float64, device=recorded[0].device)


def _as_tuple(tensors: TensorOrTensors, api: str) -> tuple[torch.Tensor, ...]:
    """The entries as one tuple: the bindings hold it for the call, and Stats keeps it."""
    if isinstance(tensors, torch.Tensor):
        return (tensors,)
    expected = f"{api}: expected a Tensor or a sequence of Tensors, got {type(tensors).__name__}"
    if isinstance(tensors, Mapping):  # iterating would give its keys
        raise TypeError(f"{expected}; for a state dict or other container of tensors use nanfast.check_all, "
                        "or pass list(d.values())")
    if isinstance(tensors, (str, bytes)):
        raise TypeError(expected)
    try:
        return tuple(tensors)
    except TypeError:
        raise TypeError(expected) from None


def dispatch_subclass(t: torch.Tensor) -> bool:
    """Whether `t` is a tensor subclass with a __torch_dispatch__ of its own (a MaskedTensor, a FakeTensor
    outside its mode): the kernels read plain tensors' memory (nested tensors go through their parts)."""
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ and not t.is_nested


def unreadable_subclass(t: torch.Tensor) -> bool:
    """Whether `t` is a tensor subclass the fused ops cannot read: one with a __torch_dispatch__ of its own
    that names no plain tensors (no __tensor_flatten__: a MaskedTensor, a FakeTensor); a wrapper that
    names them (a TwoTensor, a DTensor) is read through them."""
    return dispatch_subclass(t) and not hasattr(t, "__tensor_flatten__")


def _diagnose(tensors: Sequence[torch.Tensor], api: str) -> None:
    """Raises a clear error naming the first bad entry; called only once the op has refused the list
    (checking every entry up front would cost more than the kernel on thousands of small tensors)."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{api}: entry {i} is of type {type(t).__name__}, not a Tensor")
        if t.layout != torch.strided and not t.is_nested:
            raise ValueError(f"{api}: entry {i} has layout {t.layout}; only strided tensors are supported "
                             "(check a sparse tensor's .values(), or .to_dense() it)")
        _check_device(api, i, t, tensors[0])
        if t.is_quantized:
            raise TypeError(f"{api}: entry {i} is a quantized tensor ({t.dtype}); check its .dequantize()")
        if unreadable_subclass(t):
            raise TypeError(f"{api}: entry {i} is a {type(t).__name__}, a tensor subclass whose values the kernels "
                            "cannot read; check the plain tensors it holds")


def _call(op, tensors: Sequence[torch.Tensor], api: str, on_nested):
    """op(tensors); once the op has refused them, a clear error naming the bad entry, or, where
    some are nested tensors (which the kernels do not take), on_nested(op, tensors)."""
    first = tensors[0]
    if isinstance(first, torch.Tensor) and (first.is_meta or unreadable_subclass(first)) and not _in_fake_mode():
        if first.is_meta:
            raise ValueError(f"{api}: entry 0 is a meta tensor: it has no values to check")
        # A FakeTensor outside its mode runs the op through its own dispatch: fake results, no error (a
        # probe, session 52). Others of them beside it make the op refuse the list.
        _diagnose(tensors, api)
    try:
        return op(tensors)
    except (RuntimeError, TypeError, AssertionError):  # AssertionError: fake mode's, for a real tensor beside fakes
        _diagnose(tensors, api)
        if not _nested.any_nested(tensors):
            raise
    return on_nested(op, tensors)


@functools.cache
def reads_dtype(dtype: torch.dtype) -> bool:
    """Whether the kernels read tensors of `dtype` (they refuse the others)."""
    try:
        torch.ops.nanfast.stats([torch.empty(0, dtype=dtype)])
    except (RuntimeError, TypeError):
        return False
    return True


def _ops():
    """(stats, any_nonfinite): the unboxed bindings in eager mode, the operators under torch.compile,
    which traces torch.ops but not pybind functions (see NOTE: [Unboxed entry points] in
    csrc/python/module.cpp). Both make the same dispatcher call."""
    if torch.compiler.is_compiling():
        return torch.ops.nanfast.stats.default, torch.ops.nanfast.any_nonfinite.default
    return _C.stats, _C.any_nonfinite


def _in_fake_mode() -> bool:
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def combine_norms(norms: torch.Tensor) -> torch.Tensor:
    """The L2 norm of a concatenation, from the L2 norms of its parts (float64 [N] -> 0-dim), relative
    to the largest part: squaring float64 tensors' norms could overflow. No host sync. The op
    torch.ops.nanfast.combine_norms (see NOTE: [Combining norms]), traceable by torch.compile."""
    return torch.ops.nanfast.combine_norms(norms)


@dataclasses.dataclass(frozen=True)
class Stats:
    """Per-tensor statistics of one fused pass, all on the tensors' device (no host sync).

    ``nan``, ``posinf``, ``neginf`` are int64 [N]; ``norm`` (L2 norm of the finite elements) and
    ``absmax`` (largest |x| over the finite elements) are float64 [N]. Complex tensors are counted
    on their real and imaginary parts; integer and bool tensors are finite; a float4_e2m1fn_x2 tensor is
    counted on the two fp4 values each of its elements (bytes, what ``numel`` counts) packs."""

    counts: torch.Tensor  # int64 [N, 3]: nan, posinf, neginf
    norm: torch.Tensor
    absmax: torch.Tensor
    tensors: tuple[torch.Tensor, ...]  # the inputs, for numel and names; Stats keeps them alive

    @property
    def nan(self) -> torch.Tensor:
        return self.counts[:, 0]

    @property
    def posinf(self) -> torch.Tensor:
        return self.counts[:, 1]

    @property
    def neginf(self) -> torch.Tensor:
        return self.counts[:, 2]

    @property
    def nonfinite(self) -> torch.Tensor:
        """NaN + inf + -inf per tensor."""
        return self.counts.sum(dim=1)

    @property
    def any_nonfinite(self) -> torch.Tensor:
        """0-dim bool: any tensor holds a non-finite value."""
        return self.counts.any()

    @property
    def numel(self) -> torch.Tensor:
        sizes = [t.numel() for t in self.tensors]
        return torch.tensor(sizes, dtype=torch.int64).to(self.counts.device, non_blocking=True)

    @property
    def total_norm(self) -> torch.Tensor:
        """0-dim float64: the L2 norm of all finite elements of all tensors."""
        return combine_norms(self.norm)

    def __len__(self) -> int:
        return len(self.tensors)


def stats(tensors: TensorOrTensors) -> Stats:
    """One fused pass over `tensors` (a Tensor or a sequence of Tensors on one device). DTensors (FSDP2,
    tensor parallel) are read on their local shards and their results reduced over their mesh: the
    counts and norms of the full tensors, the same on every rank (collectives, but no host sync).
    A nested tensor (torch.nested, strided or jagged) is one entry, read through its components
    (a jagged one made by torch.nested.narrow is split by torch on the host: one sync).

    Args:
        tensors: a Tensor, or a sequence of Tensors on one device, of any dtype the kernels read.

    Returns:
        A Stats: per-tensor NaN/+inf/-inf counts, L2 norm and max |x| of the finite elements.

    Raises:
        TypeError: `tensors` is not a Tensor or a sequence of Tensors (for a dict of tensors, use
            check_all), or an entry is not a Tensor (the message names it, as for the errors below).
        ValueError: entries on several devices, a sparse or meta entry.
        RuntimeError: an entry of a dtype the kernels do not read."""
    tensors = _as_tuple(tensors, "nanfast.stats")
    if not tensors:
        return Stats(*_stats_fake(tensors), ())
    if distributed.has_dtensor(tensors):
        return _dtensor_stats(tensors)
    return Stats(*_call(_ops()[0], tensors, "nanfast.stats", _nested.stats_rows), tensors)


def _dtensor_stats(tensors: tuple) -> Stats:
    """Stats of the full tensors when some are DTensors: the fused pass over the local shards, then
    small all-reduces over their meshes (see NOTE: [Global statistics of a DTensor])."""
    counts, norm, absmax = _call(_ops()[0], [distributed.local_tensor(t) for t in tensors], "nanfast.stats",
                                 _nested.stats_rows)
    rows = distributed.globalize_rows(tensors, torch.cat([counts.double(), norm[:, None], absmax[:, None]], dim=1))
    return Stats(rows[:, :3].to(torch.int64), rows[:, 3].contiguous(), rows[:, 4].contiguous(), tensors)


def any_nonfinite(tensors: TensorOrTensors) -> torch.Tensor:
    """0-dim bool tensor on the tensors' device: does any element of any tensor hold NaN or ±inf.
    The cheapest check: no norms, and it stops reading once it has found one. For DTensors, true on
    every rank of their mesh when any shard holds one (one MAX all-reduce).

    Args:
        tensors: what `stats` takes (integer and bool tensors are finite: not read).

    Returns:
        A 0-dim bool tensor on the tensors' device (no host sync).

    Raises:
        TypeError, ValueError, RuntimeError: as `stats`, naming the offending entry."""
    tensors = _as_tuple(tensors, "nanfast.any_nonfinite")
    if not tensors:
        return torch.zeros((), dtype=torch.bool)
    if distributed.has_dtensor(tensors):
        local = [distributed.local_tensor(t) for t in tensors]
        flag = _call(_ops()[1], local, "nanfast.any_nonfinite", _nested.any_nonfinite)
        return distributed.globalize_flag(tensors, flag)
    return _call(_ops()[1], tensors, "nanfast.any_nonfinite", _nested.any_nonfinite)
