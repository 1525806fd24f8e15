"""A step's closure run ahead of the watch's step pre-hook (see NOTE: [Lightning's closure]), and the
closure that then stands in for it."""

from __future__ import annotations

from typing import Any, Optional

import torch


class RanClosure:
    """A closure that already ran (run_closure_first ran it before the watch's step pre-hook): returns its
    result, so that step() still returns it; the watch does not take it for a forward and backward yet to
    run.

    Args:
        result: what the closure returned."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result

    def __call__(self) -> Any:
        return self.result


def runs_closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the watch runs `optimizer`'s step closures ahead of its step pre-hook: torch's own
    optimizers, which call a closure once, first thing in step(), but LBFGS, which calls it many times.
    Others may not (SAM's step perturbs the weights before it calls the closure)."""
    module = type(optimizer).__module__  # "torch.optim" itself for Adafactor and Muon
    return (module == "torch.optim" or module.startswith("torch.optim.")) and not isinstance(optimizer, torch.optim.LBFGS)


def run_closure_first(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """A step pre-hook: runs the step's closure now and passes the step on with one that returns its result.

    NOTE: [Lightning's closure]
    Lightning steps `optimizer.step(closure=...)`, the closure running training_step, backward,
    on_before_optimizer_step and gradient clipping. A torch optimizer calls it inside step(), after the
    step pre-hooks, so the watch would read the step before its forward ran (and refuses to skip such a
    step). Every torch optimizer but LBFGS calls the closure once, first thing in step(), under
    enable_grad: running it here, before the watch's pre-hook, and handing step() a closure that only
    returns what it returned (a `RanClosure`, which the watch does not take for a forward yet to
    run), changes nothing else. The watch sees a complete step, as in a plain loop, and step() still
    returns the closure's loss (manual optimization reads it: `loss = opt.step(closure=closure)`).
    Every watch registers it for torch's own optimizers (`runs_closure_first`): a plain loop's
    `optimizer.step(closure)`, and Lightning's manual optimization, whose `opt.step()` hands the torch
    optimizer a closure that runs no forward (a watch made in a LightningModule with action="skip"
    refused every step: a probe, session 47). The Lightning callback registers it for any other
    optimizer but LBFGS.

    Args:
        optimizer: the optimizer being stepped.
        args: step()'s positional arguments, the optimizer first.
        kwargs: step()'s keyword arguments.

    Returns:
        None when there is no closure; else step()'s arguments with the closure that already ran."""
    if kwargs.get("closure") is not None:
        closure = kwargs["closure"]
    elif len(args) > 1 and args[1] is not None:
        closure, args = args[1], args[:1] + args[2:]
    else:
        return None
    if isinstance(closure, RanClosure):
        return None
    with torch.enable_grad():
        result = closure()
    return args, {**kwargs, "closure": RanClosure(result)}
