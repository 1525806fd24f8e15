"""What a check found: `Entry` (one tensor), `Report` (a checked collection) and `NonFiniteError`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Optional

from .intended import MASKS, SENTINELS, is_additive_mask, is_sentinel

MAX_NAMED_IN_MESSAGE = 20


def first_few(texts: Sequence[str], limit: int, sep: str = ", ") -> str:
    """The first `limit` of `texts` joined by `sep`, and how many more there are: "a, b and 3 more", or
    with sep "; ", "a; b; and 3 more" (every message that names a few of many says it this way)."""
    more = len(texts) - limit
    tail = f"{';' if sep == '; ' else ''} and {more} more" if more > 0 else ""
    return sep.join(texts[:limit]) + tail


def left_out(kind: str, named: Sequence[str]) -> str:
    """"; left out, as KIND: NAME (-inf=6), ..." naming entries listed apart as intended infinities
    (nanfast/intended.py), or "" for none.

    Args:
        kind: intended.MASKS or intended.SENTINELS.
        named: each entry's name with its counts."""
    return f"; left out, as {kind}: {first_few(named, MAX_NAMED_IN_MESSAGE)}" if named else ""


def not_checked(names: Sequence[str]) -> str:
    """"; not checked (objects nanfast cannot read): NAME, ..." naming objects that may hold values but
    could not be read (a check_all Report's and a BatchReport's `unchecked`), or "" for none."""
    return f"; not checked (objects nanfast cannot read): {first_few(names, MAX_NAMED_IN_MESSAGE)}" if names else ""


class NonfiniteCounts:
    """What a record with ``nan``, ``posinf`` and ``neginf`` fields says about them (Entry, the batch
    check's BadField, the watch's Place)."""

    __slots__ = ()
    nan: int
    posinf: int
    neginf: int

    @property
    def nonfinite(self) -> int:
        """NaN + inf + -inf."""
        return self.nan + self.posinf + self.neginf

    def counts_text(self) -> str:
        """Returns:
            The counts in words: "nan=N, +inf=P, -inf=M"."""
        return f"nan={self.nan}, +inf={self.posinf}, -inf={self.neginf}"


@dataclasses.dataclass(frozen=True)
class Entry(NonfiniteCounts):
    """One checked tensor, with its counts read back to the host (a nested tensor's ragged
    dimensions are -1 in `shape`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    nan: int
    posinf: int
    neginf: int
    norm: float
    absmax: float

    def to_dict(self) -> dict[str, Any]:
        """Returns:
            The fields as JSON-serialisable values (shape as a list)."""
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclasses.dataclass(frozen=True)
class Report:
    """The result of `nanfast.check_all`: every checked tensor as an `Entry`, in input order, and the
    names of the objects found that may hold values but could not be read (`unchecked`: objects of
    types nanfast does not know, numpy arrays torch cannot take): `ok` speaks only for the entries.
    Infinities stored on purpose are listed apart, not in `bad`: additive masks in `masks`, a score's
    initial infinity in `sentinels` (nanfast/intended.py)."""

    entries: tuple[Entry, ...]
    unchecked: tuple[str, ...] = ()
    # Whether intended infinities (additive masks, score sentinels: nanfast/intended.py) are listed apart
    # in `masks` and `sentinels` rather than in `bad`; False for gradients.
    intended: bool = True

    def _mask(self, e: Entry) -> bool:
        return self.intended and is_additive_mask(e.name, e.nan, e.posinf, e.neginf)

    def _sentinel(self, e: Entry) -> bool:
        return self.intended and is_sentinel(e.name, e.numel, e.nan, e.posinf, e.neginf)

    @property
    def masks(self) -> list[Entry]:
        """The additive masks among the entries (see NOTE: [Additive masks]): not `bad`."""
        return [e for e in self.entries if self._mask(e)]

    @property
    def sentinels(self) -> list[Entry]:
        """The entries that are a score's initial infinity (see NOTE: [Sentinel infinities]): not `bad`."""
        return [e for e in self.entries if self._sentinel(e)]

    @property
    def bad(self) -> list[Entry]:
        """The entries that hold at least one NaN or infinity (intended infinities left out)."""
        return [e for e in self.entries if e.nonfinite and not (self._mask(e) or self._sentinel(e))]

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def norms(self) -> dict[str, float]:
        """L2 norm of the finite elements, by name."""
        return {e.name: e.norm for e in self.entries}

    @property
    def total_norm(self) -> float:
        """L2 norm of the finite elements of all tensors (as torch's clip_grad_norm_ computes it)."""
        return math.hypot(*(e.norm for e in self.entries))

    @property
    def num_tensors(self) -> int:
        return len(self.entries)

    @property
    def num_elements(self) -> int:
        return sum(e.numel for e in self.entries)

    def summary(self) -> str:
        """Returns:
            One line: how many tensors are bad, and which (the first MAX_NAMED_IN_MESSAGE)."""
        bad = self.bad
        if not self.entries:  # nothing was looked at: not "all finite" (e.g. grads=True before a backward)
            return f"no tensors found: nothing was checked{self._unchecked_text()}"
        tensors = "tensor" if self.num_tensors == 1 else "tensors"
        if not bad:
            finite = "the 1 tensor is finite" if self.num_tensors == 1 else f"all {self.num_tensors} tensors are finite"
            apart = len(self.masks) + len(self.sentinels)
            if apart:
                finite = f"{self.num_tensors - apart} of {self.num_tensors} {tensors} are finite"
            return f"{finite} ({self.num_elements:,} elements){self.intended_text()}{self._unchecked_text()}"
        named = first_few([f"{e.name} {list(e.shape)} ({e.counts_text()})" for e in bad], MAX_NAMED_IN_MESSAGE, "; ")
        return (f"non-finite values in {len(bad)} of {self.num_tensors} {tensors}: {named}{self.intended_text()}"
                f"{self._unchecked_text()}")

    def intended_text(self) -> str:
        """Returns:
            "; left out, as additive masks ...: NAME (-inf=N), ..." and the same for score sentinels,
            naming the intended infinities listed apart; "" without any."""
        return (left_out(MASKS, [f"{e.name} (-inf={e.neginf})" for e in self.masks])
                + left_out(SENTINELS, [f"{e.name} ({'+inf' if e.posinf else '-inf'})" for e in self.sentinels]))

    def _unchecked_text(self) -> str:
        return not_checked(self.unchecked)

    def __str__(self) -> str:
        bad = self.bad
        head = (self.summary() if not bad else
                f"{len(bad)} of {self.num_tensors} tensors hold non-finite values{self.intended_text()}"
                f"{self._unchecked_text()}")
        lines = [f"nanfast: {head} | total norm {self.total_norm:.6g}"]
        if bad:
            rows = [(e.name, str(tuple(e.shape)), e.dtype, e.device, str(e.nan), str(e.posinf), str(e.neginf))
                    for e in bad]
            header = ("name", "shape", "dtype", "device", "nan", "+inf", "-inf")
            widths = [max(len(r[k]) for r in rows + [header]) for k in range(len(header))]
            for r in [header] + rows:
                lines.append("  ".join(c.ljust(w) if k < 4 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Returns:
            The report as JSON-serialisable values (json.dumps writes a non-finite norm as NaN/Infinity)."""
        return {
            "ok": self.ok,
            "num_tensors": self.num_tensors,
            "num_elements": self.num_elements,
            "total_norm": self.total_norm,
            "bad": [e.to_dict() for e in self.bad],
            "masks": [e.to_dict() for e in self.masks],
            "sentinels": [e.to_dict() for e in self.sentinels],
            "norms": self.norms,
            "unchecked": list(self.unchecked),
        }


class NonFiniteError(FloatingPointError):
    """Raised when a check finds NaN or infinity. `.report` holds what was found: a `Report`, or the
    richer record of the tool that raised it (a watch `Event`, a `locate` finding).

    Args:
        report: what was found (its ``summary()`` is the message unless `message` is given).
        message: the message, when the report's summary is not the whole story."""

    def __init__(self, report: Any, message: Optional[str] = None):
        self.report = report
        if message is None:
            message = report.summary() if hasattr(report, "summary") else str(report)
        super().__init__(message)
