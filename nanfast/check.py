"""`check_all`: one fused pass and one host sync per device over a model, optimizer, state dict or
any collection of tensors."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from . import distributed
from .ops import stats
from .report import Entry, NonFiniteError, Report


def named_tensors(obj: Any, *, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs `check_all` checks in `obj` (see check_all for what each kind gives)."""
    if isinstance(obj, torch.nn.Module):
        obj = uncompiled(obj)
        if grads:
            yield from ((name, p.grad) for name, p in obj.named_parameters() if p.grad is not None)
        else:
            yield from obj.named_parameters()
            yield from ((name, b) for name, b in obj.named_buffers() if b.is_floating_point() or b.is_complex())
    elif isinstance(obj, torch.optim.Optimizer):
        if grads:
            raise ValueError("nanfast.check_all: grads=True takes an nn.Module, not an optimizer")
        yield from _flatten(obj.state_dict()["state"], "state")
    elif isinstance(obj, torch.Tensor):
        if not grads:
            yield ("tensor", obj)
        elif obj.grad is not None:
            yield ("tensor", obj.grad)
    elif isinstance(obj, Mapping):
        yield from _flatten(obj, "")
    elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
        for i, item in enumerate(obj):
            if isinstance(item, torch.Tensor):
                yield (str(i), item)
            elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
                yield (str(item[0]), item[1])
            else:
                raise TypeError(f"nanfast.check_all: entry {i} is of type {type(item).__name__}; "
                                "expected a Tensor or a (name, Tensor) pair")
    else:
        raise TypeError(f"nanfast.check_all: cannot check a {type(obj).__name__}; pass an nn.Module, an optimizer, "
                        "a mapping of tensors (state_dict) or an iterable of tensors or (name, tensor) pairs")


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside a torch.compile wrapper, whose names carry an `_orig_mod.` prefix: entries are
    named as in the model (the parameters are the same tensors)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return module


def _flatten(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in nested dicts, lists and tuples (as in optimizer.state_dict()), names joined with '.'.
    Other leaves (hyper-parameters, step counts as ints) are not values to check and are skipped."""
    if isinstance(obj, torch.Tensor):
        yield (prefix, obj)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _flatten(value, f"{prefix}.{i}" if prefix else str(i))


def _validate(name: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        raise ValueError(f"nanfast.check_all: {name!r} has layout {t.layout}; only strided tensors are supported "
                         "(check a sparse tensor's .values(), or .to_dense() it)")
    if t.is_meta:
        raise ValueError(f"nanfast.check_all: {name!r} is a meta tensor: it has no values to check")


def check_all(obj: Any, *, grads: bool = False, raise_on_nonfinite: bool = True) -> Report:
    """Checks every tensor in `obj` for NaN/+inf/-inf and computes their norms.

    `obj` may be an nn.Module (its named parameters and floating buffers; with grads=True the
    parameters' .grad instead, skipping parameters without one), a torch.optim.Optimizer (its state
    tensors, named state.<param index>.<key>), a Mapping name -> Tensor (a state_dict; nested
    dicts/lists named with '.'), or an iterable of Tensors or of (name, Tensor) pairs. Tensors on
    several devices are grouped: one fused pass and one host sync per device. A DTensor (FSDP2,
    tensor parallel) is checked on its local shard, then its row is reduced over its mesh (two small
    all-reduces per process group, not per tensor): its entry names and counts the full tensor, with
    the global norm, on every rank. With DTensors, every rank of their meshes must call check_all.

    Raises NonFiniteError (carrying the Report) if anything is non-finite and raise_on_nonfinite."""
    pairs = list(named_tensors(obj, grads=grads))
    local = [distributed.local_tensor(t) for _, t in pairs]
    by_device: dict[torch.device, list[int]] = {}
    for i, ((name, _), t) in enumerate(zip(pairs, local)):
        _validate(name, t)
        by_device.setdefault(t.device, []).append(i)

    entries: list[Entry] = [None] * len(pairs)  # type: ignore[list-item]
    for device, indices in by_device.items():
        try:
            s = stats([local[i] for i in indices])
        except (RuntimeError, TypeError, ValueError):
            for i in indices:  # the error path: find the entry the op refuses, and name it
                try:
                    stats([local[i]])
                except (RuntimeError, TypeError, ValueError) as e:
                    raise type(e)(f"nanfast.check_all: {pairs[i][0]!r}: {e}") from e
            raise
        # One transfer per device: counts are exact in float64 up to 2^53.
        rows = torch.cat([s.counts.double(), s.norm[:, None], s.absmax[:, None]], dim=1)
        rows = distributed.globalize_rows([pairs[i][1] for i in indices], rows).tolist()
        for i, (nan, posinf, neginf, norm, absmax) in zip(indices, rows):
            name, t = pairs[i]
            entries[i] = Entry(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), str(device),
                               t.numel(), int(nan), int(posinf), int(neginf), norm, absmax)
    report = Report(tuple(entries))
    if raise_on_nonfinite and not report.ok:
        raise NonFiniteError(report)
    return report
