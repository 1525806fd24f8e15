"""The watch's hook on `GradScaler.step`: one wrapper per scaler, shared by every watch given that scaler,
so that removing the watches in any order puts `scaler.step` back as it was."""

from __future__ import annotations

import types
import weakref
from typing import Any, Protocol


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
            result = shared.original(optimizer, *args, **kwargs)
            for w in watchers:
                w._scaler_step_ended(optimizer)
            return result

        step.nanfast_shared = shared
        scaler.step = types.MethodType(step, scaler)
    shared.watchers.append(watcher)
    return shared


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
