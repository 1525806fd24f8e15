"""Checking checkpoints (.pt/.pth/.bin, .safetensors) for NaN/inf without running pickled code:
`scan_file`, and the exit code of a scan (`python -m nanfast scan`, see nanfast/cli/scan.py): 0 clean or empty
(every tensor read), 1 non-finite values found, 2 an input could not be read whole (refused,
unreadable, or some of its tensors not checked)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pickle
import pickletools
import re
import stat
import sys
import zipfile
from collections.abc import Callable, Iterator
from typing import Any, Optional, Union

import torch

from ._tree import named_leaves
from .check import check_all
from .ops import reads_dtype
from .report import Entry, Report

__all__ = ["FileScan", "scan_file"]

CHUNK_BYTES = 256 * 2**20  # tensors checked per fused pass: bounds memory for formats read tensor by tensor
EXIT_CLEAN, EXIT_NONFINITE, EXIT_UNREADABLE = 0, 1, 2
MAX_NAMED_IN_MESSAGE = 8
# A legacy (non-zip) torch.save file begins with a pickle of this number.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C.to_bytes(10, "little")
_SPARSE_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


@dataclasses.dataclass(frozen=True)
class FileScan:
    """The result of scanning one file. status: "clean", "nonfinite", "incomplete" (read, no NaN/inf
    found, but some tensors could not be checked), "empty" (read whole, and it holds no tensor: nothing
    was checked, so it is not called clean), "unreadable", or "refused" (a pickle that asks to run code,
    or not a regular file)."""

    path: str
    status: str
    report: Optional[Report] = None
    error: Optional[str] = None
    not_checked: tuple[tuple[str, str], ...] = ()  # (name, why) of the tensors whose values were not read
    # Infinities a tool stores on purpose, left out of `report` (see NOTE: [Sentinel infinities]): entries.
    sentinels: tuple[Entry, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "status": self.status, "error": self.error,
                             "not_checked": [{"name": name, "reason": why} for name, why in self.not_checked],
                             "sentinels": [e.to_dict() for e in self.sentinels]}
        if self.report is not None:
            d.update(num_tensors=self.report.num_tensors, num_elements=self.report.num_elements,
                     bad=[e.to_dict() for e in self.report.bad])
        return d


class _Refused(Exception):
    """nanfast will not read the file: its pickle asks to run code, or it is not a regular file."""


class _Unreadable(Exception):
    """The file cannot be read here; the message says what it is and why."""


def _first_sentence(e: BaseException) -> str:
    # torch's messages go on with generic advice after their first sentence.
    text = str(e).strip()
    return text.split(". ")[0].splitlines()[0] if text else ""


def _require_regular_file(path: str) -> None:
    kind = os.stat(path).st_mode
    if not stat.S_ISREG(kind):
        what = ("a directory" if stat.S_ISDIR(kind) else "a FIFO" if stat.S_ISFIFO(kind) else "a character device"
                if stat.S_ISCHR(kind) else "a block device" if stat.S_ISBLK(kind) else "a socket")
        raise _Refused(f"{what}, not a regular file: nanfast scans files only (reading it could block or never end)")


def _compressed(path: str) -> bool:
    """Whether a zip holds compressed records: torch.load(mmap=True) would take their compressed bytes
    for values (torch.save never compresses, but a re-zipped file does)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(info.compress_type != zipfile.ZIP_STORED for info in z.infolist())
    except zipfile.BadZipFile:
        return True  # not mapped: torch's reader says what is wrong


def _not_a_checkpoint(path: str) -> str:
    try:
        with open(path, "rb") as f:
            for _ in pickletools.genops(f):  # parses opcodes only: runs nothing
                pass
    except Exception:  # noqa: BLE001  (a malformed pickle fails in many ways)
        return "not a checkpoint: neither a torch.save file (zip or legacy) nor a pickle (nothing was checked)"
    return ("not a checkpoint: a plain pickle (as pickle.dump writes), not a torch.save file; nanfast loads only "
            "torch.save and .safetensors files (nothing was checked)")


def _torch_load(path: str) -> Any:
    with open(path, "rb") as f:
        head = f.read(32)
    is_zip = head.startswith(b"PK\x03\x04")
    if not head:
        raise _Unreadable("an empty file: nothing to check")
    if not is_zip and LEGACY_MAGIC not in head:
        raise _Unreadable(_not_a_checkpoint(path))
    # mmap: tensors stay in the page cache, not copied into memory. Compressed records and the legacy
    # (non-zip) format cannot be mapped and are read whole.
    mmap = is_zip and not _compressed(path)
    load = functools.partial(torch.load, path, map_location="cpu", weights_only=True, mmap=mmap)
    try:
        try:
            return load()
        except pickle.UnpicklingError as e:
            if "torch._dynamo" not in str(e) or "torch._dynamo" in sys.modules:
                raise
            importlib.import_module("torch._dynamo")  # allows the names a nested jagged tensor's pickle holds
            return load()
    except pickle.UnpicklingError as e:
        if found := re.search(r"GLOBAL (\S+)", str(e)):
            raise _Refused(f"its pickle asks to run {found.group(1)}; weights-only loading never runs code from "
                           "a file, and nanfast does not load it any other way") from None
        if found := re.search(r"Unsupported operand \S+", str(e)):
            raise _Unreadable(f"its pickle uses an instruction weights-only loading does not read ({found.group(0)}; "
                              "torch.save with pickle_protocol above 2?), so nothing was checked") from None
        raise


def _safetensors_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise _Unreadable("reading .safetensors needs the safetensors package "
                          "(pip install 'nanfast[safetensors]')") from None
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _readable(name: str, t: torch.Tensor) -> Union[tuple[str, torch.Tensor], str]:
    """What of `t` is checked: (the expression that gives it, a tensor the kernels read), or why nothing is."""
    try:
        if t.is_quantized:  # the integers are finite; a NaN or inf scale makes the values non-finite
            name, t = f"{name}.dequantize()", t.dequantize()
        elif t.is_nested or t.layout in _SPARSE_COMPRESSED:
            name, t = f"{name}.values()", t.values()
        elif t.layout == torch.sparse_coo:
            name, t = f"{name}.values()", t._values()  # .values() refuses an uncoalesced tensor
        if t.is_meta:
            return "a meta tensor: it holds no values"
        if t.layout != torch.strided:
            return f"layout {t.layout}: nanfast cannot read it"
        if not reads_dtype(t.dtype):
            return f"dtype {t.dtype}: nanfast cannot read it"
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return f"its {str(t.dtype).removeprefix('torch.')} values could not be read: {_first_sentence(e)}"
    return name, t


# NOTE: [Sentinel infinities]
# Some tools store an infinity on purpose. Lightning's ModelCheckpoint keeps `kth_value`, the score a
# new checkpoint must beat, at +inf (mode "min") or -inf ("max") until it has saved top-k of them, and
# EarlyStopping its `best_score` the same way until the first validation: every checkpoint a Lightning
# Trainer saves with its default ModelCheckpoint holds one, and a scan that called it non-finite would
# fail every healthy Lightning run in CI. In a Lightning checkpoint (a dict with a
# "pytorch-lightning_version" key), a 0-dim tensor under "callbacks" that is +inf or -inf is such a
# sentinel: listed apart, not counted. A NaN there, or an infinity anywhere else (the weights, the
# optimizer's state), is reported as usual.
_LIGHTNING_VERSION_KEY = "pytorch-lightning_version"


def _is_sentinel(entry: Entry, lightning: bool) -> bool:
    return (lightning and entry.name.startswith("callbacks.") and entry.shape == () and entry.nan == 0
            and entry.nonfinite == 1)


def _check(chunk: list[tuple[str, torch.Tensor]], entries: list[Entry], not_checked: list[tuple[str, str]]) -> None:
    try:
        entries += check_all(chunk, raise_on_nonfinite=False).entries
    except (RuntimeError, TypeError, ValueError) as e:
        if len(chunk) == 1:
            not_checked.append((chunk[0][0], _first_sentence(e)))
        else:
            for pair in chunk:  # name the tensors the kernels refuse, and check the others
                _check([pair], entries, not_checked)


def scan_file(path: str, on_checked: Optional[Callable[[int], None]] = None) -> FileScan:
    """Checks the values of every tensor in a checkpoint, CHUNK_BYTES at a time, running no pickled code.

    Args:
        path: a torch.save file (zip or legacy; read with weights-only loading), or a .safetensors file.
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
    lightning = False
    try:
        _require_regular_file(path)
        if path.endswith(".safetensors"):
            tensors = _safetensors_tensors(path)
        else:
            obj = _torch_load(path)
            lightning = isinstance(obj, dict) and _LIGHTNING_VERSION_KEY in obj
            loaded = named_leaves(obj, brackets=True, shared_once=True, tensor_attributes=True)
            tensors = ((name, leaf) for name, leaf in loaded if isinstance(leaf, torch.Tensor))
        for name, t in tensors:
            readable = _readable(name, t)
            if isinstance(readable, str):
                not_checked.append((name, readable))
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
    except _Refused as e:
        return FileScan(path, "refused", error=str(e))
    except (_Unreadable, OSError) as e:
        return FileScan(path, "unreadable", error=str(e))
    except Exception as e:  # noqa: BLE001  (the readers raise many kinds for a damaged file)
        return FileScan(path, "unreadable", error=f"damaged or truncated, or not a checkpoint ({type(e).__name__}: "
                                                  f"{_first_sentence(e)})")
    sentinels = tuple(e for e in entries if _is_sentinel(e, lightning))
    report = Report(tuple(e for e in entries if not _is_sentinel(e, lightning)))
    status = ("nonfinite" if not report.ok else "incomplete" if not_checked else
              "clean" if entries else "empty")
    return FileScan(path, status, report, not_checked=tuple(not_checked), sentinels=sentinels)


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
        named = ", ".join(f"{name!r} ({why})" for name, why in scan.not_checked[:MAX_NAMED_IN_MESSAGE])
        more = len(scan.not_checked) - MAX_NAMED_IN_MESSAGE
        missed = f"; {len(scan.not_checked)} not checked: {named}{f' and {more} more' if more > 0 else ''}"
    if scan.sentinels:
        named = ", ".join(f"{e.name} ({e.counts_text()})" for e in scan.sentinels[:MAX_NAMED_IN_MESSAGE])
        more = len(scan.sentinels) - MAX_NAMED_IN_MESSAGE
        missed += (f"; left out, as infinities Lightning's callbacks store on purpose (an initial best or worst "
                   f"score): {named}{f' and {more} more' if more > 0 else ''}")
    tensors = "1 tensor" if report.num_tensors == 1 else f"{report.num_tensors} tensors"
    head = f"{scan.path}: {tensors}, {report.num_elements:,} elements"
    if scan.status == "empty":
        return f"{scan.path}: no tensors in it: nothing checked"
    if report.ok:
        return f"{head} checked: no NaN/inf{missed}" if scan.not_checked else f"{head}: clean{missed}"
    rows = [(e.name, str(tuple(e.shape)), e.dtype, str(e.nan), str(e.posinf), str(e.neginf)) for e in report.bad]
    header = ("name", "shape", "dtype", "nan", "+inf", "-inf")
    widths = [max(len(r[k]) for r in rows + [header]) for k in range(len(header))]
    lines = [f"{head}: {len(report.bad)} of them hold non-finite values{missed}"]
    for r in [header] + rows:
        lines.append("  " + "  ".join(c.ljust(w) if k < 3 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)
