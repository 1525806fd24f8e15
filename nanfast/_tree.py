"""Walking nested containers: `named_leaves` (every leaf of dicts, lists, tuples, named tuples and
dataclasses, with its path), `leaves` (the same without paths) and `group_by_device`. One walker, so
that every API finds the same tensors in the same input."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional

import torch

_SEQUENCES = (list, tuple, collections.deque)


def is_container(obj: Any) -> bool:
    """Whether `named_leaves` walks into `obj` (a Tensor is a leaf, although it is iterable)."""
    if isinstance(obj, torch.Tensor):
        return False
    return (isinstance(obj, (Mapping, *_SEQUENCES))
            or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)))


def _children(obj: Any) -> Iterator[tuple[Any, Any]]:
    """(key, value) pairs of a container: mapping keys, field names, or positions."""
    if isinstance(obj, Mapping):
        return iter(obj.items())
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # named tuple
        return zip(obj._fields, obj)
    if isinstance(obj, _SEQUENCES):
        return enumerate(obj)
    return ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))


def _pairs(items: Iterable) -> Iterator[tuple[Any, Any]]:
    """The items of a list: a plain 2-tuple (name: str, value) is named by its first item, others by position."""
    for i, item in enumerate(items):
        if type(item) is tuple and len(item) == 2 and isinstance(item[0], str):
            yield item
        else:
            yield i, item


def named_leaves(obj: Any, prefix: str = "", *, brackets: bool = False,
                 name_pairs: bool = False) -> Iterator[tuple[str, Any]]:
    """Every leaf of nested containers, with its path, depth first in container order.

    Containers: Mappings (named by key), named tuples and dataclass instances (by field name), lists,
    tuples and deques (by position). Everything else is a leaf, Tensors included; what a leaf holds is
    the caller's to decide, so nothing in a container is dropped here. The walk is iterative (any
    depth), and a container met again inside itself (a cycle) is not entered again: its leaves are
    already reached through its first occurrence. A container shared by two branches is walked in
    both.

    Args:
        obj: the root; a leaf root is yielded as (prefix, obj).
        prefix: the root's path.
        brackets: positions in sequences written "[i]" ("pair[0].x"), else joined with "." like keys
            ("pair.0.x"); a mapping's int keys are keys ("state.0").
        name_pairs: the root is an iterable (a list, a generator of `named_parameters()`...) whose
            plain 2-tuples (name: str, value) name their value; other items are named by position.

    Returns:
        An iterator of (path, leaf); paths join keys and field names with ".".
    """
    return _walk(obj, prefix, brackets, name_pairs)


def leaves(obj: Any) -> Iterator[Any]:
    """The leaves `named_leaves(obj)` yields, in the same order, without building their paths (for
    hooks that run at every step and need only the tensors)."""
    return (leaf for _, leaf in _walk(obj, None, False, False))


def _walk(obj: Any, prefix: Optional[str], brackets: bool, name_pairs: bool) -> Iterator[tuple[Optional[str], Any]]:
    """named_leaves; with prefix None, no paths are built (None instead)."""
    if name_pairs:
        root = _pairs(obj)
    elif is_container(obj):
        root = _children(obj)
    else:
        yield prefix, obj
        return
    on_path = {id(obj)}
    # Frames: (container id, path, iterator of (key, value), whether int keys are positions, not mapping keys).
    stack = [(id(obj), prefix, root, name_pairs or isinstance(obj, _SEQUENCES))]
    while stack:
        container_id, path, children, positional = stack[-1]
        for key, value in children:
            if path is None:
                name = None
            elif brackets and positional and isinstance(key, int):
                name = f"{path}[{key}]"
            else:
                name = f"{path}.{key}" if path else str(key)
            if not is_container(value):
                yield name, value
            elif id(value) not in on_path:
                on_path.add(id(value))
                stack.append((id(value), name, _children(value), isinstance(value, _SEQUENCES)))
                break
        else:
            stack.pop()
            on_path.discard(container_id)


def group_by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    """The positions of `tensors` by device, devices in order of first appearance (one fused pass each)."""
    if not tensors:
        return {}
    first = tensors[0].device
    if all(t.device == first for t in tensors):  # the common case: no dict lookups per tensor
        return {first: list(range(len(tensors)))}
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return groups
