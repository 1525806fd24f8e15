"""numpy's .npy and .npz files: numeric arrays read (an .npy memory-mapped), arrays of Python objects
refused."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

from . import NotRead, Refused, Unreadable, zip_records
from .zip_records import mib, zip_directory


def numpy_file_arrays(path: str) -> Iterator[tuple[str, Any]]:
    """A .npy file's array (named by the file, memory-mapped) or a .npz file's (name, array) pairs; an
    array of Python objects (a pickle) is refused, not loaded: a .npy of one is refused whole, an .npz
    member is a NotRead (the scan lists it as not checked and still reads the other members)."""
    try:
        import numpy as np
    except ImportError:
        raise Unreadable("reading .npy and .npz files needs numpy (pip install numpy)") from None
    try:
        loaded = np.load(path, mmap_mode="r", allow_pickle=False)  # an .npz is not mapped: read array by array
    except ValueError as e:
        raise Refused(_OBJECTS) if _holds_objects(e) else e from None
    if isinstance(loaded, np.ndarray):
        yield os.path.basename(path), loaded
        return
    # Each member is read whole, inflated: one larger than the memory available is not (a 14 MB file
    # inflating to 3.7 GB was read whole: a probe, session 44). Members are read by their names in the
    # zip, not by numpy's keys, which drop ".npy": of members "w" and "w.npy" both keys read "w", and
    # "w.npy" (with a NaN) was never read (a probe, session 52).
    sizes = {record.filename: record.file_size for record in zip_directory(path) or ()}
    available = zip_records.available_memory()
    with loaded:
        for member, size in sizes.items():
            key = member.removesuffix(".npy")
            name = key if key == member or key not in sizes else member
            if available is not None and size > available:
                yield name, NotRead(f"it inflates to {mib(size)}, more than the {mib(available)} of memory available")
                continue
            try:
                array = loaded[member]
            except ValueError as e:
                if not _holds_objects(e):
                    raise
                yield name, NotRead(_OBJECTS)
                continue
            if isinstance(array, bytes):  # numpy hands a member that is no .npy array over as its bytes
                yield name, NotRead("it is not a .npy array (no numpy header): not read")
                continue
            yield name, array


_OBJECTS = "it holds an array of Python objects (a pickle), which nanfast does not load"


def _holds_objects(e: ValueError) -> bool:
    """Whether numpy refused an array because it holds Python objects (its two messages: loading with
    allow_pickle=False, and a .npy's memory-mapping)."""
    return "Object arrays cannot be loaded when allow_pickle=False" in str(e) or "Python objects in dtype" in str(e)


def is_numpy(obj: Any) -> bool:
    """Whether `obj` is a numpy array or scalar (without importing numpy)."""
    numpy = sys.modules.get("numpy")  # a loaded file holding arrays has imported it
    return numpy is not None and isinstance(obj, (numpy.ndarray, numpy.generic))
