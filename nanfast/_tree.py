"""Walking nested containers: `named_leaves` (every leaf of dicts, lists, tuples, sets, named tuples,
dataclasses and transformers' key/value caches, with its path), `leaves` (the same without paths) and `group_by_device`. One walker, so
that every API finds the same tensors in the same input."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional

import torch

_SEQUENCES = (list, tuple, collections.deque)
_SETS = (set, frozenset)
# Tensors whose attributes torch.save keeps as the user set them (a subclass's are its own internals).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

# How a container names a child: by key (mapping key, field name), by position in a sequence, or by
# position in a set's iteration order.
_KEY, _POSITION, _MEMBER = range(3)
# A path as a link to its parent's: (parent, key, how, depth, anchor), anchor being its ancestor at
# depth _PATH_ENDS (None above it). Built into a string only for a leaf, and a path deeper than twice
# _PATH_ENDS keeps only its steps at each end ("a[0][0]<4968-levels>[0][7]": no space, for columns),
# found through the anchor: a crafted checkpoint's thousands of leaves thousands of levels deep are
# named in time and memory linear in its size, not in the sum of its path lengths.
_Node = Optional[tuple[Any, Any, int, int, Any]]
_PATH_ENDS = 16
_ELIDED = 3  # how an elided middle is named
# On the walk's stack, in place of a node: the container below has been walked, and may be entered again.
_LEAVE = object()
# How many paths a container shared by several is walked at, without shared_once: each path named up to
# this many, and a walk linear in the input's size (a list of [x, x] nested 20 deep took 30 s for a
# million paths to one tensor: a probe, session 43). Its leaves were all yielded at its first paths.
_PATHS_PER_CONTAINER = 8


# NOTE: [Key/value caches]
# A transformers Cache (DynamicCache, StaticCache, EncoderDecoderCache, ...) passed to a forward as
# past_key_values holds the keys and values of the tokens before: a NaN in them comes in with the input.
# The walker did not enter such objects, so the watch named the first attention projection that read
# it as the producer, and check_all listed the cache as not checked (a probe, session 49). A cache and
# its layers are walked as their attributes (`layers`, each layer's `keys` and `values`; older versions'
# `key_cache` and `value_cache` lists), recognised by their base classes in transformers.cache_utils
# without importing transformers. A watched generate() reads the cache at every forward, as its
# attention does.
_CACHE_BASES = frozenset({("transformers.cache_utils", "Cache"), ("transformers.cache_utils", "CacheLayerMixin")})
_is_cache_type: dict[type, bool] = {}


def _is_kv_cache(obj: Any) -> bool:
    kind = type(obj)
    known = _is_cache_type.get(kind)
    if known is None:
        known = _is_cache_type[kind] = any((c.__module__, c.__name__) in _CACHE_BASES for c in kind.__mro__)
    return known


def is_container(obj: Any) -> bool:
    """Whether `named_leaves` walks into `obj` (a Tensor is a leaf, although it is iterable)."""
    if isinstance(obj, torch.Tensor):
        return False
    return (isinstance(obj, (Mapping, *_SEQUENCES, *_SETS))
            or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)) or _is_kv_cache(obj))


def _children(obj: Any) -> list[tuple[Any, int, Any]]:
    """(key, how it names, value) for each item of a container; a mapping's tensor keys too, after its
    values ("<key 0>": a key is checked as a value is, never passed over)."""
    if isinstance(obj, Mapping):
        items = [(key, _KEY, value) for key, value in obj.items()]
        return items + [(f"<key {i}>", _KEY, key) for i, key in enumerate(obj) if isinstance(key, torch.Tensor)]
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # named tuple
        return [(name, _KEY, value) for name, value in zip(obj._fields, obj)]
    if isinstance(obj, _SEQUENCES):
        return [(i, _POSITION, value) for i, value in enumerate(obj)]
    if isinstance(obj, _SETS):
        return [(i, _MEMBER, value) for i, value in enumerate(obj)]
    if _is_kv_cache(obj):  # see NOTE: [Key/value caches]
        return [(name, _KEY, value) for name, value in vars(obj).items()]
    return [(f.name, _KEY, _field(obj, f.name)) for f in dataclasses.fields(obj)]


class Unreadable:
    """In place of a dataclass field its own code could not give (a field never set: an AttributeError),
    a leaf that callers list as not checked: the other fields are still walked."""

    def __init__(self, error: Exception):
        self.error = error


def _field(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except Exception as error:  # noqa: BLE001  (a property or __getattr__ of the container's own)
        return Unreadable(error)


def _pairs(items: Iterable) -> list[tuple[Any, int, Any]]:
    """The items of a list: a plain 2-tuple (name: str, value) is named by its first item, others by position."""
    return [(item[0], _KEY, item[1]) if type(item) is tuple and len(item) == 2 and isinstance(item[0], str)
            else (i, _POSITION, item) for i, item in enumerate(items)]


def named_leaves(obj: Any, prefix: str = "", *, brackets: bool = False, name_pairs: bool = False,
                 shared_once: bool = False, tensor_attributes: bool = False,
                 leaves_once: bool = False) -> Iterator[tuple[str, Any]]:
    """Every leaf of nested containers, with its path, depth first in container order.

    Containers: Mappings (named by key), named tuples and dataclass instances (by field name), lists,
    tuples and deques (by position), sets and frozensets (by position in iteration order). Everything
    else is a leaf, Tensors included; what a leaf holds is the caller's to decide, so nothing in a
    container is dropped here. The walk is iterative (any depth), and a container met again inside
    itself (a cycle) is not entered again: its leaves are already reached through its first occurrence.

    Args:
        obj: the root; a leaf root is yielded as (prefix, obj).
        prefix: the root's path.
        brackets: positions written "[i]" in sequences and "{i}" in sets ("pair[0].x", "s{0}"), else
            joined with "." like keys ("pair.0.x"); a mapping's int keys are keys ("state.0").
        name_pairs: the root is an iterable (a list, a generator of `named_parameters()`...) whose
            plain 2-tuples (name: str, value) name their value; other items are named by position.
        shared_once: a container reached by two paths is walked at the first only, so that any input
            (a crafted checkpoint) is walked in time linear in its size; else it is walked at each.
        tensor_attributes: after a plain tensor or parameter, walk the attributes set on it ("w.scale"),
            which torch.save keeps.
        leaves_once: a leaf object reached by two paths (one tensor, array or float a pickle names many
            times) is yielded at the first only, before its second path is built.

    Returns:
        An iterator of (path, leaf); paths join keys and field names with ".".
    """
    yielded: dict[int, Any] = {}  # leaves_once: the leaves yielded, kept alive so that no id is reused
    for node, leaf in _walk(obj, name_pairs, shared_once, tensor_attributes):
        if leaves_once:
            if id(leaf) in yielded:
                continue
            yielded[id(leaf)] = leaf
        yield _path(node, prefix, brackets), leaf


def leaves(obj: Any, shared_once: bool = False) -> Iterator[Any]:
    """The leaves `named_leaves(obj, shared_once=shared_once)` yields, in the same order, without
    building their paths (for hooks that run at every step and need only the tensors; shared_once for a
    crafted checkpoint's, as named_leaves says)."""
    return (leaf for _, leaf in _walk(obj, False, shared_once, False))


def leaves_with_nodes(obj: Any, shared_once: bool = False) -> Iterator[tuple[_Node, Any]]:
    """`leaves(obj, shared_once)` with each leaf's node, from which `path_steps` gives its path when it is
    needed (a watch names its input's entries only on a bad step): a node holds its keys, not the values."""
    return _walk(obj, False, shared_once, False)


def positions_on(obj: Any, steps: Sequence[tuple[Any, int]]) -> list[tuple[int, Any, list]]:
    """For each list, tuple or deque that `steps` (path_steps of a leaf of `obj`) go through by position,
    outermost first: (the position, the sequence, the other values of the container that holds it; []
    for `obj` itself). Stops at an elided middle."""
    found = []
    node, siblings = obj, []
    for key, how in steps:
        if how == _ELIDED:
            break
        children = _children(node)
        if how == _POSITION:
            found.append((key, node, siblings))
        siblings = [value for k, _, value in children if k != key]
        node = next(value for k, _, value in children if k == key)
    return found


def container_of(obj: Any, node: _Node) -> Optional[tuple[Any, Any]]:
    """The container of `obj` that holds the leaf at `node` (a node of a walk of `obj`), with the leaf's
    key there; None for `obj` itself. Found by the whole path, never an elided one."""
    if node is None:
        return None
    container = obj
    for key, _ in _steps_up(node, node[3])[:0:-1]:
        container = next(value for k, _, value in _children(container) if k == key)
    return container, node[1]


def _steps_up(node: _Node, limit: int) -> list[tuple[Any, int]]:
    """Up to `limit` steps from `node` towards the root, `node`'s first."""
    steps = []
    while node is not None and len(steps) < limit:
        steps.append((node[1], node[2]))
        node = node[0]
    return steps


def path_steps(node: _Node) -> list[tuple[Any, int]]:
    """The steps from the root to `node`, root first: (key, how it names) each; for a path deeper than
    twice _PATH_ENDS, the steps at each end and one for the levels between."""
    if node is None:
        return []
    depth = node[3]
    if depth <= 2 * _PATH_ENDS:
        return _steps_up(node, depth)[::-1]
    middle = (f"<{depth - 2 * _PATH_ENDS}-levels>", _ELIDED)
    return _steps_up(node[4], _PATH_ENDS)[::-1] + [middle] + _steps_up(node, _PATH_ENDS)[::-1]


def path_of(steps: Sequence[tuple[Any, int]], prefix: str = "", brackets: bool = False) -> str:
    """The path of `steps` (path_steps) under `prefix`, written as named_leaves writes it."""
    parts = [key if how == _ELIDED else f".{key}" if how == _KEY or not brackets
             else f"[{key}]" if how == _POSITION else f"{{{key}}}" for key, how in steps]
    path = prefix + "".join(parts)
    return path if prefix else path.removeprefix(".")


def _path(node: _Node, prefix: str, brackets: bool) -> str:
    return path_of(path_steps(node), prefix, brackets)


def _walk(obj: Any, name_pairs: bool, shared_once: bool, tensor_attributes: bool) -> Iterator[tuple[_Node, Any]]:
    """named_leaves, each leaf with its node."""
    # Ids of the containers entered (all of them with shared_once, else those on the current path), with
    # the container: kept alive, so that no id is reused by another object during the walk.
    entered: dict[int, Any] = {}
    paths: dict[int, tuple[Any, int]] = {}  # without shared_once: id -> (container, paths walked so far)
    stack: list[tuple[Any, Any]] = [(None, obj)]  # (node or _LEAVE, value)
    if name_pairs:
        entered[id(obj)] = obj
        stack = [((None, key, how, 1, None), value) for key, how, value in reversed(_pairs(obj))]
    while stack:
        node, value = stack.pop()
        if node is _LEAVE:
            del entered[id(value)]
            continue
        if isinstance(value, torch.Tensor):
            yield node, value
            if not (tensor_attributes and type(value) in _PLAIN_TENSORS and value.__dict__):
                continue
            value = value.__dict__
        elif not is_container(value):
            yield node, value
            continue
        if id(value) in entered:
            continue
        if not shared_once:
            walked = paths.get(id(value), (value, 0))[1]
            if walked >= _PATHS_PER_CONTAINER:
                continue
            paths[id(value)] = (value, walked + 1)
        try:
            children = _children(value)
        except Exception:  # noqa: BLE001  (a container's own code raised: a lying mapping, a list whose iter raises)
            yield node, value  # a leaf that cannot be read: the caller lists it as not checked
            continue
        entered[id(value)] = value
        if not shared_once:
            stack.append((_LEAVE, value))
        # The children's depth and anchor (see _Node), once per container.
        depth, anchor = (1, None) if node is None else (node[3] + 1, node if node[3] == _PATH_ENDS else node[4])
        stack.extend(((node, key, how, depth, anchor), child) for key, how, child in reversed(children))


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
