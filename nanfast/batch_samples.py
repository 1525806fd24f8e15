"""The samples of a batch field that holds NaN or inf, for check_batch: a field's position in a list of
samples (NOTE: [Samples as list items]), a PackedSequence's sequences, a nested tensor's components, a
sparse tensor's rows, or else the rows along its first dimension."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.nn.utils.rnn import PackedSequence

from ._tree import named_leaves, positions_on
from .ops import any_nonfinite


def packed_samples(path: str, held: Optional[tuple[Any, Any]]) -> Optional[torch.Tensor]:
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
# whose tensors all have one number of rows look batched and are not taken for samples (a review, session 45),
# unless that number differs from the batch size their sibling shows (a [B] tensor's rows, or a list's
# entries' rows): batched fields side by side share one batch size, so two sequences of 5 steps beside 2
# labels, or images of 3 channels beside targets of 1 box each, are samples (their time step, channel or
# box was named as the sample: a probe, session 52). Only entries whose rows equal the batch size stay
# ambiguous, and are taken for batched fields. A list needs no sibling where it is a plain list of a
# dataset's samples (collate_fn=lambda b: b), where the channel or the box was named as the sample (a
# probe, session 53): entries of one layout (their leaves' paths, and which leaves are tensors), one of
# which shows what one sample holds and a batch does not: tensors of different numbers of rows, or a
# 0-dim tensor, a Python number or a string beside a tensor with rows (an image's 3 channels beside
# its boxes, its label or its file name: torchvision's datasets give (image, int)).
# The batches of a CombinedLoader share their batch's size inside each; images beside targets
# (tuple(zip(*b))) differ in layout. Elsewhere, as before, a sample is an index along the field's first
# dimension.
def list_sample(batch: Any, steps: list, known: dict) -> Optional[int]:
    """The sample a field belongs to by its position in a list of samples (see the NOTE), or None.
    `known`: id of a list -> whether it is a list of a dataset's samples, kept over one batch's fields."""
    for position, sequence, siblings in positions_on(batch, steps):
        if not _sequence(sequence):
            continue
        if id(sequence) not in known:
            known[id(sequence)] = _dataset_samples(sequence)
        if known[id(sequence)] or any(_pair_of_samples(sequence, s) for s in siblings):
            return position
    return None


def _dataset_samples(sequence: Any) -> bool:
    """Whether `sequence` is a plain list of a dataset's samples (see the NOTE)."""
    layout, one_samples = None, False
    for entry in sequence:
        if isinstance(entry, torch.Tensor):
            return False
        items = list(named_leaves(entry))
        entry_layout = [(path, isinstance(leaf, torch.Tensor)) for path, leaf in items]
        if layout not in (None, entry_layout):
            return False
        layout = entry_layout
        rows = {_rows(leaf) for _, leaf in items if _tensor_or_scalar(leaf)}
        one_samples = one_samples or len(rows) > 1
    return one_samples


def _tensor_or_scalar(leaf: Any) -> bool:
    return isinstance(leaf, (torch.Tensor, int, float, str)) and not isinstance(leaf, bool)


def _rows(leaf: Any) -> Optional[int]:
    """A tensor's number of rows; None for a 0-dim tensor, a Python number or a string (a sample's label
    or file name as the dataset gives it: default_collate makes labels a [B] tensor, names a list)."""
    return leaf.shape[0] if isinstance(leaf, torch.Tensor) and leaf.dim() else None


def _pair_of_samples(sequence: Any, sibling: Any) -> bool:
    """Whether `sequence` and `sibling`, side by side in a batch, show `sequence` to hold one entry per
    sample (see NOTE: [Samples as list items])."""
    if isinstance(sibling, torch.Tensor):
        return (sibling.dim() > 0 and sibling.shape[0] == len(sequence)
                and (_sample_records(sequence) or _row_counts(sequence) not in (None, {sibling.shape[0]})))
    if not (_sequence(sibling) and len(sibling) == len(sequence)):
        return False
    rows, sibling_rows = _row_counts(sequence), _row_counts(sibling)
    return (_sample_records(sequence) or _sample_records(sibling)
            or (rows is not None and sibling_rows is not None and rows != sibling_rows))


def _row_counts(value: Any) -> Optional[set]:
    """The numbers of rows (None for a 0-dim tensor) of the tensors of a list or tuple of tensors or of
    records; None for another value."""
    if _sequence(value) and all(isinstance(v, torch.Tensor) for v in value):
        tensors = value
    elif _records(value):
        tensors = [t for record in value for t in (record.values() if isinstance(record, Mapping) else vars(record).values())
                   if isinstance(t, torch.Tensor)]
    else:
        return None
    return {_rows(t) for t in tensors}


def _sample_records(value: Any) -> bool:
    """Whether `value` is a list or tuple of records (or of tensors) that may each be one sample's: two or
    more whose tensors all have one number of rows look like batches (a default-collated ((inputs,
    extras), labels) of batch size 2: two dicts of 2-row tensors beside 2 labels; lists of batches side
    by side; [x, y] beside 2 labels), where one sample's boxes, labels or time steps vary in number from
    sample to sample (variable-length sequences a collate_fn leaves in a list: a NaN at time step 4 of
    sequence 1 was "sample 4 of field 'seqs[1]'", a probe, session 50)."""
    rows = _row_counts(value)
    return rows is not None and (len(value) < 2 or len(rows) != 1 or None in rows)


def _sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and not hasattr(type(value), "_fields") and len(value) > 0


def _records(value: Any) -> bool:
    """Whether `value` is a list or tuple of dicts or dataclass instances."""
    return _sequence(value) and all(isinstance(v, Mapping) or (dataclasses.is_dataclass(v) and not isinstance(v, type))
                                    for v in value)


def bad_samples(t: torch.Tensor, samples: Optional[torch.Tensor] = None) -> tuple[int, ...]:
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
