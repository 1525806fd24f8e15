"""`named_leaves`: the tensors inside nested containers (a batch, a loaded checkpoint), with their paths."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def named_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in nested mappings, dataclasses, named tuples, lists and tuples, with their paths:
    keys and fields joined with '.', sequence positions as [i] ("inputs.image", "[1]", "pair[0].x").
    Other leaves (strings, numbers, None) hold no values to check and are skipped."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from named_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from named_leaves(getattr(obj, field.name), f"{prefix}.{field.name}" if prefix else field.name)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        for name, value in zip(obj._fields, obj):
            yield from named_leaves(value, f"{prefix}.{name}" if prefix else name)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from named_leaves(value, f"{prefix}[{i}]")
