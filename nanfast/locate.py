"""`locate`: find the first ATen op that turns finite values into NaN or inf, forward or backward, and
say where it ran, what its inputs were and which ops made them (tfdbg's workflow, done per op).

`locate_step` re-runs one training step under `locate`; `replay` re-runs a dumped op."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import ops as _ops  # noqa: F401  (registers torch.ops.nanfast.*)
from ._tree import group_by_device, leaves, named_leaves
from .diagnosis import diagnose
from .node_verdict import NodeVerdicts
from .recompute import recomputation_in
from .report import NonFiniteError

__all__ = ["Locate", "LocateFinding", "Producer", "SourceLine", "StepState", "TensorInfo", "locate", "locate_step",
           "replay"]

ACTIONS = ("raise", "record")
_FORWARD_SOURCE_KEY = "nanfast.forward_source"


# --------------------------------------------------------------------------------------------------
# Source lines
# --------------------------------------------------------------------------------------------------

class SourceLine(NamedTuple):
    """A line of the user's code: the innermost frame outside torch and nanfast. (A NamedTuple, not a
    dataclass: one is made per op, and a tuple is the cheapest object to make.)"""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANFAST_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# NOTE: [demo code is user code]
# The demo lives inside the package but plays the user: its model's lines are what a report should
# point at, so it is the one nanfast file that user_frame does not skip.
_USER_FILES_IN_PACKAGE = (os.path.join(_NANFAST_DIR, "demo.py"),)
_internal_by_filename: dict[str, bool] = {}


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    internal = (path.startswith(_TORCH_DIR) or path.startswith(_NANFAST_DIR)) and path not in _USER_FILES_IN_PACKAGE
    _internal_by_filename[filename] = internal
    return internal


def user_frame() -> Optional[SourceLine]:
    """The innermost frame of the calling thread outside torch and nanfast (None on threads that run
    no user code, as the CUDA autograd workers). Walks frames, never formats a traceback: it runs per op."""
    frame = sys._getframe(1)
    internal_by_filename = _internal_by_filename
    while frame is not None:
        code = frame.f_code
        internal = internal_by_filename.get(code.co_filename)
        if internal is None:
            internal = _is_internal(code.co_filename)
        if not internal:
            return SourceLine(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


# --------------------------------------------------------------------------------------------------
# What a finding holds
# --------------------------------------------------------------------------------------------------

RECOMPUTED = "recomputed in backward (activation checkpointing)"


class Producer(NamedTuple):
    """The op that last wrote a tensor's storage under `locate`. For a backward op, `source` is where
    the forward op of its autograd node ran (the line the user wrote); for a forward op that activation
    checkpointing re-ran in backward (phase "recompute"), the line of the checkpointed code. One is made
    per op."""

    op: str
    phase: str  # "forward" | "backward" | "recompute"
    node: Optional[str]
    source: Optional[SourceLine]

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        if self.phase == "backward":
            return f"{self.op} (backward of {self.node or 'an unknown node'}, forward{where or ' line unknown'})"
        if self.phase == "recompute":
            return f"{self.op} ({RECOMPUTED}){where}"
        return f"{self.op}{where}"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One input or output of the reported op (of a nested tensor: its values(), so named). min/max are
    over its finite elements (None when it has none or is complex); `producer` (inputs only) is None for
    a tensor no op under locate wrote: data, parameters, buffers, or values made before locate was
    entered. `partial`: `producer` wrote only part of the tensor's storage in place, over values made
    before locate (`x[:, 0] = 0` on a batch), and the rest still counts as from outside."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    nan: int
    posinf: int
    neginf: int
    min: Optional[float]
    max: Optional[float]
    producer: Optional[Producer] = None
    partial: bool = False

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    def describe(self, with_producer: bool) -> str:
        text = f"{self.name}: {list(self.shape)} {self.dtype} nan={self.nan} +inf={self.posinf} -inf={self.neginf}"
        if self.min is not None:
            text += f" min={self.min:.6g} max={self.max:.6g}"
        if with_producer:
            outside = "not made under locate (data, parameter or buffer)"
            if self.producer is None:
                text += f" <- {outside}"
            elif self.partial:
                text += f" <- partly written by {self.producer}; the rest {outside}"
            else:
                text += f" <- {self.producer}"
        return text

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["producer"] = str(self.producer) if self.producer else None
        return d


@dataclasses.dataclass(frozen=True)
class LocateFinding:
    """What `locate` found. kind "producer": `op` made non-finite values its inputs did not hold (inf
    from finite inputs, or NaN from inputs without NaN). kind "scalar": `op` made non-finite values from
    a non-finite number argument (`x * nan`, `torch.full(..., nan)`, `x + inf`) and is not one of the
    masking ops allowed an infinite one (MASKING_OPS). kind "input": `op` is the first op to consume NaN
    that no op under locate produced (dirty data, a NaN parameter).

    `phase` is "forward", "backward", or "recompute" (a forward op that activation checkpointing ran
    again in backward). `source` is where the op ran (in backward: the line that called backward, when
    the engine ran on a thread with Python frames); `forward_source` (backward only) is where the
    forward op of `node` ran. `diagnosis`: the pattern in words, where the op and its inputs show a
    known one (nanfast.diagnosis: a fully masked softmax row, division by exact zeros, ...), else None."""

    kind: str
    op: str
    phase: str
    node: Optional[str]
    source: Optional[SourceLine]
    forward_source: Optional[SourceLine]
    reason: str
    outputs: tuple[TensorInfo, ...]
    inputs: tuple[TensorInfo, ...]
    scalars: tuple[str, ...]  # the op's non-tensor arguments, as name=value
    dump: Optional[str] = None
    diagnosis: Optional[str] = None

    @property
    def where(self) -> Optional[SourceLine]:
        """The user's line responsible: the forward line of the node in backward, the op's own line in forward."""
        return self.forward_source if self.phase == "backward" else self.source

    def summary(self) -> str:
        phase = {"backward": f"backward of {self.node}", "recompute": RECOMPUTED}.get(self.phase, "forward")
        at = f" at {self.where}" if self.where else ""
        why = f": {self.diagnosis}" if self.diagnosis else ""
        return f"nanfast.locate: {self.op} ({phase}){at}: {self.reason}{why}"

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.phase == "backward":
            lines.append(f"  autograd node: {self.node}, forward op at {self.forward_source or 'unknown'}")
            lines.append(f"  backward called at {self.source or 'unknown (autograd worker thread)'}")
        else:
            lines.append(f"  op called at {self.source or 'unknown'}")
        lines.append("  outputs:")
        lines += [f"    {o.describe(with_producer=False)}" for o in self.outputs]
        lines.append("  inputs:")
        lines += [f"    {i.describe(with_producer=True)}" for i in self.inputs] or ["    (no tensor inputs)"]
        if self.scalars:
            lines.append(f"  scalar arguments: {', '.join(self.scalars)}")
        if self.dump:
            lines.append(f"  inputs saved to {self.dump} (nanfast.replay({self.dump!r}) re-runs the op)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "op": self.op, "phase": self.phase, "node": self.node,
            "source": str(self.source) if self.source else None,
            "forward_source": str(self.forward_source) if self.forward_source else None,
            "reason": self.reason, "outputs": [o.to_dict() for o in self.outputs],
            "inputs": [i.to_dict() for i in self.inputs], "scalars": list(self.scalars), "dump": self.dump,
            "diagnosis": self.diagnosis,
        }


# --------------------------------------------------------------------------------------------------
# Per-op bookkeeping
# --------------------------------------------------------------------------------------------------

# Ops whose outputs hold no values to judge: uninitialized memory, or metadata changes.
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
                  "resize_", "resize_as_", "set_"}
# In-place ops that overwrite self without reading it: its old values are not an input.
_OVERWRITE_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "exponential_", "geometric_",
                   "log_normal_", "cauchy_", "random_"}
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


_op_info_cache: dict[Any, _OpInfo] = {}


def _op_info(func) -> _OpInfo:
    info = _op_info_cache.get(func)
    if info is None:
        schema = func._schema
        packet = func.overloadpacket.__name__
        skip = (func.is_view or torch.Tag.inplace_view in func.tags or packet in _UNINITIALIZED
                or func.namespace == "nanfast")
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        out_args = {a.name for a in schema.arguments if a.is_out}
        if packet in _OVERWRITE_SELF:
            out_args |= written
        info = _OpInfo(str(func), skip, tuple(a.name for a in schema.arguments), frozenset(out_args),
                       frozenset(written - out_args), packet in MASKING_OPS, _MASKED_WHEN.get(packet))
        _op_info_cache[func] = info
    return info


# The dtypes that can hold NaN/inf and that the kernels read (float8_e8m0fnu from torch 2.7; packed
# float4_e2m1fn_x2 values are all finite).
_FLOATING = frozenset((torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2,
                       torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.float8_e4m3fnuz, torch.complex64,
                       torch.complex128, *filter(None, (getattr(torch, "float8_e8m0fnu", None),))))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """The strided tensor holding t's values: a nested tensor's values() (jagged: its values; strided:
    its buffer), or t."""
    return t.values() if t.is_nested else t


def _values(t: Any) -> Optional[torch.Tensor]:
    """What locate checks of `t`: its dense values when they can hold NaN/inf, else None (not a tensor,
    an integer dtype, a sparse or meta tensor)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in _FLOATING or t.is_meta:
        return None
    return _dense(t) if t.is_nested or t.layout == torch.strided else None


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's argument or output: a Tensor, a list of them, or a tuple of both."""
    return (t for t in leaves(value) if isinstance(t, torch.Tensor))


def _named_args(info: _OpInfo, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    named = list(zip(info.arg_names, args))
    named += list(kwargs.items())
    return named


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


def _finite_min_max(t: torch.Tensor) -> tuple[Optional[float], Optional[float]]:
    if t.is_complex() or t.numel() == 0 or t.layout != torch.strided or t.is_meta:
        return None, None
    if t.dtype == torch.bool or t.element_size() == 1 and t.is_floating_point():  # float8: no aminmax kernel
        t = t.to(torch.float32 if t.is_floating_point() else torch.uint8)
    values = t[torch.isfinite(t)] if t.is_floating_point() else t.reshape(-1)
    if values.numel() == 0:
        return None, None
    lo, hi = torch.aminmax(values)
    return float(lo), float(hi)


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


# --------------------------------------------------------------------------------------------------
# The dispatch mode
# --------------------------------------------------------------------------------------------------

# NOTE: [what locate reports]
# Every ATen op that runs under locate (forward ops after autograd's composite decompositions, and the
# ops the autograd engine runs for backward nodes) is checked with one fused any_nonfinite over its
# floating outputs (a nested tensor's values); views, in-place view ops and uninitialized outputs
# (empty) are skipped, since their values are checked where they were made. Only when an output holds
# NaN/inf are the inputs counted, and the first rule that fits says what the op is:
#   - producer: an output holds inf and every input (tensors and numbers) is finite, or an output holds
#     NaN and no input holds NaN (inf - inf, 0 * inf, softmax of a fully masked row).
#   - scalar: a number argument made it: a NaN number and an output NaN where no tensor input held
#     NaN (x * nan, full(..., nan)); or an infinite one, outside the masking ops (NOTE: [masking ops]),
#     and an output inf where no tensor input held inf, or NaN where none held NaN (x + inf, x * inf).
#   - input: an op consumes NaN that came from outside locate: dirty data, a NaN parameter. Infinities
#     from outside are not reported: additive -inf attention masks are built before training.
#   - otherwise the op propagates values already reported (or allowed), and says nothing; so does any op
#     whose non-finite inputs descend from a finding (NOTE: [producer or propagation]).
# In backward, a producer or scalar finding waits for its node's verdict (NOTE: [masked inside a node]).
# The inputs of an in-place op are its arguments before the op: those it reads and writes are cloned
# before it runs (out= arguments and self of copy_/fill_ are written only, and are outputs).
# Provenance: each checked op's outputs' storages record the op and its user line, so an input is
# traced to the op that last wrote its storage (see NOTE: [provenance on storages]).

# NOTE: [producer or propagation]
# A record carries `tainted`: the storage's non-finite values descend from a finding (this op was one,
# or it read tainted non-finite values; NaN reported as `input` taints too). inf * 0 or inf - inf on a
# tainted inf is the same fault again, not a new producer, in action="record" as in "raise". Allowed
# infinities (masking ops, tensors from outside) are not tainted: the NaN they make is still a finding.


# NOTE: [provenance on storages]
# The op that last wrote a storage is kept on the storage's Python object (torch keeps that object, and
# so the attribute, as long as the storage lives): views and saved tensors share it, nothing is kept
# alive by it, and no weak-reference callback runs when a storage dies (a dictionary of weak references
# cost more than the rest of the per-op work). Each locate region has its own token, so records of an
# earlier region are not taken for this one's. A record is (token, producer, partial).
#
# NOTE: [partial writes]
# An in-place (or out=) write to a view that covers only part of a storage made outside the region
# (`x[:, 0] = 0`, `x[:, :2] /= 255` on a batch) leaves the rest of it from outside: the record says
# `partial`, and NaN its consumers read still counts as from outside. A write that covers the whole
# storage (x.copy_(y), x.zero_()) makes it the region's. Covering is decided by size alone, O(1): a
# tensor written in place has no overlapping elements, so numel * element_size == nbytes means every
# byte. When a partial write itself leaves NaN in its view (the slow path: the op was examined), the
# rest of the storage is counted once: if it holds no NaN, every NaN in the storage is the region's.

_PRODUCER_ATTR = "_nanfast_producer"
_region_tokens = itertools.count()


class _LocateMode(TorchDispatchMode):
    def __init__(self, owner: Locate):
        super().__init__()
        self.owner = owner
        self.token = next(_region_tokens)
        self.nodes = NodeVerdicts(_any_nonfinite_values, lambda item: owner._report(*item),
                                  lambda item: owner.masked.append(item[0]))

    def _record(self, t: torch.Tensor) -> Optional[tuple]:
        record = getattr(t.untyped_storage(), _PRODUCER_ATTR, None)
        return record if record is not None and record[0] == self.token else None

    def from_outside(self, t: torch.Tensor) -> bool:
        """Whether t's storage holds values from outside the region (see NOTE: [partial writes])."""
        record = self._record(t)
        return record is None or record[2]

    def tainted(self, t: torch.Tensor) -> bool:
        """Whether t's non-finite values descend from a finding (see NOTE: [producer or propagation])."""
        record = self._record(t)
        return record is not None and record[3]

    def set_producer(self, t: torch.Tensor, producer: Producer) -> None:
        setattr(t.untyped_storage(), _PRODUCER_ATTR, (self.token, producer, False, True))

    def _record_write(self, t: torch.Tensor, producer: Producer, nonfinite: bool, tainted: bool) -> None:
        storage = t.untyped_storage()
        partial = t.numel() * t.element_size() < storage.nbytes() and self.from_outside(t)
        if partial and nonfinite and not _nan_beside(t, storage):
            partial = False  # every NaN in the storage is in the view this op wrote
        setattr(storage, _PRODUCER_ATTR, (self.token, producer, partial, tainted))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = _op_info(func)
        if info.skip:
            return func(*args, **kwargs)
        # Pre-op copies of the arguments the op reads and overwrites.
        before: dict[int, torch.Tensor] = {}
        if info.read_write_args:
            for name, value in _named_args(info, args, kwargs):
                if name in info.read_write_args:
                    for t in _tensors_in(value):
                        if _values(t) is not None:
                            before[id(t)] = t.clone()
        out = func(*args, **kwargs)

        raw, outputs = _outputs(info, out, args, kwargs)
        if not outputs:
            return out
        node = torch._C._current_autograd_node()
        if node is None:
            producer = Producer(info.name, "forward", None, user_frame())
        elif recomputation_in(node) is not None:  # checkpointing re-runs a forward op: its line is the user's
            producer = Producer(info.name, "recompute", None, user_frame())
        else:  # a backward op's line is its node's forward line; the frame walk waits for a finding
            producer = Producer(info.name, "backward", type(node).__name__, node.metadata.get(_FORWARD_SOURCE_KEY))
        nonfinite = _any_nonfinite(outputs)
        tainted = False
        if nonfinite:
            source = user_frame() if producer.phase == "backward" else producer.source
            finding, tainted = self._examine(info, _named_args(info, args, kwargs), before, raw, outputs, producer,
                                             source)
            # A backward node's inner producer is judged by the gradients the node returns.
            if finding is not None and not (producer.phase == "backward" and finding[0].kind != "input"
                                            and self.nodes.defer(node, finding)):
                self.owner._report(*finding)
        if info.read_write_args or info.out_args:
            for t in outputs:
                self._record_write(t, producer, nonfinite, tainted)
        else:
            record = (self.token, producer, False, tainted)
            for t in outputs:
                setattr(t.untyped_storage(), _PRODUCER_ATTR, record)
        return out

    def _examine(self, info: _OpInfo, named: list[tuple[str, Any]], before: dict[int, torch.Tensor],
                 raw: list[torch.Tensor], outputs: list[torch.Tensor], producer: Producer,
                 source: Optional[SourceLine]) -> tuple[Optional[tuple[LocateFinding, Optional[dict]]], bool]:
        """Judges an op whose outputs hold NaN/inf. Returns its finding with the arguments to dump (None
        for propagation) and whether its outputs' non-finite values descend from a finding (this one's
        or an input's)."""
        if info.masked_when is not None and any(n == info.masked_when and v is True for n, v in named):
            return None, False  # the composite calling it zeroes its inf (NOTE: [masked by the composite])
        # (name, values as read or None, live values or None, the tensor as passed)
        inputs: list[tuple[str, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]] = []
        scalars: list[str] = []
        numbers: list[tuple[str, str, bool, bool]] = []  # the non-finite ones: (name, text, nan, inf)
        for name, value in named:
            if name in info.out_args:
                continue
            # Named by position in their list ("indices[1]"), Nones in a Tensor?[] counted.
            tensors = [(label, t) for label, t in named_leaves(value, name, brackets=True)
                       if isinstance(t, torch.Tensor)]
            if tensors:
                for label, t in tensors:
                    label += ".values()" if t.is_nested else ""
                    inputs.append((label, _values(before.get(id(t), t)), _values(t), t))
                continue
            text = _scalar_text(value)
            if text is not None:
                scalars.append(f"{name}={text}")
            nan, inf = _scalar_nonfinite(value)
            if nan or inf:
                numbers.append((name, text, nan, inf))

        checked = [i for i, (_, t, _, _) in enumerate(inputs) if t is not None]
        in_counts = dict(zip(checked, _counts([inputs[i][1] for i in checked]))) if checked else {}
        out_counts = _counts(outputs)
        out_nan = any(c[0] for c in out_counts)
        out_inf = any(c[1] or c[2] for c in out_counts)
        tensor_nan = any(c[0] for c in in_counts.values())
        tensor_inf = any(c[1] or c[2] for c in in_counts.values())
        blamed = [n for n in numbers
                  if n[2] and out_nan and not tensor_nan
                  or n[3] and not info.masking and (out_inf and not tensor_inf or out_nan and not tensor_nan)]
        tainted = any(self.tainted(inputs[i][2]) for i, c in in_counts.items() if any(c))
        dirty = [i for i, c in in_counts.items() if c[0] and self.from_outside(inputs[i][2])]

        if out_inf and not (tensor_nan or tensor_inf or numbers):
            kind, reason = "producer", "made non-finite values from finite inputs"
        elif tainted and not dirty:
            return None, True  # propagates (inf * 0, inf - inf) what a finding made
        elif blamed and not tainted:
            kind = "scalar"
            reason = "; ".join(f"its scalar argument `{name}` is {text}" for name, text, _, _ in blamed)
        elif out_nan and not tensor_nan and not tainted:  # (a NaN number with NaN out is blamed above)
            kind, reason = "producer", "made NaN from inputs without NaN"
        else:
            if not dirty:
                return None, False  # propagates values that were allowed (infinite masks, data)
            kind = "input"
            names = ", ".join(inputs[i][0] for i in dirty)
            reason = f"first op to consume NaN that no op under locate produced (input {names})"

        def info_of(name: str, t: torch.Tensor, counts: tuple[int, int, int], record: Optional[tuple]) -> TensorInfo:
            lo, hi = _finite_min_max(t)
            prod = record[1] if record is not None and record[1] is not _OUTSIDE else None
            return TensorInfo(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), *counts,
                              lo, hi, prod, record is not None and record[2])

        input_infos = []
        for i, (name, t, live, passed) in enumerate(inputs):
            dense = t if t is not None else _dense(passed)
            record = self._record(live) if live is not None else None
            input_infos.append(info_of(name, dense, in_counts.get(i, (0, 0, 0)), record))
        if kind == "input":
            for i in dirty:  # report a dirty tensor once, at its first consumer
                self.set_producer(inputs[i][2], _OUTSIDE)
        names = ["out"] if len(outputs) == 1 else [f"out[{k}]" for k in range(len(outputs))]
        output_infos = [info_of(n + (".values()" if r.is_nested else ""), t, c, None)
                        for n, r, t, c in zip(names, raw, outputs, out_counts)]
        repro = (_repro(info.name, named, before, info.out_args)
                 if self.owner._dump_path_for_next() is not None else None)
        diagnosis = None
        if kind != "input":
            as_read = {name: before.get(id(value), value) if isinstance(value, torch.Tensor) else value
                       for name, value in named if name not in info.out_args}
            diagnosis = diagnose(info.name, as_read, outputs)
        finding = LocateFinding(
            kind, info.name, producer.phase, producer.node, source,
            producer.source if producer.phase == "backward" else None, reason,
            tuple(output_infos), tuple(input_infos), tuple(scalars), diagnosis=diagnosis)
        return (finding, repro), True


def _outputs(info: _OpInfo, out: Any, args: tuple, kwargs: dict) -> tuple[list, list[torch.Tensor]]:
    """The op's outputs that locate checks: as returned (nested tensors whole), and their values."""
    if isinstance(out, torch.Tensor):
        values = _values(out)
        return ([out], [values]) if values is not None else ([], [])
    pairs = [(t, v) for t in _tensors_in(out) for v in (_values(t),) if v is not None]
    if not pairs and (info.read_write_args or info.out_args):
        # In-place ops that return nothing (_foreach_*_) changed their written arguments.
        pairs = [(t, v) for name, value in _named_args(info, args, kwargs)
                 if name in info.read_write_args or name in info.out_args
                 for t in _tensors_in(value) for v in (_values(t),) if v is not None]
    return [t for t, _ in pairs], [v for _, v in pairs]


def _nan_beside(t: torch.Tensor, storage: torch.UntypedStorage) -> bool:
    """Whether the storage holds NaN outside the view t (which overlaps no element of itself)."""
    whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
    (whole_nan, _, _), (view_nan, _, _) = _counts([whole, t])
    return whole_nan > view_nan


_OUTSIDE = Producer("(outside locate)", "forward", None, None)


def _record_forward_source(node) -> None:
    # Runs once per autograd node created under locate, right after its forward op returned.
    source = user_frame()
    if source is not None:
        node.metadata[_FORWARD_SOURCE_KEY] = source


def _forward_source_recorder() -> contextlib.AbstractContextManager:
    # torch.autograd.graph.node_creation_hook is recent; without it backward findings name the node
    # but not its forward line.
    hook = getattr(torch.autograd.graph, "node_creation_hook", None)
    return hook(_record_forward_source) if hook is not None else contextlib.nullcontext()


# --------------------------------------------------------------------------------------------------
# Dumps
# --------------------------------------------------------------------------------------------------

def _dump_value(value: Any, before: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return before.get(id(value), value).detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_dump_value(v, before) for v in value)
    if isinstance(value, torch.memory_format):  # not picklable: stored by name
        return {"memory_format": str(value).removeprefix("torch.")}
    return value


def _load_value(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"memory_format"}:
        return getattr(torch, value["memory_format"])
    if isinstance(value, (list, tuple)):
        return type(value)(_load_value(v) for v in value)
    return value


def _repro(op: str, named: list[tuple[str, Any]], before: dict[int, torch.Tensor],
           out_args: frozenset[str]) -> dict[str, Any]:
    """What a dump holds: the op and copies of its arguments as it read them (taken at the op: a
    backward finding is saved only once its node is judged, when they may be gone)."""
    arguments = {name: _dump_value(value, before) for name, value in named if name not in out_args}
    return {"op": op, "arguments": arguments}


def _resolve_op(name: str):
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def replay(path: Union[str, os.PathLike]) -> Any:
    """Loads a dump written by locate(dump=path) (weights_only: it runs no pickled code) and runs the
    op again on the saved inputs, returning its outputs."""
    saved = torch.load(path, weights_only=True)
    func = _resolve_op(saved["op"])
    arguments = {name: _load_value(v) for name, v in saved["arguments"].items()}
    return func(**arguments)


# --------------------------------------------------------------------------------------------------
# The context manager
# --------------------------------------------------------------------------------------------------

class Locate(contextlib.ContextDecorator):
    """Context manager and decorator returned by `locate`. `findings` holds what the last (or current)
    entry found, in order; with action="raise" the first one is also raised as NonFiniteError."""

    def __init__(self, action: str = "raise", dump: Optional[Union[str, os.PathLike]] = None):
        if action not in ACTIONS:
            raise ValueError(f"nanfast.locate: action must be one of {ACTIONS}, got {action!r}")
        self.action = action
        self.dump = os.fspath(dump) if dump is not None else None
        self.findings: list[LocateFinding] = []
        # Producers inside a backward node that what the node returned does not confirm (its gradients
        # were finite, or it received non-finite ones): torch's formulas masking 0/0, or propagation
        # (NOTE: [masked inside a node]). Debug notes, never raised.
        self.masked: list[LocateFinding] = []
        self._mode: Optional[_LocateMode] = None
        self._hook: Optional[Any] = None
        self._lock = threading.Lock()

    @property
    def finding(self) -> Optional[LocateFinding]:
        """The first finding, or None."""
        return self.findings[0] if self.findings else None

    def _dump_path_for_next(self) -> Optional[str]:
        return self.dump if self.dump is not None and not self.findings else None

    def _report(self, finding: LocateFinding, repro: Optional[dict[str, Any]]) -> None:
        path = self._dump_path_for_next()
        if path is not None and repro is not None:
            torch.save(repro, path)
            finding = dataclasses.replace(finding, dump=path)
        self.findings.append(finding)
        if self.action == "raise":
            raise NonFiniteError(finding, str(finding))

    def __enter__(self) -> Locate:
        with self._lock:
            if self._mode is not None:
                raise RuntimeError("nanfast.locate: this locate() is already active; "
                                   "use a new nanfast.locate() for a nested or concurrent region")
            self._mode = _LocateMode(self)
        self.findings = []
        self.masked = []
        self._hook = _forward_source_recorder()
        self._hook.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._mode.nodes.close()
            self._mode.__exit__(*exc)
        finally:
            self._hook.__exit__(*exc)
            self._mode = None
            self._hook = None


def locate(*, action: str = "raise", dump: Optional[Union[str, os.PathLike]] = None) -> Locate:
    """Checks every ATen op that runs inside it, forward and backward, and reports the first one that
    makes NaN/inf from inputs that held none (see LocateFinding), or the first to consume NaN that came
    from outside (dirty data). Use as ``with nanfast.locate():`` or as a decorator ``@nanfast.locate()``.

    action="raise" (default) raises NonFiniteError(finding) at that op, with the op's report as message;
    action="record" runs on and collects every finding in ``.findings``. An op inside a backward node is
    reported only if the node returns a non-finite gradient from finite ones (else it goes to ``.masked``:
    torch masks 0/0 in norms, std, atan2, ...); ``finding.diagnosis`` says the pattern in words where
    one is recognized (nanfast.diagnosis). dump="path.pt" saves the first
    reported op's inputs for nanfast.replay(path). Run forward and backward inside it: a backward node's
    forward line is known only for nodes created inside. Each checked op costs one fused check and, on
    CUDA, one host sync."""
    return Locate(action, dump)


# --------------------------------------------------------------------------------------------------
# Re-running one training step
# --------------------------------------------------------------------------------------------------

def _tensors_of(target: Union[torch.nn.Module, Iterable[torch.Tensor], None]) -> tuple[list, list]:
    if target is None:
        return [], []
    if isinstance(target, torch.nn.Module):
        return list(target.parameters()), list(target.buffers())
    return list(target), []


@dataclasses.dataclass
class StepState:
    """The state a training step starts from: RNG states (CPU and initialized CUDA devices) and,
    optionally, copies of parameter and buffer values and of gradients.

    Capture it before a step's forward (with the defaults it copies only the RNG states: a few KB);
    `locate_step` restores it to run the step again."""

    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    cpu_rng: torch.Tensor
    cuda_rng: Optional[list[torch.Tensor]]
    values: Optional[list[torch.Tensor]]  # copies of params + buffers
    grads: Optional[list[Optional[torch.Tensor]]]  # copies of params' .grad

    @classmethod
    def capture(cls, target: Union[torch.nn.Module, Iterable[torch.Tensor], None] = None, *,
                values: bool = False, grads: bool = False) -> StepState:
        """`target`: a module (its parameters and buffers) or parameters. values=True copies their
        values: needed only when the step to re-run has already updated them (a watch that skips bad
        steps leaves them as they were). grads=True copies their grads, for a step that accumulates onto
        grads of earlier micro-batches; without it the re-run starts from no grads."""
        params, buffers = _tensors_of(target)
        return cls._capture(params, buffers, values, grads)

    @classmethod
    def _capture(cls, params: list, buffers: list, values: bool, grads: bool) -> StepState:
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        with torch.no_grad():
            copies = [t.detach().clone() for t in params + buffers] if values else None
            grad_copies = [None if p.grad is None else p.grad.detach().clone() for p in params] if grads else None
        return cls(params, buffers, torch.get_rng_state(), cuda_rng, copies, grad_copies)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            if self.values is not None:
                for t, saved in zip(self.params + self.buffers, self.values):
                    t.copy_(saved)
            grads = self.grads if self.grads is not None else [None] * len(self.params)
            for p, saved in zip(self.params, grads):
                p.grad = None if saved is None else saved.clone()


def locate_step(step_fn: Callable[[], Any], before: StepState, *,
                dump: Optional[Union[str, os.PathLike]] = None) -> Optional[LocateFinding]:
    """Runs `step_fn` (one step's forward and backward on the same batch, no optimizer step) again
    under locate(action="record"), from the state `before` was captured in, and returns the first
    finding (None if the re-run stayed finite: the fault did not reproduce).

    The re-run leaves no trace: the parameters, buffers and grads `before` covers, and the RNG states,
    are put back as they were when locate_step was called (so training continues bit-identically)."""
    after = StepState._capture(before.params, before.buffers, values=True, grads=True)
    before.restore()
    region = locate(action="record", dump=dump)
    try:
        with region:
            step_fn()
    finally:
        after.restore()
    return region.finding
