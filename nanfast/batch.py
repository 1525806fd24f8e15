"""Checks of batches: `check_batch(batch)` names the sample index and field of a batch holding
non-finite values; `checked(loader)` checks every batch a loader yields."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch

from ._tree import container_of, group_by_device, leaves_with_nodes, path_of, path_steps
from .batch_samples import bad_samples, list_sample, packed_samples
from .check import READ_LAYOUTS, may_hold_values, naming_entries, stored_values, values_tensor
from ._nested import shape as shape_of
from .ops import any_nonfinite, dispatch_subclass, reads_dtype, stats
from .intended import MASKS, is_additive_mask
from .report import NonfiniteCounts, NonFiniteError, first_few, left_out, not_checked

__all__ = ["BadField", "BatchReport", "Checked", "check_batch", "checked"]

MAX_SAMPLES_IN_MESSAGE = 8


@dataclasses.dataclass(frozen=True)
class BadField(NonfiniteCounts):
    """A tensor of a batch that holds non-finite values, and the samples (indices along its first
    dimension; a nested tensor's components; the sequences of a PackedSequence's data; a field's position in
    a list of samples) that hold them;
    `samples` is empty for a 0-dim tensor. A nested tensor's ragged dimensions are -1 in `shape`."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    nan: int
    posinf: int
    neginf: int
    samples: tuple[int, ...]

    def describe(self) -> str:
        if not self.samples:
            return f"field {self.path!r} ({self.counts_text()})"
        shown = first_few([str(s) for s in self.samples], MAX_SAMPLES_IN_MESSAGE)
        noun = "sample" if len(self.samples) == 1 else "samples"
        return f"{noun} {shown} of field {self.path!r} ({self.counts_text()})"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"], d["samples"] = list(self.shape), list(self.samples)
        return d


@dataclasses.dataclass(frozen=True)
class BatchReport:
    """What check_batch found: the fields holding non-finite values (empty when the batch is clean), the
    fields that are additive masks, whose -inf mask (see NOTE: [Additive masks]; their `samples` are not
    looked for), and the fields that may hold values but could not be read (`unchecked`: an object-dtype
    numpy array, an object of another library), as check_all lists them."""

    bad: tuple[BadField, ...]
    num_tensors: int
    batch_index: Optional[int] = None  # set by `checked`
    masks: tuple[BadField, ...] = ()
    unchecked: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def samples(self) -> list[int]:
        """The indices of the samples holding non-finite values, in any field."""
        return sorted({s for f in self.bad for s in f.samples})

    def summary(self) -> str:
        where = f"batch {self.batch_index}: " if self.batch_index is not None else ""
        if self.num_tensors == 0:  # nothing was looked at: not "all finite" (a batch of strings, the wrong object)
            return f"nanfast: {where}no tensors in the batch: nothing was checked{not_checked(self.unchecked)}"
        if self.ok:
            finite = "its 1 tensor is" if self.num_tensors == 1 else f"all {self.num_tensors} tensors of the batch are"
            if self.masks:
                finite = f"{self.num_tensors - len(self.masks)} of the batch's {self.num_tensors} tensors are"
            return f"nanfast: {where}{finite} finite{self._masks_text()}{not_checked(self.unchecked)}"
        return (f"nanfast: {where}non-finite values in " + "; ".join(f.describe() for f in self.bad)
                + self._masks_text() + not_checked(self.unchecked))

    def _masks_text(self) -> str:
        return left_out(MASKS, [f"field {f.path!r} (-inf={f.neginf})" for f in self.masks])

    __str__ = summary

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "batch_index": self.batch_index, "num_tensors": self.num_tensors,
                "samples": self.samples, "bad": [f.to_dict() for f in self.bad],
                "masks": [f.to_dict() for f in self.masks], "unchecked": list(self.unchecked)}


def _unreadable(t: torch.Tensor) -> Optional[str]:
    """What keeps the kernels from reading a field's samples, or None."""
    if t.is_meta:
        return "a meta tensor (it holds no values)"
    if dispatch_subclass(t):
        return f"a {type(t).__name__} (a tensor subclass)"
    if t.is_quantized:
        return "a quantized tensor (check its .dequantize())"
    if t.layout not in READ_LAYOUTS and not t.is_nested:
        return f"a {t.layout} tensor"
    return None if reads_dtype(t.dtype) else f"of dtype {t.dtype}, which the kernels do not read"


def _validate(pairs: list[tuple[str, torch.Tensor]]) -> None:
    for name, t in pairs:
        what = _unreadable(t)
        if what:
            raise ValueError(f"nanfast.check_batch: field {name!r} is {what}; only strided, sparse and nested "
                             "tensors with values of the dtypes nanfast reads can be checked")


def check_batch(batch: Any, *, raise_on_nonfinite: bool = True) -> BatchReport:
    """Checks every tensor in `batch` (a tensor, or mappings, dataclasses, named tuples, lists, tuples,
    deques and sets of them; a container met twice is walked once; numpy arrays and Python floats are
    read as check_all reads them) and names the fields and samples
    (indices along the first dimension; for a field inside a list of samples, its position there: see
    NOTE: [Samples as list items]) that hold NaN or inf. A clean batch costs one fused check and
    one host sync per device; only a bad one is counted per field and per sample. A field named as a
    mask whose only non-finite values are -inf (an additive attention mask, "tgt_mask") is not bad: it
    is listed in `BatchReport.masks` (a batch holding one costs a second read).

    Args:
        batch: the batch, as a DataLoader yields it.
        raise_on_nonfinite: raise on a batch holding NaN/inf (else return the report).

    Returns:
        A BatchReport: `ok`, the bad fields with their sample indices and counts.

    Raises:
        NonFiniteError: (carrying the BatchReport) something is non-finite and raise_on_nonfinite.
        TypeError: batch is an nn.Module or an optimizer (check_all checks those).
        ValueError: naming the field, if one cannot be read by sample (quantized, meta, or of a
            dtype the kernels do not read)."""
    if isinstance(batch, (torch.nn.Module, torch.optim.Optimizer)):  # its tensors are not a batch's fields
        raise TypeError(f"nanfast.check_batch: got a {type(batch).__name__}, not a batch; check a model or an "
                        "optimizer with nanfast.check_all")
    # numpy arrays (a collator's return_tensors="np") and Python floats too, as check_all reads them.
    pairs, nodes, unchecked = [], [], []
    for node, leaf in leaves_with_nodes(batch, shared_once=True):
        path = path_of(path_steps(node), brackets=True)
        if (t := values_tensor(leaf)) is not None:
            pairs.append((path or "tensor", t))  # a batch that is one tensor: named as check_all names it
            nodes.append(node)
        elif may_hold_values(leaf):  # never "finite" for what was not read
            unchecked.append(path or f"the batch ({type(leaf).__name__})")
    _validate(pairs)
    bad: list[tuple[int, BadField]] = []  # with the field's position, to report in batch order
    masks: list[tuple[int, BadField]] = []
    known_lists: dict = {}  # list_sample's, kept over the fields (the batch, and so the ids, alive)
    for indices in group_by_device([t for _, t in pairs]).values():
        names, tensors = [pairs[i][0] for i in indices], [stored_values(pairs[i][1]) for i in indices]
        # nested tensors are read through their components
        if not bool(naming_entries(any_nonfinite, names, tensors, "nanfast.check_batch")):
            continue
        for i, (nan, posinf, neginf) in zip(indices, stats(tensors).counts.tolist()):
            if nan or posinf or neginf:
                path, t = pairs[i]
                mask = is_additive_mask(path, nan, posinf, neginf)  # see NOTE: [Additive masks]
                sample = None if mask else list_sample(batch, path_steps(nodes[i]), known_lists)
                samples = () if mask else (sample,) if sample is not None else bad_samples(
                    t, packed_samples(path, container_of(batch, nodes[i])))
                (masks if mask else bad).append((i, BadField(path, shape_of(t), str(t.dtype).removeprefix("torch."),
                                                             nan, posinf, neginf, samples)))
    report = BatchReport(tuple(field for _, field in sorted(bad, key=lambda b: b[0])), len(pairs),
                         masks=tuple(field for _, field in sorted(masks, key=lambda b: b[0])),
                         unchecked=tuple(unchecked))
    if raise_on_nonfinite and not report.ok:
        raise NonFiniteError(report)
    return report


CHECKED_ACTIONS = ("raise", "warn", "skip")


class Checked:
    """An iterable over `loader`'s batches that checks each one (see `checked`)."""

    def __init__(self, loader: Iterable, action: str):
        if action not in CHECKED_ACTIONS:
            raise ValueError(f"nanfast.checked: action must be one of {CHECKED_ACTIONS}, got {action!r}")
        self.loader = loader
        self.action = action
        self.bad_batches: list[BatchReport] = []
        self._warned_unchecked = False

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.loader):
            report = dataclasses.replace(check_batch(batch, raise_on_nonfinite=False), batch_index=index)
            if report.unchecked and not self._warned_unchecked:  # a batch class nanfast cannot read: said once
                self._warned_unchecked = True
                warnings.warn(f"nanfast.checked: batch {index}{not_checked(report.unchecked)}; batches of this kind "
                              "pass unchecked (give check_batch their tensors: a dict or dataclass of them)",
                              RuntimeWarning, stacklevel=2)
            if report.ok:
                yield batch
                continue
            self.bad_batches.append(report)
            if self.action == "raise":
                raise NonFiniteError(report)
            if self.action == "warn":
                warnings.warn(report.summary(), RuntimeWarning, stacklevel=2)
                yield batch
            else:  # skip: data dropped is said, as a watch's skipped step is (a loader gone all bad is seen)
                warnings.warn(f"{report.summary()}: skipped the batch", RuntimeWarning, stacklevel=2)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


def checked(loader: Iterable, *, action: str = "raise") -> Checked:
    """Wraps a DataLoader (or any iterable of batches) so that every batch is checked with
    check_batch before it is used. On a batch holding NaN/inf: action="raise" raises NonFiniteError
    naming the batch index, sample index and field; "warn" warns and yields it; "skip" warns and drops it.
    Batches found bad are kept in `.bad_batches`. Costs one host sync per batch and device.

    Args:
        loader: the DataLoader or iterable of batches.
        action: "raise", "warn" or "skip".

    Returns:
        A Checked iterable (len() as the loader's), yielding the loader's batches.

    Raises:
        ValueError: action is not one of the three (raised here); NonFiniteError: while iterating,
            a bad batch with action="raise"."""
    return Checked(loader, action)
