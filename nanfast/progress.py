"""A progress bar for long runs (benchmark suites, scans of many or large files): tqdm's, on a
terminal and when tqdm is installed (`pip install 'nanfast[progress]'`); nothing otherwise, so logs and
pipes stay clean."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, Optional, TypeVar

T = TypeVar("T")


def _tqdm() -> Optional[Any]:
    """tqdm's bar class when stderr is a terminal and tqdm is importable, else None."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def progress(items: Iterable[T], *, desc: str, total: Optional[int] = None) -> Iterator[T]:
    """`items`, shown as a progress bar on stderr when it is a terminal and tqdm is importable.

    Args:
        items: what to iterate over.
        desc: the bar's label.
        total: the number of items, when `items` has no len().

    Returns:
        An iterator over `items` (the items themselves, unchanged).
    """
    tqdm = _tqdm()
    if tqdm is None:
        return iter(items)
    return iter(tqdm(items, desc=desc, total=total, leave=False, file=sys.stderr))


class _Silent:
    """The bar `byte_progress` gives where none is shown: it takes the same calls and draws nothing."""

    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def byte_progress(total: int, *, desc: str) -> Any:
    """A bar over `total` bytes, advanced by its `update(nbytes)`; a context manager (closed on exit).
    Shown on stderr when it is a terminal and tqdm is importable, else it draws nothing.

    Args:
        total: the bytes the whole run will cover.
        desc: the bar's label.

    Returns:
        tqdm's bar, or an object with the same `update` and context manager that does nothing.
    """
    tqdm = _tqdm()
    if tqdm is None:
        return _Silent()
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False, file=sys.stderr)
