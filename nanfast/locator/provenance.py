"""Provenance: which op under a locate region last wrote each storage, whether it wrote all of it
(NOTE: [partial writes]) and whether its non-finite values descend from a finding."""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch

from .findings import Producer
from .values import _counts

# NOTE: [provenance on storages]
# The op that last wrote a storage is kept on the storage's Python object (torch keeps that object, and
# so the attribute, as long as the storage lives): views and saved tensors share it, nothing is kept
# alive by it, and no weak-reference callback runs when a storage dies (a dictionary of weak references
# cost more than the rest of the per-op work). Each locate region has its own token, so records of an
# earlier region are not taken for this one's. A record is (token, producer, partial, tainted).
#
# NOTE: [partial writes]
# An in-place (or out=) write to a view that covers only part of a storage made outside the region
# (`x[:, 0] = 0`, `x[:, :2] /= 255` on a batch) leaves the rest of it from outside: the record says
# `partial`, and NaN its consumers read still counts as from outside. A write that covers the whole
# storage (x.copy_(y), x.zero_()) makes it the region's. Covering is decided by size alone, O(1): a
# tensor written in place has no overlapping elements, so numel * element_size == nbytes means every
# byte. When a partial write itself leaves NaN in its view (the slow path: the op was examined), the
# rest of the storage is counted once: if it holds no NaN, every NaN in the storage is the region's.

_PRODUCER_ATTR = "_nanfast_producer"
_region_tokens = itertools.count()
# The producer recorded for a tensor from outside once it has been reported as kind "input".
_OUTSIDE = Producer("(outside locate)", "forward", None, None)


class Provenance:
    """The records of one locate region (its own token), read and written on storages."""

    def __init__(self) -> None:
        self.token = next(_region_tokens)

    def record(self, t: torch.Tensor) -> Optional[tuple]:
        """The record this region left on t's storage.

        Args:
            t: any tensor.
        Returns:
            (token, producer, partial, tainted), or None when no op of this region wrote the storage.
        """
        record = getattr(t.untyped_storage(), _PRODUCER_ATTR, None)
        return record if record is not None and record[0] == self.token else None

    def from_outside(self, t: torch.Tensor) -> bool:
        """Whether t's storage holds values from outside the region (see NOTE: [partial writes]).

        Args:
            t: any tensor.
        Returns:
            True when no op of the region wrote the storage, or one wrote only part of it.
        """
        record = self.record(t)
        return record is None or record[2]

    def tainted(self, t: torch.Tensor) -> Any:
        """Whether t's non-finite values descend from a finding (see NOTE: [producer or propagation]).

        Args:
            t: any tensor.
        Returns:
            The `tainted` value of the region's record (True, or the OffPath of a held finding: NOTE:
            [off the gradient path]), False without one.
        """
        record = self.record(t)
        return record[3] if record is not None else False

    def set_producer(self, t: torch.Tensor, producer: Producer) -> None:
        """Records `producer` as having written all of t's storage, tainted (it was reported).

        Args:
            t: the tensor whose storage is marked.
            producer: the op to name as its writer.
        """
        setattr(t.untyped_storage(), _PRODUCER_ATTR, (self.token, producer, False, True))

    def record_outputs(self, outputs: list[torch.Tensor], producer: Producer, tainted: Any) -> None:
        """Records `producer` on the storages of an op's freshly made outputs (all of each).

        Args:
            outputs: the op's checked outputs.
            producer: the op that made them.
            tainted: whether their non-finite values descend from a finding.
        """
        record = (self.token, producer, False, tainted)
        for t in outputs:
            setattr(t.untyped_storage(), _PRODUCER_ATTR, record)

    def retaint(self, t: torch.Tensor, taint: Any) -> None:
        """Marks the non-finite values this region recorded on t's storage as descending from `taint`.

        Args:
            t: a tensor an op of the region wrote.
            taint: the new `tainted` value (an OffPath: NOTE: [a backward finding masked downstream]).
        """
        record = self.record(t)
        if record is not None:
            setattr(t.untyped_storage(), _PRODUCER_ATTR, record[:3] + (taint,))

    def record_write(self, t: torch.Tensor, producer: Producer, nonfinite: bool, tainted: Any) -> None:
        """Records an in-place or out= write of `producer` to t, partial when t covers only part of a
        storage from outside (see NOTE: [partial writes]).

        Args:
            t: the written tensor (a view that overlaps no element of itself).
            producer: the op that wrote it.
            nonfinite: whether the op's outputs hold NaN/inf (then NaN beside the view is counted).
            tainted: whether those values descend from a finding.
        """
        storage = t.untyped_storage()
        covers = t.numel() * t.element_size() >= storage.nbytes()
        previous = self.record(t)
        partial = not covers and (previous is None or previous[2])
        if partial and nonfinite and not _nan_beside(t, storage):
            partial = False  # every NaN in the storage is in the view this op wrote
        # The rest of a storage written in part keeps what it held: values that descend from a finding
        # (an RNN's output buffer, step 0's inf, then finite rows) stay tainted for its consumers.
        tainted = tainted or (not covers and previous is not None and previous[3])
        setattr(storage, _PRODUCER_ATTR, (self.token, producer, partial, tainted))


def _nan_beside(t: torch.Tensor, storage: torch.UntypedStorage) -> bool:
    """Whether the storage holds NaN outside the view t (which overlaps no element of itself)."""
    whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
    (whole_nan, _, _), (view_nan, _, _) = _counts([whole, t])
    return whole_nan > view_nan

