"""Whether a watch event and the locate finding attached to it name the same place, and, when they do
not, why: watch sees values where it checks them (module outputs, gradients, parameters), locate the op
that made them."""

from __future__ import annotations

import inspect
import os
from typing import Any, Optional

import torch

__all__ = ["disagreement"]

# Phases whose place names a module (by qualified name) or a parameter (module path + "." + its name).
_MODULE_PHASES = ("forward", "backward", "loss")
_PARAMETER_PHASES = ("grad", "param", "buffer")


def _module_of(model: torch.nn.Module, phase: str, name: str) -> Optional[torch.nn.Module]:
    if phase in _PARAMETER_PHASES:
        name = name.rpartition(".")[0]
    elif phase not in _MODULE_PHASES:
        return None
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _forward_lines(module: torch.nn.Module) -> Optional[tuple[str, int, int]]:
    try:
        lines, first = inspect.getsourcelines(type(module).forward)
        filename = inspect.getsourcefile(type(module).forward)
    except (OSError, TypeError):
        return None
    return (os.path.abspath(filename), first, first + len(lines) - 1) if filename else None


def _ran_inside(module: torch.nn.Module, filename: str, lineno: int) -> bool:
    """Whether the line lies in the forward of the module or of one of its submodules."""
    path = os.path.abspath(filename)
    for sub in module.modules():
        span = _forward_lines(sub)
        if span is not None and span[0] == path and span[1] <= lineno <= span[2]:
            return True
    return False


def disagreement(model: torch.nn.Module, phase: str, name: str, where: str, finding: Any) -> Optional[str]:
    """Why a watch event's first place and its locate finding differ, or None when they agree (the
    finding's user line runs in the forward of the event's module, or of a submodule of it) or the
    event names no module (dirty input, a value passed to Watch.loss).

    Args:
        model: the watched model.
        phase: the event's first place's phase (watch.PHASES).
        name: its name (a module's qualified name, or a parameter's).
        where: its description in words (Place.where()).
        finding: the LocateFinding attached to the event.

    Returns:
        A sentence for the event's summary, or None.
    """
    module = _module_of(model, phase, name)
    line = finding.forward_source if finding.phase == "backward" else finding.source
    if module is None or line is None or _ran_inside(module, line.filename, line.lineno):
        return None
    made = f"backward of {finding.node} (forward at {line})" if finding.phase == "backward" else f"{line}"
    return (f"the places differ: watch names the {where}, the first place its checks (module outputs, "
            f"gradients, parameters) saw the values; locate names the op that made them, in {made}, "
            f"outside that module's forward")
