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
    """(parameters, buffer slots): a module's parameters and (module, name) of each of its buffers."""
    if target is None:
        return [], []
    if isinstance(target, torch.nn.Module):
        slots = [(module, name) for module in target.modules() for name, b in module._buffers.items() if b is not None]
        return list(target.parameters()), slots
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
    # Where each buffer lives, (module, name): a buffer re-assigned by a forward (self.ema = 0.9 * self.ema
    # + ...) is put back there, not only copied into the tensor captured.
    buffer_slots: list[tuple[torch.nn.Module, str]] = dataclasses.field(default_factory=list)
    grad_tensors: list[Optional[torch.Tensor]] = dataclasses.field(default_factory=list)  # params' .grad objects

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
        params, slots = _tensors_of(target)
        return cls._capture(params, slots, values, grads)

    @classmethod
    def _capture(cls, params: list, slots: list, values: bool, grads: bool) -> StepState:
        buffers = [module._buffers[name] for module, name in slots]
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        with torch.no_grad():
            copies = [t.detach().clone() for t in params + buffers] if values else None
            grad_copies = [None if p.grad is None else p.grad.detach().clone() for p in params] if grads else None
        # The gradient tensors are kept only where their values are: held otherwise, a watch's state taken
        # at a step's end kept that step's gradients alive through the next one (a review, session 46).
        return cls(params, buffers, torch.get_rng_state(), cuda_rng, copies, grad_copies, slots,
                   [p.grad for p in params] if grads else [None] * len(params))

    def restore(self) -> None:
        """Puts back the RNG states, the buffers in their modules and, where captured, the values; sets
        grads to the captured ones (None when grads were not captured), in the gradient tensors the
        parameters had (DDP's gradient_as_bucket_view keeps views of them)."""
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        for (module, name), t in zip(self.buffer_slots, self.buffers):
            if module._buffers.get(name) is not t:
                module._buffers[name] = t
        with torch.no_grad():
            if self.values is not None:
                for t, saved in zip(self.params + self.buffers, self.values):
                    t.copy_(saved)
            grads = self.grads if self.grads is not None else [None] * len(self.params)
            for p, tensor, saved in zip(self.params, self.grad_tensors, grads):
                if saved is None:
                    p.grad = None
                elif tensor is not None and tensor.shape == saved.shape and tensor.dtype == saved.dtype:
                    p.grad = tensor.copy_(saved)
                else:
                    p.grad = saved.clone()


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
    after = StepState._capture(before.params, before.buffer_slots, values=True, grads=True)
    before.restore()
    region = locate(action="record", dump=dump)
    try:
        with region:
            step_fn()
    finally:
        after.restore()
    return region.finding
