"""What locate needs to know of an op, read once from its schema: whether to skip it, which arguments
it writes, and whether an infinite number argument is a value it places (the masking ops)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

# Ops whose outputs hold no values to judge: uninitialized memory, or metadata changes.
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
                  "resize_", "resize_as_", "set_"}
# In-place ops that overwrite self without reading it: its old values are not an input.
_OVERWRITE_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "exponential_", "geometric_",
                   "log_normal_", "cauchy_", "random_"}
# Ops that write arguments their schema does not mark as written: batch norm in training updates its
# running statistics in place (their pre-op values are inputs, read; the update is a write by the op).
_UNDECLARED_WRITES = {"native_batch_norm": ("running_mean", "running_var"),
                      "cudnn_batch_norm": ("running_mean", "running_var"),
                      "miopen_batch_norm": ("running_mean", "running_var")}
# NOTE: [masking ops]
# The ops whose infinite number argument is a value to place (a mask, a pad, a bound), not an operand:
# an inf they write is intended. Anywhere else a non-finite number that makes a non-finite output is
# the source (kind "scalar"), and a NaN number always is, masking op or not: NaN masks nothing.
MASKING_OPS = frozenset((
    "full", "full_like", "new_full", "fill", "fill_", "scalar_tensor",  # torch.full(..., -inf), torch.where(m, x, -inf)
    "masked_fill", "masked_fill_", "index_fill", "index_fill_", "scatter", "scatter_", "where",
    "constant_pad_nd",  # F.pad(x, value=-inf) before a max-pool
    "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "nan_to_num", "nan_to_num_",
))


# NOTE: [masked by the composite]
# Ops whose inf the composite that calls them zeroes right after, when a flag argument says so: an
# inf they make with it set is intended, like a masking op's (F.ctc_loss(zero_infinity=True) runs
# aten._ctc_loss, which returns inf for an impossible alignment, then a where() that zeroes it, and
# its backward zeroes the gradient). Op (overload packet) -> the flag.
_MASKED_WHEN = {"_ctc_loss": "zero_infinity"}

# NOTE: [workspace outputs]
# Outputs an op returns only for its own backward to read, whose values are no result: aten._ctc_loss's
# log_alpha, the log-space table of alignment probabilities, holds -inf (log 0) for every unreachable
# state and leaves the entries past each target's length uninitialized (2e23 and 7e31 seen there).
# Judged, it made locate stop every healthy F.ctc_loss (a probe, session 43, after
# meijieru/crnn.pytorch#235). The op is judged by its other outputs; the workspace is still recorded as
# its output, so its backward's reads of it are not taken for data from outside.
# Op (overload packet) -> the indices of its workspace outputs.
_WORKSPACE_OUTPUTS = {"_ctc_loss": frozenset((1,))}


@dataclasses.dataclass(frozen=True)
class _OpInfo:
    """What the schema says about an op, computed once per OpOverload."""

    name: str
    skip: bool  # views, in-place views, uninitialized outputs, nanfast's own ops
    arg_names: tuple[str, ...]
    out_args: frozenset[str]  # written, not read (out=, or self of an overwriting op)
    read_write_args: frozenset[str]  # written and read: their pre-op values are inputs
    masking: bool  # in MASKING_OPS
    masked_when: Optional[str]  # its flag in _MASKED_WHEN
    workspace: frozenset[int]  # its outputs in _WORKSPACE_OUTPUTS
    pointwise: bool  # torch.Tag.pointwise: an output element reads the inputs' elements at its index


_op_info_cache: dict[Any, _OpInfo] = {}


def _op_info(func) -> _OpInfo:
    info = _op_info_cache.get(func)
    if info is None:
        schema = func._schema
        packet = func.overloadpacket.__name__
        skip = (func.is_view or torch.Tag.inplace_view in func.tags or packet in _UNINITIALIZED
                or func.namespace == "nanfast")
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        written |= set(_UNDECLARED_WRITES.get(packet, ()))
        out_args = {a.name for a in schema.arguments if a.is_out}
        if packet in _OVERWRITE_SELF:
            out_args |= written
        info = _OpInfo(str(func), skip, tuple(a.name for a in schema.arguments), frozenset(out_args),
                       frozenset(written - out_args), packet in MASKING_OPS, _MASKED_WHEN.get(packet),
                       _WORKSPACE_OUTPUTS.get(packet, frozenset()), torch.Tag.pointwise in func.tags)
        _op_info_cache[func] = info
    return info


def _named_args(info: _OpInfo, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    named = list(zip(info.arg_names, args))
    named += list(kwargs.items())
    return named
