"""`python -m nanfast scan FILE...`: checks checkpoint files (or a directory's, or a sharded checkpoint's
shards) for NaN/inf without running pickled code (nanfast.scan does the work); prints a table per file,
or one JSON object, and exits 0 (clean, or empty), 1 (NaN/inf) or 2 (a file not read whole)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..checkpoint_paths import checkpoint_files, index_gaps, indexes_of
from ..progress import byte_progress
from ..scan import FileScan, exit_code, format_scan, scan_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help=".pt/.pth/.pth.tar/.bin/.ckpt (torch.save, or torch.jit.save: never its code), "
                             ".safetensors, .npy/.npz or .pt2 "
                             "(torch.export) files; a directory (its checkpoint files; a torch.distributed.checkpoint "
                             "directory as one checkpoint, or one of its .distcp files); a sharded checkpoint's *.index.json (its shards)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _size(path: str) -> int:
    return os.stat(path).st_size if os.path.isfile(path) else 0


def _scan_all(args: list[str]) -> list[FileScan]:
    found = [checkpoint_files(arg) for arg in args]
    scans = []
    with byte_progress(sum(_size(p) for files in found if isinstance(files, list) for p in files if isinstance(p, str)),
                       desc="nanfast scan") as bar:
        for files in found:
            if isinstance(files, FileScan):  # names no file to read
                scans.append(files)
            else:  # (a folder that could not be listed is its FileScan)
                scans += [path if isinstance(path, FileScan) else _scan_one(path, bar) for path in files]
    by_path = {s.path: s for s in scans}
    for index in dict.fromkeys(i for arg in args for i in indexes_of(arg)):
        gaps = index_gaps(index, by_path)
        if gaps is not None:
            scans.append(gaps)
    return scans


def _scan_one(path: str, bar) -> FileScan:
    left = _size(path)

    def advance(nbytes: int) -> None:  # tensor bytes stand for file bytes, up to the file's size
        nonlocal left
        step = min(nbytes, left)
        left -= step
        bar.update(step)

    result = scan_file(path, advance)
    advance(left)
    return result


def run(args: argparse.Namespace) -> int:
    scans = _scan_all(args.files)
    code = exit_code(scans)
    if args.json:
        # Strict JSON: a norm past float64's range (of finite values) is null, as in the health timeline.
        loose = json.dumps({"files": [s.to_dict() for s in scans], "exit_code": code})
        _print(json.dumps(json.loads(loose, parse_constant=lambda _: None), indent=2, allow_nan=False))
    else:
        for s in scans:
            _print(format_scan(s))
    return code


def _print(text: str) -> None:
    """Prints `text`, with what the output's encoding cannot write (a file name's undecodable bytes, a
    tensor name holding a lone surrogate) escaped: it stopped the scan with a UnicodeEncodeError and no
    report (a probe, session 52)."""
    encoding = sys.stdout.encoding or "utf-8"
    print(text.encode(encoding, "backslashreplace").decode(encoding))
