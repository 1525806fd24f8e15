"""Helpers of the framework callbacks' tests: copies of a training state compared bit for bit, faults
that make an activation or the parameters non-finite, and a count of a model's forward hooks (to see a callback leave
none behind)."""

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


def state_of(model: torch.nn.Module, optimizer: Any) -> tuple:
    """A copy of the training state: the model's state dict and the optimizer's per-parameter state."""
    return clone(model.state_dict()), clone(optimizer.state_dict()["state"])


def equal(a: Any, b: Any) -> bool:
    """Whether two such nestings hold the same keys and bit-identical tensors."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def hooks_of(model: torch.nn.Module) -> int:
    """The number of forward hooks and pre-hooks on the model's modules."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


FAULTS = ("nan_weight", "huge_lr")


def break_parameters(fault: str, model: torch.nn.Module, optimizer: Any, weight: str) -> None:
    """Makes the parameters non-finite as a corrupted update would: "nan_weight" writes NaN into one
    element of the parameter `weight` now; "huge_lr" sets every param group's lr to inf, so the next
    optimizer step writes +/-inf (NaN where the update is 0) into every parameter (the caller puts the
    lr back after that step, or the trainer's LR scheduler does)."""
    if fault == "nan_weight":
        with torch.no_grad():
            model.get_parameter(weight).view(-1)[0] = float("nan")
    else:
        for group in optimizer.param_groups:
            group["lr"] = float("inf")


def plant_inf(model: torch.nn.Module, submodule: str, at_forward: int) -> None:
    """Multiplies `submodule`'s output (a tuple's first tensor: transformers 4's blocks return tuples) by
    inf in the `at_forward`-th training forward (1-based, counting microbatches): finite values become
    +/-inf there, and NaN downstream."""
    seen = {"forwards": 0}

    def hook(module, args, output):
        if module.training and torch.is_grad_enabled():
            seen["forwards"] += 1
            if seen["forwards"] == at_forward:
                if isinstance(output, tuple):
                    return (output[0] * float("inf"), *output[1:])
                return output * float("inf")

    model.get_submodule(submodule).register_forward_hook(hook)
