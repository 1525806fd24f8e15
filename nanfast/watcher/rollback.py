"""action="rollback": snapshots of the training state (parameters, optimizer state, module buffers), taken
every N steps once the watch's checks proved the parameters finite and copied without blocking to a chosen
device, put back in place when a step finds the parameters themselves non-finite. See NOTE: [Rolling
back]."""

from __future__ import annotations

import copy
from typing import Any, Callable, NamedTuple, Optional

import torch

from .restore import BufferUndo, Twins

# NOTE: [Rolling back]
# A skip keeps the state a bad step found; once the parameters themselves are non-finite (an update
# wrote them: a huge step, a NaN in a moment), no skip can repair them. A rollback puts back a snapshot
# of a state the watch proved good: the state in which a checked step s began (its parameters, read by
# that step's fused pass and found finite; the optimizer state and the module buffers as the step found
# them, the buffers from BufferUndo's copies of the step's start).
# * When: at the end of a checked step, before the optimizer applies it, every `rollback_every` steps
#   since the last snapshot. An eager watch knows the step's verdict then: a proven snapshot is copied
#   straight over the previous one (one copy in memory). A lagged watch learns it one step later: the
#   snapshot waits as pending and becomes the confirmed one when the next step's end finds its read
#   evaluated without a rollback (reads are evaluated in order); a read that finds the parameters bad
#   drops it. So a lagged watch holds two copies.
# * How: Twins packs the tensors in one flat tensor per (device, dtype), with one copy call per
#   group, non_blocking: a CUDA tensor's copy lands in pinned host memory, enqueued on the stream before
#   the optimizer's in-place update, so it reads the values as they were and the host never waits; the
#   restore is enqueued after it the same way. Nothing is read on the host: no sync is added.
# * Restore: in place, into the same tensor objects (the optimizer's references and the user's stay
#   valid); optimizer state created after the snapshot is dropped (a parameter without state then gets
#   it back at its next step, as on a first step). The step that rolls back is skipped (its gradients
#   come from the bad parameters); in a lagged watch the read of the step in flight was computed from
#   them too, and is dropped (`stale`).
# * Defaults: every 100 steps, in host memory. A snapshot reads and writes the parameters and the
#   optimizer state (Adam: three times the parameters' bytes), two to three times what the step's fused
#   pass reads: at every step it would cost more than the rest of the watch; 100 steps apart it is 2-3%
#   of that pass per step, and a rollback loses at most about 100 steps of progress, far less than a
#   restart from the last checkpoint. Host memory, since the accelerator's is what training lacks.

# NOTE: [Parameters added after a snapshot]
# A snapshot holds the parameters the optimizer had when it was taken. One added later (a head
# with add_param_group, layers unfrozen into a new group) has no value in it, so a rollback to it
# would leave that parameter as the bad step found it (non-finite: the same rollback at every
# step, forever). A changed list makes a snapshot due at once (the next checked step whose
# parameters prove finite), and a rollback with a parameter the snapshot lacks is refused.


class _Snapshot(NamedTuple):
    """The state in which step `step` began: the values of `params`, of the optimizer `state` (per
    parameter: None without state, else (key, index of its tensor in the twins or -1, value if not a
    tensor)) and of `buffers` ((module, name)), all in `twins`, in that order."""

    step: int
    params: list
    state: list
    buffers: list
    twins: Twins


def _fits(t: Any, kind: tuple) -> bool:
    return isinstance(t, torch.Tensor) and (t.shape, t.device, t.dtype) == kind and t.layout == torch.strided


class Rollback:
    """A watch's snapshots for action="rollback" (see NOTE: [Rolling back]): the confirmed one (proven
    finite), the pending one (a lagged watch, until its step's read), and the storage of a dropped or
    superseded one, kept for reuse."""

    def __init__(self, optimizer: torch.optim.Optimizer, undo: BufferUndo, every: int, device: torch.device,
                 any_rank: Callable[[bool], bool] = bool):
        self.optimizer = optimizer
        self._any_rank = any_rank  # over the ranks that must agree (NOTE: [Decisions that only one rank can see])
        self.every = every
        self.device = device
        self._undo = undo
        self._confirmed: Optional[_Snapshot] = None
        self._pending: Optional[_Snapshot] = None
        self._spare: Optional[Twins] = None
        self._bad_step = -1  # the step of the last rollback's read
        self._blocked_through = -1  # and the last step ended when it happened

    @property
    def nbytes(self) -> int:
        """The bytes the snapshots hold on their device."""
        twins = [s.twins for s in (self._confirmed, self._pending) if s is not None] + [self._spare]
        return sum(t.nbytes for t in twins if t is not None)

    def due(self, step: int) -> bool:
        """Whether a snapshot is due at the end of `step` (its pass must then read the parameters): every
        `every` steps, and at once when the optimizer's parameters are no longer the snapshot's."""
        latest = self._pending or self._confirmed
        return step > self._blocked_through and (latest is None or step - latest.step >= self.every
                                                 or self._regrouped(latest))

    def _params(self) -> list:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @property
    def latest_step(self) -> Optional[int]:
        """The step of the newest snapshot, proven or pending; None before the first."""
        latest = self._pending or self._confirmed
        return None if latest is None else latest.step

    def _regrouped(self, snapshot: _Snapshot) -> bool:
        """Whether the optimizer's parameters are no longer `snapshot`'s (NOTE: [Parameters added after a
        snapshot])."""
        params = self._params()
        return len(params) != len(snapshot.params) or any(p is not q for p, q in zip(params, snapshot.params))

    def step_ended(self, step: int, proven: bool) -> None:
        """At the end of checked step `step`, before the optimizer applies it: takes a snapshot of the
        state the step began with if one is due.

        Args:
            step: the step that ended.
            proven: its read has been evaluated (eager): it found the parameters finite, else a rollback
                would have happened. False: the read is still in flight (lagged)."""
        if step <= self._blocked_through:
            return  # a rollback just put back an older state
        if self._pending is not None:
            self._promote()  # its read came before this step's end and rolled nothing back
        if self._confirmed is not None and step - self._confirmed.step < self.every \
                and not self._regrouped(self._confirmed):
            return
        buffers = self._undo.as_found()
        if self._any_rank(buffers is None):
            return  # a buffer's value at the step's start is unknown (on some rank): wait for a step that knows it
        if proven:
            self._confirmed = self._capture(step, buffers, self._confirmed.twins if self._confirmed else None)
        else:
            self._pending, self._spare = self._capture(step, buffers, self._spare), None

    def roll_back(self, bad_step: int, now: int) -> tuple[Optional[int], list]:
        """Puts back the newest snapshot proven finite, in place, because the read of `bad_step` found
        the parameters non-finite.

        Args:
            bad_step: the step whose read found them.
            now: the last step ended (reads of steps after bad_step up to it are now `stale`).

        Returns:
            The step whose starting state was put back, None if nothing was; and the optimizer's
            parameters that snapshot lacks (see NOTE: [Parameters added after a snapshot]): when there
            are any, nothing is put back. (None, []): no snapshot was proven yet."""
        if self._pending is not None:
            if self._pending.step < bad_step:
                self._promote()
            else:  # it holds the bad parameters
                self._spare, self._pending = self._pending.twins, None
        snapshot = self._confirmed
        if snapshot is None:
            return None, []
        held = {id(p) for p in snapshot.params}
        added = [p for p in self._params() if id(p) not in held]
        if added:
            return None, added
        self._bad_step, self._blocked_through = bad_step, now
        self._restore(snapshot)
        return snapshot.step, []

    def stale(self, step: int) -> bool:
        """Whether the read of `step` was computed from parameters a rollback has since replaced."""
        return self._bad_step < step <= self._blocked_through

    def _promote(self) -> None:
        if self._confirmed is not None:
            self._spare = self._confirmed.twins
        self._confirmed, self._pending = self._pending, None

    def _capture(self, step: int, buffers: list, reuse: Optional[Twins]) -> _Snapshot:
        params = self._params()
        sources = list(params)
        state: list = []
        for p in params:
            entry = self.optimizer.state.get(p)
            if not entry:
                state.append(None)
                continue
            items = []
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                    items.append((key, len(sources), None))
                    sources.append(value)
                else:  # a sparse one too (SGD's momentum for a sparse gradient): a twin holds dense tensors
                    items.append((key, -1, copy.deepcopy(value)))
            state.append(items)
        sources += [t for _, _, t in buffers]
        twins = reuse if reuse is not None and reuse.fits(sources) else Twins(sources, self.device)
        with torch.no_grad():
            twins.save(sources)
        return _Snapshot(step, params, state, [(module, name) for module, name, _ in buffers], twins)

    def _restore(self, snapshot: _Snapshot) -> None:
        """Copies the snapshot back into the live tensors (in place where they still fit; state the
        optimizer created since is dropped, keys it added removed)."""
        kinds = snapshot.twins.kinds
        targets = list(snapshot.params)
        for p, items in zip(snapshot.params, snapshot.state):
            if items is None:
                self.optimizer.state.pop(p, None)
                continue
            live = self.optimizer.state[p]
            for key in [k for k in live if k not in {key for key, _, _ in items}]:
                del live[key]
            for key, index, value in items:
                if index < 0:
                    live[key] = copy.deepcopy(value)
                    continue
                if not _fits(live.get(key), kinds[index]):
                    live[key] = _empty(kinds[index])
                targets.append(live[key])
        for module, name in snapshot.buffers:
            kind = kinds[len(targets)]
            if not _fits(module._buffers.get(name), kind):
                module._buffers[name] = _empty(kind)
            targets.append(module._buffers[name])
        with torch.no_grad():
            snapshot.twins.restore(targets)


def _empty(kind: tuple) -> torch.Tensor:
    shape, device, dtype = kind
    return torch.empty(shape, device=device, dtype=dtype)
