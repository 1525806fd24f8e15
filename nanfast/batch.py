"""Checks of batches: `check_batch(batch)` names the sample index and field of a batch holding
non-finite values; `checked(loader)` checks every batch a loader yields."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional

import torch
from torch.nn.utils.rnn import PackedSequence

from ._tree import container_of, group_by_device, leaves_with_nodes, path_of, path_steps, positions_on
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


def _packed_samples(path: str, held: Optional[tuple[Any, Any]]) -> Optional[torch.Tensor]:
    """For the `data` of a PackedSequence (its rows ordered by time step, then by sequence), the sample
    each row belongs to (int64, one per row); None for any other field. `held`: the field's container
    and its key there (container_of).

    named_leaves walks a PackedSequence as the named tuple it is: its data's rows are not samples, so a
    row index named as one pointed at the wrong sample. Its `batch_sizes` (sequences at each time step)
    and `sorted_indices` (the sample of each position, None when the sequences came sorted) tell. Only a
    real PackedSequence is read so: a record that merely has `data` and `batch_sizes` fields has samples
    along its rows (a probe, session 49)."""
    if held is None or held[1] != "data" or not isinstance(held[0], PackedSequence):
        return None
    packed = held[0]
    rows = packed.data.shape[0] if packed.data.dim() else 0
    sizes, order = _index_vector(packed.batch_sizes), _index_vector(packed.sorted_indices)
    described = (sizes is not None and sizes.numel() > 0 and bool((sizes >= 1).all())
                 and bool((sizes[1:] <= sizes[:-1]).all()) and int(sizes.sum()) == rows)
    if described and packed.sorted_indices is not None:
        described = (order is not None and order.numel() == int(sizes[0])
                     and bool((order.sort().values == torch.arange(order.numel())).all()))
    if not described:  # not what torch.nn.utils.rnn packs: its rows' samples cannot be told
        raise ValueError(f"nanfast.check_batch: field {path!r} is the data of a PackedSequence whose batch_sizes "
                         f"and sorted_indices do not describe its {rows} rows (batch_sizes must be positive, "
                         "non-increasing and sum to the rows; sorted_indices a permutation of the sequences)")
    positions = torch.arange(rows) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)
    return positions if order is None else order[positions]


def _index_vector(value: Any) -> Optional[torch.Tensor]:
    """`value` as a 1-D int64 tensor on the CPU, or None if it is not a 1-D integer tensor."""
    if (not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype.is_floating_point
            or value.dtype.is_complex or value.dtype == torch.bool):
        return None
    return value.cpu().long()


# NOTE: [Samples as list items]
# A detection batch is a list of images and a list of target dicts, one of each per sample (torchvision's
# detection models and collate_fn=lambda b: tuple(zip(*b)); the labels of a DETR batch beside its
# batched pixel_values), where each tensor's first dimension is a channel or a box: named as samples, a
# NaN box of image 1 was "sample 0 of field 'targets[1].boxes'" (a probe, session 45). A batch collated
# by default is a list of batched tensors instead ([x, y]), whose positions are fields, and a loader of
# several loaders (Lightning's CombinedLoader) yields a list of batches, each a dict of batched tensors.
# So a field is in the sample of its position in a list or tuple only where the batch shows that list
# to hold samples: a list of records (dicts or dataclasses), or of tensors, beside a list of the same
# length or beside a tensor with one row per entry, or a list beside such a list of records; entries
# whose tensors all have one number of rows look batched and are not taken for samples (a review, session 45: a detection
# batch whose images all hold as many boxes falls back to rows too). Elsewhere, as before, a sample is
# an index along the field's first dimension.
def _list_sample(batch: Any, steps: list) -> Optional[int]:
    """The sample a field belongs to by its position in a list of samples (see the NOTE), or None."""
    for position, sequence, siblings in positions_on(batch, steps):
        if _sequence(sequence) and any(_pair_of_samples(sequence, s) for s in siblings):
            return position
    return None


def _pair_of_samples(sequence: Any, sibling: Any) -> bool:
    """Whether `sequence` and `sibling`, side by side in a batch, show `sequence` to hold one entry per
    sample (see NOTE: [Samples as list items])."""
    if isinstance(sibling, torch.Tensor):
        return _sample_records(sequence) and sibling.dim() > 0 and sibling.shape[0] == len(sequence)
    return (_sequence(sibling) and len(sibling) == len(sequence)
            and (_sample_records(sequence) or _sample_records(sibling)))


def _sample_records(value: Any) -> bool:
    """Whether `value` is a list or tuple of records (or of tensors) that may each be one sample's: two or
    more whose tensors all have one number of rows look like batches (a default-collated ((inputs,
    extras), labels) of batch size 2: two dicts of 2-row tensors beside 2 labels; lists of batches side
    by side; [x, y] beside 2 labels), where one sample's boxes, labels or time steps vary in number from
    sample to sample (variable-length sequences a collate_fn leaves in a list: a NaN at time step 4 of
    sequence 1 was "sample 4 of field 'seqs[1]'", a probe, session 50)."""
    if _sequence(value) and all(isinstance(v, torch.Tensor) for v in value):
        tensors = value
    elif _records(value):
        tensors = [t for record in value for t in (record.values() if isinstance(record, Mapping) else vars(record).values())
                   if isinstance(t, torch.Tensor)]
    else:
        return False
    rows = {t.shape[0] if t.dim() else None for t in tensors}
    return len(value) < 2 or len(rows) != 1 or None in rows


def _sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and not hasattr(type(value), "_fields") and len(value) > 0


def _records(value: Any) -> bool:
    """Whether `value` is a list or tuple of dicts or dataclass instances."""
    return _sequence(value) and all(isinstance(v, Mapping) or (dataclasses.is_dataclass(v) and not isinstance(v, type))
                                    for v in value)


def _bad_samples(t: torch.Tensor, samples: Optional[torch.Tensor] = None) -> tuple[int, ...]:
    """The indices along `t`'s first dimension of the samples holding non-finite values; with `samples`
    (the sample of each row: a PackedSequence's data), those samples, sorted."""
    if t.is_nested:  # its samples are its components, each of its own shape
        return tuple(i for i, part in enumerate(t.detach().unbind()) if bool(any_nonfinite(part)))
    if t.dim() == 0 or t.shape[0] == 0:
        return ()
    if t.layout != torch.strided:  # sparse: the rows of the values holding NaN or inf, as the tensor sums them
        coo = (t if t.layout == torch.sparse_coo else t.to_sparse_coo()).detach().coalesce()
        return tuple(coo._indices()[0][_rows_holding_nonfinite(coo._values())].unique().tolist())
    # NOTE: [A bad field's samples in bounded memory]
    # The samples are found by reductions over the non-batch dims of this (bad) field: linear in its size,
    # and few ops whatever the batch size (one view per sample made millions of tensors for a long 1-D
    # field). Over the whole field at once, its mask took the memory of its logical size: a 2-byte
    # [nan].expand(2**15, 2**15) took 5 GB, a 256 MB float8 field 3 GB, read in float32 (a probe, session
    # 45). So dimensions a broadcast repeats (stride 0) are read once, and rows are read in chunks of at
    # most _CHUNK_ELEMENTS elements.
    for d in range(t.dim() - 1, 0, -1):
        if t.stride(d) == 0:
            t = t.narrow(d, 0, 1)
    if t.stride(0) == 0:  # one row for every sample
        rows = torch.arange(t.shape[0]) if _rows_holding_nonfinite(t[:1]).numel() else torch.empty(0, dtype=torch.long)
    else:
        step = max(1, _CHUNK_ELEMENTS // max(1, t[0].numel()))
        rows = torch.cat([start + _rows_holding_nonfinite(t[start:start + step]) for start in range(0, t.shape[0], step)])
    return tuple(rows.tolist() if samples is None else samples[rows].unique().tolist())


_CHUNK_ELEMENTS = 1 << 24


def _rows_holding_nonfinite(t: torch.Tensor) -> torch.Tensor:
    """The indices (int64, on the CPU) along t's first dimension of the rows holding NaN or inf."""
    try:
        # torch.isfinite calls every float8_e8m0fnu value finite, its NaN (0xFF) too: one-byte floats are
        # read in float32, exactly.
        finite = torch.isfinite(t.float() if t.is_floating_point() and t.element_size() == 1 else t)
    except (RuntimeError, NotImplementedError):  # kinds isfinite lacks: exact in float32
        finite = torch.isfinite(t.float())
    return (~finite.reshape(t.shape[0], -1).all(dim=1)).nonzero().flatten().cpu()


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
    pairs, nodes, steps, unchecked = [], [], [], []
    for node, leaf in leaves_with_nodes(batch, shared_once=True):
        path = path_of(leaf_steps := path_steps(node), brackets=True)
        if (t := values_tensor(leaf)) is not None:
            pairs.append((path or "tensor", t))  # a batch that is one tensor: named as check_all names it
            nodes.append(node)
            steps.append(leaf_steps)
        elif may_hold_values(leaf):  # never "finite" for what was not read
            unchecked.append(path or f"the batch ({type(leaf).__name__})")
    _validate(pairs)
    bad: list[tuple[int, BadField]] = []  # with the field's position, to report in batch order
    masks: list[tuple[int, BadField]] = []
    for indices in group_by_device([t for _, t in pairs]).values():
        names, tensors = [pairs[i][0] for i in indices], [stored_values(pairs[i][1]) for i in indices]
        # nested tensors are read through their components
        if not bool(naming_entries(any_nonfinite, names, tensors, "nanfast.check_batch")):
            continue
        for i, (nan, posinf, neginf) in zip(indices, stats(tensors).counts.tolist()):
            if nan or posinf or neginf:
                path, t = pairs[i]
                mask = is_additive_mask(path, nan, posinf, neginf)  # see NOTE: [Additive masks]
                sample = None if mask else _list_sample(batch, steps[i])
                samples = () if mask else (sample,) if sample is not None else _bad_samples(
                    t, _packed_samples(path, container_of(batch, nodes[i])))
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
