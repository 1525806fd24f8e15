"""`python -m nanfast scan FILE...` checks checkpoints (.pt/.pth/.bin, .safetensors) for NaN/inf
without running pickled code: exit code 0 clean, 1 non-finite values found, 2 an input could not be
read (or was refused)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import re
from collections.abc import Iterator
from typing import Any, Optional

import torch

from .check import check_all
from .leaves import named_leaves
from .report import Entry, Report

__all__ = ["FileScan", "scan_file"]

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
