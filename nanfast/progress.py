"""A progress bar for long runs (benchmark suites, scans of many or large files): tqdm's, on a
terminal and when tqdm is installed (`pip install 'nanfast[progress]'`); nothing otherwise, so logs and
pipes stay clean."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Optional, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], *, desc: str, total: Optional[int] = None) -> Iterator[T]:
    """`items`, shown as a progress bar on stderr when it is a terminal and tqdm is importable.

    Args:
        items: what to iterate over.
        desc: the bar's label.
        total: the number of items, when `items` has no len().

    Returns:
        An iterator over `items` (the items themselves, unchanged).
    """
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return iter(tqdm(items, desc=desc, total=total, leave=False, file=sys.stderr))
    return iter(items)
