"""Forward findings off the gradient path: a non-finite value that a training step computes on the side
(indices, targets, masks: nothing requiring grad) is reported once it reaches what matters, not where it
was made."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch

from ..recompute import in_reentrant_first_forward

__all__ = ["OffPath", "OffPathFindings"]

# NOTE: [off the gradient path]
# Models compute values on the side of the gradient path that hold inf by design and are thrown away:
# T5's relative position buckets take log(0) on the diagonal, cast the -inf to an integer and drop it
# with a where() (transformers' modeling_t5.py, copied into mt5, longt5, switch_transformers, ...);
# torchvision's Faster R-CNN encodes the regression targets of an image without boxes as log(0) and
# reads only the positive rows. Judged op by op, locate stopped every healthy step of those models
# (a probe, session 43). So in a region with a gradient path (an op has read a tensor that requires
# grad, in grad mode), a forward producer or scalar finding whose op reads no such tensor is held, and
# its outputs are tainted with it (NOTE: [producer or propagation]) rather than with True. (Inside the
# dispatch mode, below autograd, an op's outputs do not require grad yet: its inputs tell.) It is
# reported when a value it tainted matters:
#   - an op that propagates it reads a tensor that requires grad (it enters the gradient path);
#   - it is read to the host (item(), bool(): aten._local_scalar_dense);
#   - the region ends normally while a storage it tainted is still alive (kept, returned: the caller
#     will see it).
# Otherwise (every tainted value was dropped: cast to an integer, not selected, freed) it is a note in
# `.masked`, as a masked backward finding is. Under no_grad (inference) every finding is reported at its
# op, as before: there is no gradient path to be off. A finding in grad mode before any op has read a
# tensor that requires grad is held too: a frozen encoder runs its whole forward before the first
# trained parameter is read, and T5's log(0) there stopped every healthy step of a T5 whose encoder was
# frozen (a probe, session 52). If the region ends without ever reading one (ops on plain tensors in grad
# mode), nothing was off a gradient path: its held findings are all reported then, as at their ops.


class OffPath:
    """One held finding and weak references to the storages of the values it tainted."""

    __slots__ = ("item", "storages", "settled")

    def __init__(self, item: Any):
        self.item = item
        self.storages: list[weakref.ref] = []
        self.settled = False

    def follow(self, outputs: list[torch.Tensor]) -> None:
        """Adds the storages of tensors whose non-finite values this finding tainted."""
        self.storages += [weakref.ref(t.untyped_storage()) for t in outputs]

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.storages)


class OffPathFindings:
    """The held forward findings of one locate region.

    Args:
        report: called with a held item once a value it tainted matters.
        note: called with a held item that never mattered.
    """

    def __init__(self, report: Callable[[Any], None], note: Callable[[Any], None]):
        self._report = report
        self._note = note
        self._held: list[OffPath] = []
        self._keeping: Optional[OffPath] = None  # the held finding that keeps its copy (see hold())
        self.graph_seen = False  # an op of the region read a tensor requiring grad, in grad mode

    def saw(self, on_path: bool) -> None:
        """Notes an op of the region (`on_path`: it reads a tensor requiring grad, in grad mode)."""
        self.graph_seen = self.graph_seen or on_path

    def holds(self, kind: str, phase: str, on_path: bool) -> bool:
        """Whether a finding is held: a forward producer or scalar off the gradient path (an op that, in
        grad mode, reads no tensor requiring grad; whether the region has a gradient path at all is
        judged when it ends: see close()). A forward that activation checkpointing runs again in
        backward ("recompute"), or runs first under no_grad (use_reentrant=True), is such a forward too:
        T5's relative-position log(0), held without checkpointing, stopped every checkpointed T5 step (a
        probe, session 44)."""
        return (phase in ("forward", "recompute") and kind in ("producer", "scalar")
                and not on_path  # an optimizer's update (no_grad) is reported at its op
                and (torch.is_grad_enabled() or in_reentrant_first_forward()))

    def hold(self, item: tuple[Any, Any]) -> OffPath:
        """Holds `item` (a finding and the copy of its op's inputs for a dump, or None). One held item at a
        time keeps its copy: with `dump=`, each of 100 held log(0) kept 4 MB until the region ended (a
        probe, session 44); a later one reported first is reported without its dump."""
        keeping = self._keeping is not None and not self._keeping.settled
        held = OffPath((item[0], None) if keeping else item)
        if item[1] is not None and not keeping:
            self._keeping = held
        self._held.append(held)
        return held

    def matters(self, held: OffPath) -> None:
        """A value `held` tainted matters: its finding is reported (once)."""
        self.settle(held, report=True)

    def settle(self, held: OffPath, report: bool) -> None:
        """Reports (`report`) or notes `held`, unless a value it tainted has already mattered."""
        if not held.settled:
            self._settle(held, self._report if report else self._note)

    def _settle(self, held: OffPath, act: Callable[[Any], None]) -> None:
        """Reports or notes `held`, then lets go of its copy (the storages it tainted still point at it)."""
        held.settled = True
        item, held.item = held.item, (held.item[0], None)
        act(item)

    def close(self, report_alive: bool) -> None:
        """The region ends: a finding whose values are still alive is reported (`report_alive`: the region
        ended normally), the others are notes; in a region that never read a tensor requiring grad,
        every one is reported."""
        held, self._held = self._held, []
        for h in held:
            self.settle(h, report=not self.graph_seen or (report_alive and h.alive()))
