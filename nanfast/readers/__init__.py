"""Reading checkpoint files without running pickled code, one format per module, as (name, tensor or
array) pairs, and the errors that say why a file is not read (`Refused`, `Unreadable`); nanfast.scan
checks what they give.

    torch_save.py        torch.save files (zip or legacy) and TorchScript archives, weights-only
    pickle_globals.py    what a pickle may name: numpy's arrays allowed, other libraries' objects as data
    zip_records.py       a zip's records: its directory, their checksums, their inflated size
    numpy_files.py       numpy's .npy and .npz
    safetensors_file.py  .safetensors
    dcp.py               torch.distributed.checkpoint directories
    pt2.py               PT2 archives (torch.export.save)"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator


class Refused(Exception):
    """nanfast will not read the file: its pickle asks to run code, it holds a numpy array of Python objects,
    or it is not a regular file."""


class Unreadable(Exception):
    """The file cannot be read here; the message says what it is and why."""


class NotRead:
    """An item of a checkpoint that cannot be read, and why (the scan lists it as not checked)."""

    def __init__(self, reason: str):
        self.reason = reason



@contextlib.contextmanager
def openable_path(path: str) -> Iterator[str]:
    """`path`, or, where its name is not valid UTF-8 (bytes a str holds as surrogates: legal on Linux),
    the same file open under /proc/self/fd: torch's zip reader and safetensors take UTF-8 paths only,
    and called a healthy file whose name was not "damaged or truncated" (a probe, session 44).

    Raises:
        Unreadable: such a name where /proc is not mounted."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        yield path
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        through = f"/proc/self/fd/{fd}"
        if not os.path.exists(through):
            raise Unreadable("its name is not valid UTF-8, which torch's and safetensors' readers cannot open: "
                             "rename it (nothing was checked)")
        yield through
    finally:
        os.close(fd)


def first_sentence(e: BaseException) -> str:
    """The first sentence of an error's message (torch's go on with generic advice after it); "no message"
    for an error without one (a bare MemoryError)."""
    text = str(e).strip()
    return text.split(". ")[0].splitlines()[0] if text else "no message"


def require_regular_file(path: str) -> None:
    """Raises Refused for anything but a regular file (a FIFO or a device could block a read forever)."""
    kind = os.stat(path).st_mode
    if not stat.S_ISREG(kind):
        what = ("a directory" if stat.S_ISDIR(kind) else "a FIFO" if stat.S_ISFIFO(kind) else "a character device"
                if stat.S_ISCHR(kind) else "a block device" if stat.S_ISBLK(kind) else "a socket")
        raise Refused(f"{what}, not a regular file: nanfast scans files only (reading it could block or never end)")
