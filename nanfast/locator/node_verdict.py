"""Judging an autograd node by the gradients it returns: locate's findings inside a backward node wait
until the node has returned, and stand only if a returned gradient is non-finite."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["NodeVerdicts"]

# NOTE: [masked inside a node]
# torch's backward formulas often make 0/0 or x/0 on purpose and mask it before returning: norms and
# F.normalize of a zero vector, std of a constant row, atan2(0, 0), cdist(x, x), pow(0, p) with a
# learnable p, p-norms of pruned weights. An op-by-op check sees a producer there; the model is healthy.
# So a finding inside a node is held until the node's post hook sees what it returns: a non-finite
# returned gradient confirms the node's first held finding; otherwise they are notes. AccumulateGrad
# returns nothing (it writes .grad): it is judged per op, at once.
# What the node received is not asked: a held finding is already a producer by the per-op rules, whose
# inputs' non-finite values descend from no finding (propagation is never held), so received non-finite
# gradients can only be infinities from outside, on which inf - inf is a producer as in forward (an
# inf weight's NaN weight gradient). And it could not be asked reliably: the hook is added while the
# node runs, and torch hands such a hook the node's incoming gradients only if the node had a post hook
# before it ran, so the verdict depended on unrelated hooks (a user's on the same node silenced it).
# BackwardHookFunctionBackward passes gradients through unchanged: it exists to run a module's backward
# hooks and pre-hooks (register_full_backward_hook), as its post hooks, where a hook added while they run
# is never called: a NaN a user's hook made was held forever, then noted as masked (a probe, session 44).
# Every op under it is a hook's: judged per op too.
_JUDGED_PER_OP = frozenset(("AccumulateGrad", "BackwardHookFunctionBackward"))


class NodeVerdicts:
    """The findings held per running backward node.

    Args:
        any_nonfinite: whether a list of tensors (any dtype, Nones removed) holds NaN/inf.
        report: called with the held item (a finding and its dump) that a node confirmed, and the
            non-finite gradients the node returned.
        note: called with each held item a node did not confirm.
    """

    def __init__(self, any_nonfinite: Callable[[list[torch.Tensor]], bool], report: Callable[[Any], None],
                 note: Callable[[Any], None]):
        self._any_nonfinite = any_nonfinite
        self._report = report
        self._note = note
        self._pending: dict[int, tuple[list[Any], Any]] = {}  # id(node) -> (items, hook handle)
        self._lock = threading.Lock()  # CUDA backward runs nodes on worker threads

    def defer(self, node: Any, item: Any) -> bool:
        """Holds `item` until `node` returns, to be reported or noted by what it returns.

        Args:
            node: the autograd node running the op.
            item: what to report (or note) once the node is judged.
        Returns:
            True when held; False when the node cannot be judged by what it returns (AccumulateGrad, a
            node without post hooks): the caller reports at once.
        """
        if type(node).__name__ in _JUDGED_PER_OP:
            return False
        with self._lock:
            entry = self._pending.get(id(node))
            if entry is not None:
                entry[0].append(item)
                return True
            items, key = [item], id(node)

            def judge(grad_inputs: tuple, grad_outputs: tuple) -> None:  # holds the key, not the node
                self._judge(key, grad_inputs)

            try:
                handle = node.register_hook(judge)
            except (AttributeError, RuntimeError, TypeError):
                return False
            self._pending[key] = (items, handle)
        return True

    def _judge(self, key: int, grad_inputs: tuple) -> None:
        with self._lock:
            items, handle = self._pending.pop(key)
        handle.remove()  # a retained graph run again is judged again, from scratch
        nonfinite = [g for g in grad_inputs if isinstance(g, torch.Tensor) and self._any_nonfinite([g])]
        for item in items[1:] if nonfinite else items:
            self._note(item)
        if nonfinite:
            self._report(items[0], nonfinite)

    def close(self) -> None:
        """Drops what nodes that never returned (their backward raised) held, as notes."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for items, handle in pending.values():
            handle.remove()
            for item in items:
                self._note(item)
