"""Scans for NaN/inf in data and files.

`check_batch(batch)` names the sample index and field of a batch holding non-finite values;
`checked(loader)` checks every batch a loader yields. `python -m nanfast scan FILE...` checks
checkpoints (.pt/.pth/.bin, .safetensors) without running pickled code: exit code 0 clean,
1 non-finite values found, 2 an input could not be read (or was refused)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional

import torch

from .check import check_all
from .report import Entry, NonFiniteError, Report

__all__ = ["BadField", "BatchReport", "Checked", "FileScan", "check_batch", "checked", "scan_file"]

MAX_SAMPLES_IN_MESSAGE = 8


def named_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in nested mappings, dataclasses, named tuples, lists and tuples, with their paths:
    keys and fields joined with '.', sequence positions as [i] ("inputs.image", "[1]", "pair[0].x").
    Other leaves (strings, numbers, None) hold no values to check and are skipped."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from named_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from named_leaves(getattr(obj, field.name), f"{prefix}.{field.name}" if prefix else field.name)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        for name, value in zip(obj._fields, obj):
            yield from named_leaves(value, f"{prefix}.{name}" if prefix else name)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from named_leaves(value, f"{prefix}[{i}]")


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BadField:
    """A tensor of a batch that holds non-finite values, and the samples (indices along its first
    dimension) that hold them; `samples` is empty for a 0-dim tensor."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    nan: int
    posinf: int
    neginf: int
    samples: tuple[int, ...]

    def counts_text(self) -> str:
        return f"nan={self.nan}, +inf={self.posinf}, -inf={self.neginf}"

    def describe(self) -> str:
        if not self.samples:
            return f"field {self.path!r} ({self.counts_text()})"
        shown = ", ".join(map(str, self.samples[:MAX_SAMPLES_IN_MESSAGE]))
        more = f" and {len(self.samples) - MAX_SAMPLES_IN_MESSAGE} more" if len(self.samples) > MAX_SAMPLES_IN_MESSAGE else ""
        noun = "sample" if len(self.samples) == 1 else "samples"
        return f"{noun} {shown}{more} of field {self.path!r} ({self.counts_text()})"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"], d["samples"] = list(self.shape), list(self.samples)
        return d


@dataclasses.dataclass(frozen=True)
class BatchReport:
    """What check_batch found: the fields holding non-finite values (empty when the batch is clean)."""

    bad: tuple[BadField, ...]
    num_tensors: int
    batch_index: Optional[int] = None  # set by `checked`

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def samples(self) -> list[int]:
        """The indices of the samples holding non-finite values, in any field."""
        return sorted({s for f in self.bad for s in f.samples})

    def summary(self) -> str:
        where = f"batch {self.batch_index}: " if self.batch_index is not None else ""
        if self.ok:
            return f"nanfast: {where}all {self.num_tensors} tensors of the batch are finite"
        return f"nanfast: {where}non-finite values in " + "; ".join(f.describe() for f in self.bad)

    __str__ = summary

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "batch_index": self.batch_index, "num_tensors": self.num_tensors,
                "samples": self.samples, "bad": [f.to_dict() for f in self.bad]}


def _by_device(pairs: list[tuple[str, torch.Tensor]]) -> dict[torch.device, list[int]]:
    groups: dict[torch.device, list[int]] = {}
    for i, (name, t) in enumerate(pairs):
        if t.layout != torch.strided or t.is_meta:
            raise ValueError(f"nanfast.check_batch: field {name!r} is a {t.layout} {'meta ' if t.is_meta else ''}"
                             "tensor; only strided tensors with values can be checked")
        groups.setdefault(t.device, []).append(i)
    return groups


def _bad_samples(t: torch.Tensor) -> tuple[int, ...]:
    if t.dim() == 0 or t.shape[0] == 0:
        return ()
    # One fused pass over the per-sample views.
    counts = torch.ops.nanfast.stats(list(t.unbind(0)))[0]
    return tuple(counts.sum(dim=1).nonzero().flatten().tolist())


def check_batch(batch: Any, *, raise_on_nonfinite: bool = True) -> BatchReport:
    """Checks every tensor in `batch` (a tensor, or mappings, dataclasses, named tuples, lists and
    tuples of them) and names the fields and samples (indices along the first dimension) that hold
    NaN or inf. A clean batch costs one fused check and one host sync per device; only a bad one is
    counted per field and per sample.

    Raises NonFiniteError (carrying the BatchReport) if anything is non-finite and raise_on_nonfinite."""
    pairs = list(named_leaves(batch))
    bad: list[tuple[int, BadField]] = []  # with the field's position, to report in batch order
    for indices in _by_device(pairs).values():
        tensors = [pairs[i][1] for i in indices]
        if not bool(torch.ops.nanfast.any_nonfinite(tensors)):
            continue
        for i, (nan, posinf, neginf) in zip(indices, torch.ops.nanfast.stats(tensors)[0].tolist()):
            if nan or posinf or neginf:
                path, t = pairs[i]
                bad.append((i, BadField(path, tuple(t.shape), str(t.dtype).removeprefix("torch."), nan, posinf,
                                        neginf, _bad_samples(t))))
    report = BatchReport(tuple(field for _, field in sorted(bad, key=lambda b: b[0])), len(pairs))
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

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.loader):
            report = dataclasses.replace(check_batch(batch, raise_on_nonfinite=False), batch_index=index)
            if report.ok:
                yield batch
                continue
            self.bad_batches.append(report)
            if self.action == "raise":
                raise NonFiniteError(report)
            if self.action == "warn":
                warnings.warn(report.summary(), RuntimeWarning, stacklevel=2)
                yield batch

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


def checked(loader: Iterable, *, action: str = "raise") -> Checked:
    """Wraps a DataLoader (or any iterable of batches) so that every batch is checked with
    check_batch before it is used. On a batch holding NaN/inf: action="raise" raises NonFiniteError
    naming the batch index, sample index and field; "warn" warns and yields it; "skip" drops it.
    Batches found bad are kept in `.bad_batches`. Costs one host sync per batch and device."""
    return Checked(loader, action)


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------

CHUNK_BYTES = 256 * 2**20  # tensors checked per fused pass: bounds memory for formats read tensor by tensor
EXIT_CLEAN, EXIT_NONFINITE, EXIT_UNREADABLE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class FileScan:
    """The result of scanning one file. status: "clean", "nonfinite", "unreadable" or "refused" (a
    pickle that asks to run code)."""

    path: str
    status: str
    report: Optional[Report] = None
    error: Optional[str] = None
    skipped: tuple[str, ...] = ()  # tensors that hold no checkable values (sparse, meta)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "status": self.status, "error": self.error, "skipped": list(self.skipped)}
        if self.report is not None:
            d.update(num_tensors=self.report.num_tensors, num_elements=self.report.num_elements,
                     bad=[e.to_dict() for e in self.report.bad])
        return d


class _Refused(Exception):
    """The file asks to run code when loaded."""


class _Unsupported(Exception):
    """The file cannot be read here (its reader is not installed)."""


def _torch_file_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    with open(path, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"
    try:
        # mmap: tensors stay in the page cache, not copied into memory; the legacy (non-zip) format
        # cannot be mapped and is read whole.
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e)) or re.search(r"(Unsupported operand \S+)", str(e))
        if found:
            raise _Refused(f"its pickle asks to run {found.group(1)}; weights-only loading never runs code from "
                           "a file, and nanfast does not load it any other way") from None
        raise
    yield from named_leaves(obj)


def _safetensors_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise _Unsupported("reading .safetensors needs the safetensors package (pip install safetensors)") from None
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def scan_file(path: str) -> FileScan:
    """Checks every tensor in a checkpoint, CHUNK_BYTES at a time (one fused pass per chunk)."""
    tensors = _safetensors_tensors(path) if path.endswith(".safetensors") else _torch_file_tensors(path)
    entries: list[Entry] = []
    skipped: list[str] = []
    chunk: list[tuple[str, torch.Tensor]] = []
    chunk_bytes = 0
    try:
        for name, t in tensors:
            if t.layout != torch.strided or t.is_meta:
                skipped.append(name)
                continue
            chunk.append((name, t))
            chunk_bytes += t.numel() * t.element_size()
            if chunk_bytes >= CHUNK_BYTES:
                entries += check_all(chunk, raise_on_nonfinite=False).entries
                chunk, chunk_bytes = [], 0
        if chunk:
            entries += check_all(chunk, raise_on_nonfinite=False).entries
    except _Refused as e:
        return FileScan(path, "refused", error=str(e))
    except (_Unsupported, OSError) as e:
        return FileScan(path, "unreadable", error=str(e))
    except Exception as e:  # noqa: BLE001  (the readers raise many kinds for a damaged file)
        # The first sentence: torch's messages go on with generic advice.
        message = str(e).strip().split(". ")[0].splitlines()[0] if str(e).strip() else ""
        return FileScan(path, "unreadable", error=f"damaged or truncated, or not a checkpoint ({type(e).__name__}: "
                                                  f"{message})")
    report = Report(tuple(entries))
    return FileScan(path, "clean" if report.ok else "nonfinite", report, skipped=tuple(skipped))


def exit_code(scans: list[FileScan]) -> int:
    """2 if any file could not be read (an unreadable input dominates), else 1 if any holds NaN/inf, else 0."""
    if any(s.status in ("unreadable", "refused") for s in scans):
        return EXIT_UNREADABLE
    return EXIT_NONFINITE if any(s.status == "nonfinite" for s in scans) else EXIT_CLEAN


def format_scan(scan: FileScan) -> str:
    if scan.status in ("unreadable", "refused"):
        return f"{scan.path}: {scan.status}: {scan.error}"
    report = scan.report
    skipped = f" ({len(scan.skipped)} sparse or meta tensors not checked)" if scan.skipped else ""
    head = f"{scan.path}: {report.num_tensors} tensors, {report.num_elements:,} elements"
    if report.ok:
        return f"{head}: clean{skipped}"
    rows = [(e.name, str(tuple(e.shape)), e.dtype, str(e.nan), str(e.posinf), str(e.neginf)) for e in report.bad]
    header = ("name", "shape", "dtype", "nan", "+inf", "-inf")
    widths = [max(len(r[k]) for r in rows + [header]) for k in range(len(header))]
    lines = [f"{head}: {len(report.bad)} of them hold non-finite values{skipped}"]
    for r in [header] + rows:
        lines.append("  " + "  ".join(c.ljust(w) if k < 3 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help=".pt/.pth/.bin (torch.save) or .safetensors files")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    scans = [scan_file(path) for path in args.files]
    code = exit_code(scans)
    if args.json:
        print(json.dumps({"files": [s.to_dict() for s in scans], "exit_code": code}, indent=2))
    else:
        for s in scans:
            print(format_scan(s))
    return code
