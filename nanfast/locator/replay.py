"""Dumps of a reported op's inputs (locate(dump=path)) and `replay`, which runs the op again on them."""

from __future__ import annotations

import os
from typing import Any, Union

import torch

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
    op again on the saved inputs.

    Args:
        path: the dump's file.
    Returns:
        The op's outputs.
    Raises:
        OSError: the file cannot be read; pickle.UnpicklingError: it is not a locate dump.
    """
    saved = torch.load(path, weights_only=True)
    func = _resolve_op(saved["op"])
    arguments = {name: _load_value(v) for name, v in saved["arguments"].items()}
    return func(**arguments)

