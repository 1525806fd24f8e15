"""`python -m nanfast scan FILE...`: checks checkpoint files for NaN/inf without running pickled code
(nanfast.scan does the work); prints a table per file, or one JSON object, and exits 0 (clean, or empty), 1
(NaN/inf) or 2 (a file not read whole)."""

from __future__ import annotations

import argparse
import json
import os

from ..progress import byte_progress
from ..scan import FileScan, exit_code, format_scan, scan_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help=".pt/.pth/.bin (torch.save) or .safetensors files")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _scan_all(paths: list[str]) -> list[FileScan]:
    sizes = [os.stat(p).st_size if os.path.isfile(p) else 0 for p in paths]
    scans = []
    with byte_progress(sum(sizes), desc="nanfast scan") as bar:
        for path, size in zip(paths, sizes):
            left = size

            def advance(nbytes: int) -> None:  # tensor bytes stand for file bytes, up to the file's size
                nonlocal left
                step = min(nbytes, left)
                left -= step
                bar.update(step)

            scans.append(scan_file(path, advance))
            advance(left)
    return scans


def run(args: argparse.Namespace) -> int:
    scans = _scan_all(args.files)
    code = exit_code(scans)
    if args.json:
        print(json.dumps({"files": [s.to_dict() for s in scans], "exit_code": code}, indent=2))
    else:
        for s in scans:
            print(format_scan(s))
    return code
