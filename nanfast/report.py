"""What a check found: `Entry` (one tensor), `Report` (a checked collection) and `NonFiniteError`."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any, Optional

MAX_NAMED_IN_MESSAGE = 20


def first_few(texts: Sequence[str], limit: int, sep: str = ", ") -> str:
    """The first `limit` of `texts` joined by `sep`, and how many more there are: "a, b and 3 more", or
    with sep "; ", "a; b; and 3 more" (every message that names a few of many says it this way)."""
    more = len(texts) - limit
    tail = f"{';' if sep == '; ' else ''} and {more} more" if more > 0 else ""
    return sep.join(texts[:limit]) + tail


# NOTE: [Additive masks]
# An additive attention mask holds 0 where a position is attended and -inf where it is masked:
# torch.nn.Transformer.generate_square_subsequent_mask makes one, PyTorch's translation tutorial passes
# it to the model's forward (pytorch/tutorials, beginner_source/translation_transformer.py), and many
# GPT-style models keep one as a buffer (register_buffer("mask", torch.triu(torch.full((T, T),
# float("-inf")), 1))). Its -inf are the mask, not a fault: a check that called them non-finite stopped
# a healthy model at its first step, failed every checkpoint holding one, and dropped every batch with
# one. So an entry named as a mask (its name ends in "mask", then any [i] indices: attention_mask,
# src_mask, tgt_mask, key_padding_mask, model.mask, masks[0] does not) whose only non-finite values are
# -inf is listed apart as a mask, not as bad. A NaN or +inf in it is reported as anywhere else; a mask
# that masks a whole row makes NaN in the softmax after it, which is found there. Gradients are never
# masks. Where: the watch's input, check_all (not with grads=True), check_batch and the scans.
_MASK_NAME = re.compile(r".*mask(\[\d+\])*", re.IGNORECASE)


def is_additive_mask(name: str, nan: int, posinf: int, neginf: int) -> bool:
    """Whether counts of the entry `name` are those of an additive mask (see NOTE: [Additive masks]):
    the name ends in "mask" (then any [i] indices) and its only non-finite values are -inf."""
    return neginf > 0 and nan == 0 and posinf == 0 and is_mask_name(name)


def is_mask_name(name: str) -> bool:
    """Whether `name` names a mask (see NOTE: [Additive masks]), whatever it holds."""
    return _MASK_NAME.fullmatch(name) is not None


def masks_clause(named: Sequence[str], finite: int, total: str) -> str:
    """How a clean check with additive masks in it says so: "3 of 4 tensors are finite and 1 is an
    additive mask (-inf where it masks): NAME (-inf=6)"; `named`: each mask with its count, `total`: "4
    tensors" as the check words it."""
    one = len(named) == 1
    what = "1 is an additive mask" if one else f"{len(named)} are additive masks"
    return (f"{finite} of {total} are finite and {what} (-inf where {'it masks' if one else 'they mask'}): "
            f"{first_few(named, MAX_NAMED_IN_MESSAGE)}")


def masks_left_out(named: Sequence[str]) -> str:
    """"; left out, as additive masks (-inf where they mask): NAME (-inf=6), ...", or "" for no mask."""
    return f"; left out, as additive masks (-inf where they mask): {first_few(named, MAX_NAMED_IN_MESSAGE)}" if named else ""


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
    With `masks_allowed`, entries that are additive masks (-inf where they mask: see NOTE: [Additive
    masks]) are listed in `masks`, not in `bad`."""

    entries: tuple[Entry, ...]
    unchecked: tuple[str, ...] = ()
    masks_allowed: bool = True

    def _is_mask(self, e: Entry) -> bool:
        return self.masks_allowed and is_additive_mask(e.name, e.nan, e.posinf, e.neginf)

    @property
    def masks(self) -> list[Entry]:
        """The additive masks among the entries: their -inf are masking, so they are not `bad`."""
        return [e for e in self.entries if self._is_mask(e)]

    @property
    def bad(self) -> list[Entry]:
        """The entries that hold at least one NaN or infinity (additive masks left out)."""
        return [e for e in self.entries if e.nonfinite and not self._is_mask(e)]

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
            if self.masks:
                finite = masks_clause(self._mask_names(), self.num_tensors - len(self.masks), f"{self.num_tensors} tensors")
            return f"{finite} ({self.num_elements:,} elements){self._unchecked_text()}"
        named = first_few([f"{e.name} {list(e.shape)} ({e.counts_text()})" for e in bad], MAX_NAMED_IN_MESSAGE, "; ")
        return (f"non-finite values in {len(bad)} of {self.num_tensors} {tensors}: {named}{self.masks_text()}"
                f"{self._unchecked_text()}")

    def masks_text(self) -> str:
        """Returns:
            "; left out, as additive masks ...: NAME (-inf=N), ..." naming the masks, or "" without any."""
        return masks_left_out(self._mask_names())

    def _mask_names(self) -> list[str]:
        return [f"{e.name} (-inf={e.neginf})" for e in self.masks]

    def _unchecked_text(self) -> str:
        if not self.unchecked:
            return ""
        return f"; not checked (objects nanfast cannot read): {first_few(self.unchecked, MAX_NAMED_IN_MESSAGE)}"

    def __str__(self) -> str:
        bad = self.bad
        head = (self.summary() if not bad else
                f"{len(bad)} of {self.num_tensors} tensors hold non-finite values{self.masks_text()}"
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
