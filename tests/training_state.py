"""Helpers of the framework callbacks' tests: copies of a training state compared bit for bit, and a
count of a model's forward hooks (to see a callback leave none behind)."""

from __future__ import annotations

from typing import Any

import torch


def clone(obj: Any) -> Any:
    """A deep copy of the tensors in nested dicts (a state dict, an optimizer's state)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    return obj


def equal(a: Any, b: Any) -> bool:
    """Whether two such nestings hold the same keys and bit-identical tensors."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return a == b


def hooks_of(model: torch.nn.Module) -> int:
    """The number of forward hooks and pre-hooks on the model's modules."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
