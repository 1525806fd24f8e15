"""Checking checkpoints (.pt/.pth/.bin/.ckpt, .safetensors, numpy's .npy/.npz, PT2 archives, torch.distributed.checkpoint
directories) for NaN/inf without running pickled code: `scan_file` (the files a path stands for:
nanfast/checkpoint_paths.py), and the exit code of a scan (`python -m nanfast scan`, see nanfast/cli/scan.py):
0 clean or empty (every tensor read), 1 non-finite values found, 2 an input could not be read whole
(refused, unreadable, or some of its tensors not checked)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, Union

import torch

from ._tree import named_leaves
from .check import SPARSE_LAYOUTS, check_all, may_hold_values, stored_values, values_tensor
from .ops import reads_dtype
from .overlapping_views import overlapping_view_entry, reads_faster_by_storage
from .readers import NotRead, Refused, Unreadable, first_sentence, openable_path, require_regular_file
from .readers.dcp import METADATA, dcp_items, dcp_shard, is_dcp_directory
from .readers.numpy_files import is_numpy, numpy_file_arrays
from .readers.pt2 import exported_program_items
from .readers.safetensors_file import safetensors_tensors
from .readers.torch_save import torch_load
from .report import Entry, Report, first_few

__all__ = ["FileScan", "scan_file"]

CHUNK_BYTES = 256 * 2**20  # tensors checked per fused pass: bounds memory for formats read tensor by tensor
EXIT_CLEAN, EXIT_NONFINITE, EXIT_UNREADABLE = 0, 1, 2
MAX_NAMED_IN_MESSAGE = 8


@dataclasses.dataclass(frozen=True)
class FileScan:
    """The result of scanning one file. status: "clean", "nonfinite", "incomplete" (read, no NaN/inf
    found, but some tensors could not be checked), "empty" (read whole, and it holds no tensor: nothing
    was checked, so it is not called clean), "unreadable", or "refused" (a pickle that asks to run code,
    a numpy array of Python objects, or not a regular file)."""

    path: str
    status: str
    report: Optional[Report] = None
    error: Optional[str] = None
    not_checked: tuple[tuple[str, str], ...] = ()  # (name, why) of the tensors whose values were not read
    # Other libraries' classes and functions the file names, read as data, never imported (see NOTE:
    # [Other libraries' objects in checkpoints] in readers/pickle_globals.py).
    stand_ins: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "status": self.status, "error": self.error,
                             "not_checked": [{"name": name, "reason": why} for name, why in self.not_checked],
                             "read_as_data": list(self.stand_ins)}
        if self.report is not None:  # intended infinities (masks, sentinels) listed apart: nanfast/intended.py
            report = self.report.to_dict()
            d.update({key: report[key] for key in ("num_tensors", "num_elements", "bad", "masks", "sentinels")})
        return d


def _readable(name: str, t: Optional[torch.Tensor], leaf: Any) -> Union[tuple[str, torch.Tensor], str]:
    """What of a leaf is checked: (the expression that gives it, a tensor the kernels read), or why nothing
    is; `t` the tensor holding the leaf's values (None: a numpy array torch cannot read)."""
    if t is None:
        return f"a numpy array of dtype {leaf.dtype}: torch cannot read it"
    try:
        if t.is_quantized:  # the integers are finite; a NaN or inf scale makes the values non-finite
            name, t = f"{name}.dequantize()", t.dequantize()
        elif t.is_nested:
            name, t = f"{name}.values()", t.values()
        elif t.layout in SPARSE_LAYOUTS:
            name, t = f"{name}.values()", stored_values(t)
        if t.is_meta:
            return "a meta tensor: it holds no values"
        if t.layout != torch.strided:
            return f"layout {t.layout}: nanfast cannot read it"
        if not reads_dtype(t.dtype):
            return f"dtype {t.dtype}: nanfast cannot read it"
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return f"its {str(t.dtype).removeprefix('torch.')} values could not be read: {first_sentence(e)}"
    return name, t


def _leaves(items: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The leaves a scan reads in each named object: tensors, numpy arrays and Python floats, as check_all
    reads them (a NaN learning rate resumes into NaN training; a score's initial inf is a sentinel: NOTE:
    [Sentinel infinities]); NotRead items as they are."""
    for prefix, obj in items:
        if isinstance(obj, NotRead):
            yield prefix, obj
            continue
        for name, leaf in named_leaves(obj, prefix, brackets=True, shared_once=True, tensor_attributes=True,
                                       leaves_once=True):
            if isinstance(leaf, (torch.Tensor, float, complex)) or is_numpy(leaf):
                yield name, leaf


def _view_key(leaf: Any) -> Optional[tuple]:
    """What a dense tensor's values are (its storage's address, offset, shape, strides, dtype), so that
    a scan reads them once however many times a file names them: as one object (leaves_once) or as as
    many tensors over one storage, which torch.save writes once and a pickle names in ~70 bytes each (a
    1 MB file can name one 256 MB storage 15,000 times). None for other leaves, and for tensors with no
    values to read (empty, meta), which share address 0. An address names values only while their
    storage lives: see _ReadViews."""
    if (not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided or leaf.is_nested or leaf.is_quantized
            or leaf.is_meta or leaf.numel() == 0):
        return None
    return (leaf.untyped_storage().data_ptr(), leaf.storage_offset(), tuple(leaf.shape), leaf.stride(), leaf.dtype)


class _ReadViews:
    """The views a scan has read (see _view_key), each with a weak reference to its storage.

    NOTE: [Addresses that come back]
    The readers of DCP directories and PT2 archives load one item at a time, and a chunk's tensors are
    freed once checked: the next item of the same size may then get a freed one's address. Taken for a
    view already read, it was skipped: 16 of 80 [1024, 1024] layers of a 320 MiB checkpoint, one of them
    with a NaN, and the scan said "clean" (a probe, session 48). So a key counts as read only while the
    storage it was read from is alive; a weak reference keeps no checked chunk in memory."""

    def __init__(self) -> None:
        self._read: dict[tuple, weakref.ref] = {}

    def first_time(self, leaf: Any) -> bool:
        """Whether leaf's values have not been read yet (and notes them as read)."""
        key = _view_key(leaf)
        if key is None:
            return True
        storage = self._read.get(key)
        if storage is not None and storage() is not None:
            return False
        self._read[key] = weakref.ref(leaf.untyped_storage())
        return True


def _check(chunk: list[tuple[str, torch.Tensor]], entries: list[Entry], not_checked: list[tuple[str, str]]) -> None:
    try:
        entries += check_all(chunk, raise_on_nonfinite=False).entries
    except (RuntimeError, TypeError, ValueError) as e:
        if len(chunk) == 1:
            not_checked.append((chunk[0][0], first_sentence(e)))
        else:
            for pair in chunk:  # name the tensors the kernels refuse, and check the others
                _check([pair], entries, not_checked)


def scan_file(path: str, on_checked: Optional[Callable[[int], None]] = None) -> FileScan:
    """Checks the values of every tensor (and Python float) in a checkpoint, CHUNK_BYTES at a time,
    running no pickled code.

    Args:
        path: a torch.save file (zip or legacy; read with weights-only loading) or a TorchScript archive
            (its module's tensors and constants, never its code), a .safetensors file, a
            numpy .npy or .npz file, a PT2 archive (torch.export.save, AOTInductor packages: its weights
            and constants), a torch.distributed.checkpoint directory, or one `.distcp` file of one (the
            items its directory's `.metadata` places in it).
        on_checked: called with the bytes of each chunk once checked (for a progress bar).

    Returns:
        A FileScan. Sparse and nested tensors are checked through their values, quantized ones
        dequantized; a tensor that cannot be read is listed in `not_checked` and the status is never
        "clean".
    """
    entries: list[Entry] = []
    not_checked: list[tuple[str, str]] = []
    chunk: list[tuple[str, torch.Tensor]] = []
    chunk_bytes = 0
    stand_ins: tuple[str, ...] = ()
    opened = contextlib.ExitStack()  # the file under another name (openable_path), while it is read
    try:
        if is_dcp_directory(path):  # see NOTE: [Distributed checkpoints]
            found = _leaves(dcp_items(path))
        elif dcp_shard(path):  # one file of a DCP directory: its items, found through the directory's metadata
            directory = os.path.dirname(os.path.abspath(path))
            if not is_dcp_directory(directory):
                raise Unreadable(f"a distributed checkpoint's shard: where its items lie is in the {METADATA} of "
                                 "its directory, which is not beside it; nothing was checked")
            found = _leaves(dcp_items(directory, only=os.path.basename(path)))
        else:
            require_regular_file(path)
            source = opened.enter_context(openable_path(path))
            if path.endswith(".safetensors"):
                found = safetensors_tensors(source)
            elif path.endswith((".npy", ".npz")):
                found = numpy_file_arrays(source)
            elif (items := exported_program_items(source)) is not None:  # NOTE: [PT2 archives]
                found = _leaves(items)
            else:
                obj, stand_ins = torch_load(source)
                found = _leaves([("", obj)])
        read = _ReadViews()
        for name, leaf in found:
            if isinstance(leaf, NotRead):
                not_checked.append((name, leaf.reason))
                continue
            if not read.first_time(leaf):
                continue
            t = values_tensor(leaf)
            if t is None and not may_hold_values(leaf):  # an array of strings or dates, as check_all skips it
                continue
            readable = _readable(name, t, leaf)
            if isinstance(readable, str):
                not_checked.append((name, readable))
                continue
            if reads_faster_by_storage(readable[1]):  # NOTE: [Views that name their elements many times]
                if chunk:  # checked first: entries stay in the file's order
                    _check(chunk, entries, not_checked)
                chunk, chunk_bytes = [], 0
                entries.append(overlapping_view_entry(*readable))
                continue
            chunk.append(readable)
            chunk_bytes += readable[1].numel() * readable[1].element_size()
            if chunk_bytes >= CHUNK_BYTES:
                _check(chunk, entries, not_checked)
                if on_checked:
                    on_checked(chunk_bytes)
                chunk, chunk_bytes = [], 0
        if chunk:
            _check(chunk, entries, not_checked)
    except Refused as e:
        return FileScan(path, "refused", error=str(e))
    except Unreadable as e:
        return FileScan(path, "unreadable", error=str(e))
    except OSError as e:
        if e.errno != errno.EINVAL:  # the file itself could not be opened or read: said as the system says it
            return FileScan(path, "unreadable", error=str(e))
        # torch's zip reader seeks before a truncated file's start: "[Errno 22] Invalid argument" alone
        return FileScan(path, "unreadable", error=f"damaged or truncated: its zip directory points outside the "
                                                  f"file ({e})")
    except MemoryError:  # not a damaged file: a record too large for this machine's memory
        return FileScan(path, "unreadable", error="this machine's memory is too small to read it (MemoryError)")
    except Exception as e:  # noqa: BLE001  (the readers raise many kinds for a damaged file)
        # (or one torch itself fails on: a float8 tensor in the legacy format, a probe, session 48)
        return FileScan(path, "unreadable", error=f"damaged or truncated, or not a checkpoint, or one this torch "
                                                  f"cannot load ({type(e).__name__}: {first_sentence(e)})")
    finally:
        opened.close()
    report = Report(tuple(entries))
    status = ("nonfinite" if not report.ok else "incomplete" if not_checked else
              "clean" if entries else "empty")
    return FileScan(path, status, report, not_checked=tuple(not_checked), stand_ins=stand_ins)


def exit_code(scans: list[FileScan]) -> int:
    """2 if any file could not be read whole (this dominates), else 1 if any holds NaN/inf, else 0 (an
    empty file too: read whole, it holds nothing non-finite)."""
    if any(s.status in ("unreadable", "refused") or s.not_checked for s in scans):
        return EXIT_UNREADABLE
    return EXIT_NONFINITE if any(s.status == "nonfinite" for s in scans) else EXIT_CLEAN


def format_scan(scan: FileScan) -> str:
    if scan.status in ("unreadable", "refused"):
        return f"{scan.path}: {scan.status}: {scan.error}"
    report = scan.report
    missed = ""
    if scan.not_checked:
        named = first_few([f"{name!r} ({why})" for name, why in scan.not_checked], MAX_NAMED_IN_MESSAGE)
        missed = f"; {len(scan.not_checked)} not checked: {named}"
    missed += report.intended_text()
    if scan.stand_ins:
        classes = "1 other class" if len(scan.stand_ins) == 1 else f"{len(scan.stand_ins)} other classes"
        missed += (f"; objects of {classes} read as data, never imported: "
                   f"{first_few(list(scan.stand_ins), MAX_NAMED_IN_MESSAGE)}")
    tensors = "1 tensor" if report.num_tensors == 1 else f"{report.num_tensors} tensors"
    head = f"{scan.path}: {tensors}, {report.num_elements:,} elements"
    if scan.status == "empty" or (scan.status == "incomplete" and report.num_tensors == 0):  # an index's gaps
        return f"{scan.path}: no tensors in it: nothing checked{missed}"
    if report.ok:
        return f"{head} checked: no NaN/inf{missed}" if scan.not_checked else f"{head}: clean{missed}"
    rows = [(e.name, str(tuple(e.shape)), e.dtype, str(e.nan), str(e.posinf), str(e.neginf)) for e in report.bad]
    header = ("name", "shape", "dtype", "nan", "+inf", "-inf")
    widths = [max(len(r[k]) for r in rows + [header]) for k in range(len(header))]
    lines = [f"{head}: {len(report.bad)} of them hold non-finite values{missed}"]
    for r in [header] + rows:
        lines.append("  " + "  ".join(c.ljust(w) if k < 3 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)
