"""Dumps of a reported op's inputs (locate(dump=path)) and `replay`, which runs the op again on them."""

from __future__ import annotations

import os
from typing import Any, Union

import torch

from .schema import _op_info


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
        found = getattr(torch, str(value["memory_format"]), None)
        if not isinstance(found, torch.memory_format):  # a dump names only memory formats here
            raise ValueError(f"nanfast.replay: {value['memory_format']!r} is not a torch memory format")
        return found
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
    """The operator a dump names ("aten.div.Tensor"): only torch.ops' operators, nothing else by name."""
    parts = name.split(".") if isinstance(name, str) else []
    try:
        if len(parts) != 3:
            raise AttributeError
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        raise ValueError(f"nanfast.replay: the dump names {name!r}, which is not an operator of torch.ops "
                         "(namespace.name.overload, as 'aten.div.Tensor')") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise ValueError(f"nanfast.replay: the dump names {name!r}, which is not an operator of torch.ops")
    return op


def replay(path: Union[str, os.PathLike]) -> Any:
    """Loads a dump written by locate(dump=path) (weights_only: it runs no pickled code) and runs the
    op again on the saved inputs.

    Args:
        path: the dump's file.
    Returns:
        The op's outputs; for an in-place op that returns nothing (`_foreach_*_`, `_fused_adam_`), the
        arguments it wrote, as a dict by argument name (the NaN is written there).
    Raises:
        OSError: the file cannot be read; pickle.UnpicklingError: it is no torch.save file, or one that asks
        to run code; ValueError: it is not a locate dump (naming what is missing), or names something
        that is not an operator of torch.ops.
    """
    saved = torch.load(path, weights_only=True)
    if not (isinstance(saved, dict) and isinstance(saved.get("op"), str) and isinstance(saved.get("arguments"), dict)):
        raise ValueError(f"nanfast.replay: {os.fspath(path)!r} is not a dump written by locate(dump=path): it holds no "
                         "'op' name and 'arguments' dict")
    func = _resolve_op(saved["op"])
    arguments = {name: _load_value(v) for name, v in saved["arguments"].items()}
    out = func(**arguments)
    if out is None:
        info = _op_info(func)  # the arguments it writes, as locate reads them
        written = {name: arguments[name] for name in info.arg_names
                   if name in arguments and (name in info.read_write_args or name in info.out_args)}
        if written:
            return written
    return out

