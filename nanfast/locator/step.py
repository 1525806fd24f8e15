"""Re-running one training step under `locate`: the state it starts from (StepState) and
`locate_step`, which restores it, re-runs the step and puts everything back."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch

from .findings import LocateFinding
from .region import locate


def _tensors_of(target: Union[torch.nn.Module, Iterable[torch.Tensor], None]) -> tuple[list, list]:
    if target is None:
        return [], []
    if isinstance(target, torch.nn.Module):
        return list(target.parameters()), list(target.buffers())
    return list(target), []


@dataclasses.dataclass
class StepState:
    """The state a training step starts from: RNG states (CPU and initialized CUDA devices) and,
    optionally, copies of parameter and buffer values and of gradients.

    Capture it before a step's forward (with the defaults it copies only the RNG states: a few KB);
    `locate_step` restores it to run the step again."""

    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    cpu_rng: torch.Tensor
    cuda_rng: Optional[list[torch.Tensor]]
    values: Optional[list[torch.Tensor]]  # copies of params + buffers
    grads: Optional[list[Optional[torch.Tensor]]]  # copies of params' .grad

    @classmethod
    def capture(cls, target: Union[torch.nn.Module, Iterable[torch.Tensor], None] = None, *,
                values: bool = False, grads: bool = False) -> StepState:
        """`target`: a module (its parameters and buffers) or parameters. values=True copies their
        values: needed only when the step to re-run has already updated them (a watch that skips bad
        steps leaves them as they were). grads=True copies their grads, for a step that accumulates onto
        grads of earlier micro-batches; without it the re-run starts from no grads.

        Args:
            target: a module or an iterable of parameters, or None for the RNG states alone.
            values: copy their values.
            grads: copy their grads.
        Returns:
            The captured state.
        """
        params, buffers = _tensors_of(target)
        return cls._capture(params, buffers, values, grads)

    @classmethod
    def _capture(cls, params: list, buffers: list, values: bool, grads: bool) -> StepState:
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        with torch.no_grad():
            copies = [t.detach().clone() for t in params + buffers] if values else None
            grad_copies = [None if p.grad is None else p.grad.detach().clone() for p in params] if grads else None
        return cls(params, buffers, torch.get_rng_state(), cuda_rng, copies, grad_copies)

    def restore(self) -> None:
        """Puts back the RNG states and, where captured, the values; sets grads to the captured ones
        (None when grads were not captured)."""
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            if self.values is not None:
                for t, saved in zip(self.params + self.buffers, self.values):
                    t.copy_(saved)
            grads = self.grads if self.grads is not None else [None] * len(self.params)
            for p, saved in zip(self.params, grads):
                p.grad = None if saved is None else saved.clone()


def locate_step(step_fn: Callable[[], Any], before: StepState, *,
                dump: Optional[Union[str, os.PathLike]] = None) -> Optional[LocateFinding]:
    """Runs `step_fn` (one step's forward and backward on the same batch, no optimizer step) again
    under locate(action="record"), from the state `before` was captured in, and returns the first
    finding (None if the re-run stayed finite: the fault did not reproduce).

    The re-run leaves no trace: the parameters, buffers and grads `before` covers, and the RNG states,
    are put back as they were when locate_step was called (so training continues bit-identically).

    Args:
        step_fn: runs the step's forward and backward.
        before: the state captured before the step first ran.
        dump: where to save the first reported op's inputs (see `locate`).
    Returns:
        The first LocateFinding, or None.
    Raises:
        Whatever step_fn raises (the state is put back first).
    """
    after = StepState._capture(before.params, before.buffers, values=True, grads=True)
    before.restore()
    region = locate(action="record", dump=dump)
    try:
        with region:
            step_fn()
    finally:
        after.restore()
    return region.finding
