"""`check_all`: one fused pass and one host sync per device over a model, optimizer, state dict or
any collection of tensors."""

from __future__ import annotations

import enum
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional

import torch

from . import _nested, distributed
from ._tree import group_by_device, is_container, named_leaves
from .ops import stats, unreadable_subclass
from .report import Entry, NonFiniteError, Report


def named_tensors(obj: Any, *, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs `check_all` checks in `obj` (see check_all for what each kind gives);
    Python floats and numpy arrays come as CPU tensors.

    Args:
        obj: what check_all takes (a module, optimizer, state dict, container of tensors, ...).
        grads: the parameters' gradients instead of the parameters (modules).

    Returns:
        An iterator over (name, tensor) pairs, in check_all's order."""
    return iter(_collect(obj, grads)[0])


def _collect(obj: Any, grads: bool) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """(the (name, tensor) pairs to check, the names of leaves that may hold values but cannot be read)."""
    if isinstance(obj, torch.nn.Module):
        obj = uncompiled(obj)
        if grads:
            return [(name, p.grad) for name, p in obj.named_parameters() if p.grad is not None], []
        buffers = [(name, b) for name, b in obj.named_buffers() if b.is_floating_point() or b.is_complex()]
        return list(obj.named_parameters()) + buffers, []
    if grads and not isinstance(obj, torch.Tensor):
        raise ValueError(f"nanfast.check_all: grads=True takes an nn.Module or a Tensor (got {type(obj).__name__})")
    if isinstance(obj, torch.Tensor):
        if not grads:
            return [("tensor", obj)], []
        return ([("tensor", obj.grad)] if obj.grad is not None else []), []
    if isinstance(obj, torch.optim.Optimizer):
        leaves = named_leaves(obj.state_dict()["state"], "state")
    elif is_container(obj) and type(obj) not in (list, tuple):  # mappings, dataclasses, named tuples
        leaves = named_leaves(obj)
    elif values_tensor(obj) is not None:  # a number or a numpy array on its own
        leaves = iter([("value", obj)])
    elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        leaves = named_leaves(obj, name_pairs=True)
    else:
        path = (" (for a checkpoint file: nanfast.scan.scan_file(path), or python -m nanfast scan PATH)"
                if isinstance(obj, (str, os.PathLike)) else "")
        raise TypeError(f"nanfast.check_all: cannot check a {type(obj).__name__}{path}; pass an nn.Module, an "
                        "optimizer, a Tensor, or a container of tensors (mapping, list, tuple, dataclass) such as a "
                        "state_dict or a batch")
    pairs, unchecked = [], []
    taken: set[str] = set()
    for name, leaf in leaves:
        t = values_tensor(leaf)
        if t is not None:
            # Two entries of one name (a key "a.b" beside a["b"]; pairs named alike) stay two entries:
            # the later ones are numbered, so that Report.norms keeps them all; by the first number no
            # entry has (a key may itself be named "a.b (#2)").
            unique, count = name, 1
            while unique in taken:
                count += 1
                unique = f"{name} (#{count})"
            taken.add(unique)
            pairs.append((unique, t))
        elif may_hold_values(leaf):
            unchecked.append(name or f"the object ({type(leaf).__name__})")  # obj itself, its own code raised
    return pairs, unchecked


# Leaves that hold no floating-point values (counters, flags, names, settings): nothing to check.
_NOT_VALUES = (type(None), bool, int, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format,
               # classes and functions (a DynamicCache's layer_class_to_replicate: NOTE: [Key/value caches])
               type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)


def may_hold_values(leaf: Any) -> bool:
    """Whether a leaf that `values_tensor` cannot read may hold floating-point values (then it is
    reported as not checked): not for numbers without NaN, strings, dates, None and the like."""
    if isinstance(leaf, _NOT_VALUES):
        return False
    if isinstance(leaf, enum.Enum):  # a setting, unless its value may hold values (a tensor)
        return may_hold_values(leaf.value)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(leaf, (np.ndarray, np.generic)):
        return np.asarray(leaf).dtype.kind not in "USMm"  # strings, bytes, datetimes, timedeltas
    return True


def values_tensor(leaf: Any) -> Optional[torch.Tensor]:
    """The tensor holding a leaf's values, for check_all, check_batch and scan alike: the leaf itself,
    or a CPU tensor for a Python float or complex number and for a numpy array or scalar (sharing its
    memory; one of another byte order or with a negative stride is copied); None for other leaves and
    for numpy arrays torch cannot read (object or longdouble dtypes)."""
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, (float, complex)):  # a loss or a hyper-parameter; numpy's float64 is a float
        return torch.tensor(leaf, dtype=torch.complex128 if isinstance(leaf, complex) else torch.float64)
    np = sys.modules.get("numpy")  # no array exists unless numpy was imported: never import it here
    if np is None or not isinstance(leaf, (np.ndarray, np.generic)):
        return None
    array = np.asarray(leaf)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if any(stride < 0 for stride in array.strides):  # img[..., ::-1] (BGR to RGB): torch takes no such view
        array = array.copy()
    with warnings.catch_warnings():  # "not writable": it is only read
        warnings.simplefilter("ignore", UserWarning)
        try:
            return torch.as_tensor(array)
        except TypeError:
            return None


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside a torch.compile wrapper, whose names carry an `_orig_mod.` prefix: entries are
    named as in the model (the parameters are the same tensors)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return module


SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
READ_LAYOUTS = (torch.strided, *SPARSE_LAYOUTS)  # a sparse tensor through its values (stored_values)


def stored_values(t: torch.Tensor, coalesced: bool = True) -> torch.Tensor:
    """The strided tensor of a sparse tensor's values, or `t` itself: a COO tensor coalesced first, so that
    its duplicate entries are summed as its values are (an nn.Embedding(sparse=True) gradient holds one
    per occurrence of a token; inf + -inf there is a NaN of the tensor's); with coalesced=False, its
    stored entries (coalescing is a host read on CUDA: the watch reads them so)."""
    if t.layout == torch.sparse_coo:
        return (t.detach().coalesce() if coalesced else t.detach())._values()
    if t.layout in SPARSE_LAYOUTS:
        return t.detach().values()
    return t


def _validate(name: str, t: torch.Tensor) -> None:
    if t.layout not in READ_LAYOUTS and not t.is_nested:
        raise ValueError(f"nanfast.check_all: {name!r} has layout {t.layout}; only strided, sparse and nested "
                         "tensors are supported (.to_dense() it)")
    if t.is_meta:
        raise ValueError(f"nanfast.check_all: {name!r} is a meta tensor: it has no values to check")
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    if fake is not None and isinstance(t, fake.FakeTensor):
        raise ValueError(f"nanfast.check_all: {name!r} is a FakeTensor (made under FakeTensorMode or while "
                         "torch.compile traces): it has no values to check")
    if unreadable_subclass(t):
        raise TypeError(f"nanfast.check_all: {name!r} is a {type(t).__name__}, a tensor subclass whose values the "
                        "kernels cannot read and which names no plain tensors it holds (no __tensor_flatten__); "
                        "check the plain tensors it holds")


def naming_entries(fn: Callable[[list[torch.Tensor]], Any], names: Sequence[str], tensors: list[torch.Tensor],
                   api: str) -> Any:
    """fn(tensors) (nanfast.stats or any_nonfinite over one device's entries); where the op refuses an
    entry, the error names it by its name in `names`, not by its position in this call.

    Raises:
        TypeError, ValueError, RuntimeError: the op's error, prefixed with `api` and the entry's name."""
    try:
        return fn(tensors)
    except (RuntimeError, TypeError, ValueError):
        for name, t in zip(names, tensors):  # the error path: find the entry the op refuses
            try:
                fn([t])
            except (RuntimeError, TypeError, ValueError) as e:
                raise type(e)(f"{api}: {name!r}: {e}") from e
        raise


def check_all(obj: Any, *, grads: bool = False, raise_on_nonfinite: bool = True) -> Report:
    """Checks every tensor in `obj` for NaN/+inf/-inf and computes their norms.

    Tensors on several devices are grouped: one fused pass and one host sync per device. A DTensor
    (FSDP2, tensor parallel) is checked on its local shard, then its row is reduced over its mesh (two
    small all-reduces per process group, not per tensor): its entry names and counts the full tensor,
    with the global norm, on every rank. With DTensors, every rank of their meshes must call check_all.
    A nested tensor (torch.nested) is one entry; its ragged dimensions have size -1 in the entry's shape.

    Args:
        obj: an nn.Module (its named parameters and floating buffers; with grads=True the parameters'
            .grad instead, skipping parameters without one); a torch.optim.Optimizer (its state,
            named state.<param index>.<key>); a Tensor; or any nesting of Mappings (a state_dict,
            named by key), lists, tuples and deques (by position), sets (by position in iteration
            order), named tuples and dataclasses (by field name), names joined with '.'. At the top
            level, a list or iterable may hold (name: str, value) pairs, as `named_parameters()` gives.
            Python floats and numpy arrays are checked as CPU tensors; ints, bools, strings and None
            hold no values to check; other objects are listed in `Report.unchecked`. A container inside
            itself is walked once (a container shared by two entries, at each). Entries that would
            share a name (two pairs named alike; a key "a.b" beside a["b"]) keep it with a number
            after the first: "a.b (#2)", the first number that makes a name no entry has.
        grads: check the .grad of a Module's parameters (or of a Tensor).
        raise_on_nonfinite: raise NonFiniteError if anything is non-finite.

    Returns:
        A Report, its entries in the order of `obj`. Infinities stored on purpose are not `bad` (not
        with grads=True): an entry named as a mask whose only non-finite values are -inf (an additive
        attention mask, a GPT's causal-mask buffer) is in `Report.masks`; a one-element +-inf named as a
        best or worst score (`best_loss = float("inf")`, ReduceLROnPlateau's `best` and `mode_worse`),
        or a min_val at +inf / max_val at -inf (a quantization observer before its first forward), in
        `Report.sentinels`.

    Raises:
        NonFiniteError: something is non-finite (and raise_on_nonfinite); `.report` is the Report.
        TypeError, ValueError, RuntimeError: an entry the kernels cannot read (sparse, meta, quantized,
            an unsupported dtype), named; `obj` of a kind listed nowhere above; grads=True with
            anything but a Module or a Tensor."""
    pairs, unchecked = _collect(obj, grads)
    local = [distributed.local_tensor(t) for _, t in pairs]
    for (name, _), t in zip(pairs, local):
        _validate(name, t)
    local = [stored_values(t) for t in local]  # a sparse tensor is read through its values

    entries: list[Entry] = [None] * len(pairs)  # type: ignore[list-item]
    for device, indices in group_by_device(local).items():
        s = naming_entries(stats, [pairs[i][0] for i in indices], [local[i] for i in indices], "nanfast.check_all")
        # One transfer per device: counts are exact in float64 up to 2^53.
        rows = torch.cat([s.counts.double(), s.norm[:, None], s.absmax[:, None]], dim=1)
        rows = distributed.globalize_rows([pairs[i][1] for i in indices], rows, [pairs[i][0] for i in indices]).tolist()
        for i, (nan, posinf, neginf, norm, absmax) in zip(indices, rows):
            name, t = pairs[i]
            entries[i] = Entry(name, _nested.shape(t), str(t.dtype).removeprefix("torch."), str(device),
                               t.numel(), int(nan), int(posinf), int(neginf), norm, absmax)
    report = Report(tuple(entries), tuple(unchecked), intended=not grads)  # gradients hold no intended infinity
    if raise_on_nonfinite and not report.ok:
        raise NonFiniteError(report)
    return report
