"""The watch's hook on `GradScaler.step`: one wrapper per scaler, shared by every watch given that scaler,
so that removing the watches in any order puts `scaler.step` back as it was."""

from __future__ import annotations

import types
import weakref
from typing import Any, Protocol

from ..report import NonFiniteError
from .spikes import SpikeError


class ScalerWatcher(Protocol):
    def _scaler_step_begins(self) -> None: ...

    def _scaler_step_ended(self, optimizer: Any) -> None: ...


class _Shared:
    """The watches on one scaler, and the `step` attribute it had before the first of them."""

    def __init__(self, scaler: Any):
        self.had_step = "step" in vars(scaler)
        self.saved = vars(scaler).get("step")
        self.original = scaler.step
        self.scaler = weakref.ref(scaler)
        self.watchers: list[ScalerWatcher] = []


def _shared(scaler: Any) -> Any:
    step = vars(scaler).get("step")
    return getattr(getattr(step, "__func__", None), "nanfast_shared", None)


def attach(scaler: Any, watcher: ScalerWatcher) -> _Shared:
    """Wraps `scaler.step` (once per scaler) so that `watcher` hears each call begin and end.

    Returns:
        The handle to give detach()."""
    shared = _shared(scaler)
    if shared is None:
        shared = _Shared(scaler)

        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if scaler is not shared.scaler():
                # A copy (copy.deepcopy rebinds the method to it): not watched, its own step, not the
                # watched scaler's (a deep-copied scaler stepped the original: a probe, session 44).
                return type(scaler).step(scaler, optimizer, *args, **kwargs)
            watchers = list(shared.watchers)
            for w in watchers:
                w._scaler_step_begins()
            handed = [name for name in _HANDED_TO_FUSED if name not in vars(optimizer)]
            try:
                result = shared.original(optimizer, *args, **kwargs)
                for w in watchers:
                    w._scaler_step_ended(optimizer)
            except BaseException as error:
                _ready_for_next_step(scaler, optimizer, handed, watch_raised=isinstance(error, (NonFiniteError, SpikeError)))
                raise
            return result

        step.nanfast_shared = shared
        scaler.step = types.MethodType(step, scaler)
    shared.watchers.append(watcher)
    return shared


# NOTE: [A watch raising inside GradScaler.step]
# A watch with action="raise" raises from the optimizer step that GradScaler.step calls, or, when the
# scaler skips the step, right after it. Either way scaler.update() never runs, and the scaler keeps its
# state for this iteration: after a step it skipped, its next step() refused ("step() has already been
# called since the last update()"); after an optimizer step the watch stopped, its next step() took the
# gradients as already unscaled and applied them multiplied by the scale (1024 times the update, a
# probe, session 45), where a caught error should leave training as the step found it. So before the
# error leaves scaler.step, the scaler's state for the iteration is cleared as update() clears it,
# at the scale it had: update(new_scale=) sets the scale without growing or backing it off. One host
# read, on a path that raises. The same for a spike's raise (SpikeError). A fused optimizer is handed the
# scale and the overflow flag as attributes (optimizer.grad_scale, optimizer.found_inf), which
# GradScaler.step deletes after optimizer.step() returns: left there, the next step() multiplied its
# scale by the stale one, and the next healthy update came out divided by the scale squared (1024x too
# small; a probe, session 47). They go whatever the exception (a callable action's own, too). A late
# loss (NOTE: [A loss passed after its step]) read between scaler.step() and scaler.update() raises from
# Watch.loss with the iteration stepped: it is ended the same way (a probe, session 48).
_HANDED_TO_FUSED = ("grad_scale", "found_inf")


def _ready_for_next_step(scaler: Any, optimizer: Any, handed: list[str], watch_raised: bool) -> None:
    for name in handed:
        vars(optimizer).pop(name, None)
    if watch_raised:
        end_iteration(scaler)


def end_iteration(scaler: Any) -> None:
    """Clears the scaler's state for an iteration it began (scaled gradients unscaled or stepped) and
    that update() has not ended, as update() clears it, at the scale it has (NOTE: [A watch raising
    inside GradScaler.step]; also a late loss's raise between scaler.step() and scaler.update()). None
    begun: nothing to do (update() would raise)."""
    if scaler.is_enabled() and getattr(scaler, "_per_optimizer_states", None):
        scaler.update(new_scale=scaler.get_scale())


def detach(scaler: Any, shared: _Shared, watcher: ScalerWatcher) -> None:
    """Undoes attach(); the last watcher to go restores `scaler.step` exactly. (If something else
    wrapped `scaler.step` after the watch did, the watch's wrapper stays under it, passing calls on.)"""
    shared.watchers.remove(watcher)
    if shared.watchers or _shared(scaler) is not shared:
        return
    if shared.had_step:
        scaler.step = shared.saved
    else:
        del scaler.step
