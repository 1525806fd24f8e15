"""`named_leaves`: the tensors inside nested containers (a batch, a loaded checkpoint), with their paths."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch

# A path as links to the parent: (parent, segment, is_key). Built into a string only for a tensor, so a
# deeply nested object costs memory linear in its size, not in the sum of its path lengths.
_Node = Optional[tuple[Any, str, bool]]


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _children(obj: Any) -> Optional[list[tuple[str, bool, Any]]]:
    """(segment, is_key, value) for each item of a container; None for a leaf."""
    if isinstance(obj, Mapping):
        return [(str(key), True, value) for key, value in obj.items()]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(field.name, True, getattr(obj, field.name)) for field in dataclasses.fields(obj)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return [(name, True, value) for name, value in zip(obj._fields, obj)]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", False, value) for i, value in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(f"{{{i}}}", False, value) for i, value in enumerate(obj)]
    return None


def _path(node: _Node) -> str:
    segments = []
    while node is not None:
        node, segment, is_key = node
        segments.append((segment, is_key))
    segments.reverse()
    return "".join(f".{s}" if is_key and i else s for i, (s, is_key) in enumerate(segments))


def named_leaves(obj: Any, *, tensor_attributes: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in nested mappings, dataclasses, named tuples, lists, tuples and sets, with their
    paths: keys and fields joined with '.', sequence positions as [i], set items as {i} ("inputs.image",
    "[1]", "pair[0].x"). Other leaves (strings, numbers, None) hold no values to check and are skipped.

    The walk is iterative, so any depth is fine, and enters each container once: a container that holds
    itself (a cycle) or is held twice is walked once, so a crafted object is walked in time linear in
    its size. Tensors come in depth-first order, as written.

    Args:
        obj: a tensor, or a nesting of the containers above.
        tensor_attributes: also walk the attributes set on a plain tensor or parameter ("w.scale"), which
            torch.save keeps (a subclass's attributes are its own internals).

    Returns:
        An iterator of (path, tensor); a bare tensor has the path "".
    """
    stack: list[tuple[Any, _Node]] = [(obj, None)]
    entered: set[int] = set()  # ids of containers; `obj` keeps them all alive while we walk
    while stack:
        value, node = stack.pop()
        if isinstance(value, torch.Tensor):
            yield _path(node), value
            if not (tensor_attributes and type(value) in _PLAIN_TENSORS and value.__dict__):
                continue
            value = value.__dict__
        children = _children(value)
        if children is None or id(value) in entered:
            continue
        entered.add(id(value))
        stack.extend((child, (node, segment, is_key)) for segment, is_key, child in reversed(children))
