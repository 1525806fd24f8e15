"""A zip's records, read before any of them is loaded: its directory, their checksums, and how much memory
their inflated bytes would take."""

from __future__ import annotations

import io
import zipfile
import zlib
from typing import Optional, Union

from . import Unreadable, first_sentence


def zip_directory(path: str) -> Optional[list[zipfile.ZipInfo]]:
    """The records a zip lists (its directory, read once for all torch_load asks of it), or None when
    Python's zipfile cannot read it (then torch's reader says what is wrong)."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.infolist()
    except zipfile.BadZipFile:
        return None


# NOTE: [Records checked against their checksums]
# torch.load never compares a zip record's bytes with the CRC-32 its directory lists: a torch.save file
# with a flipped byte in a tensor's record loaded, with a wrong but finite value, and was scanned clean (a
# probe, session 42), while a TorchScript or .pt2 file, read through zipfile, said "Bad CRC-32". Every
# record is checked first (zipfile's own test, reading the file once at ~3 GB/s on one core here; the
# values are then read from the page cache). A legacy file and a safetensors file hold no checksums.
def check_checksums(source: Union[str, io.BytesIO]) -> None:
    """Raises Unreadable naming the first record of a zip whose bytes do not match its CRC-32."""
    try:
        with zipfile.ZipFile(source) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
        raise Unreadable(f"its zip could not be read whole ({type(e).__name__}: {first_sentence(e)}): damaged or "
                         "truncated (nothing was checked)") from None
    if bad is not None:
        raise Unreadable(f"its record {bad} does not match the checksum (CRC-32) its zip lists: damaged (nothing "
                         "was checked)")


def available_memory() -> Optional[int]:
    """Bytes of memory the system can give without swapping (Linux's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_inflated_size(records: list[zipfile.ZipInfo], file_bytes: int) -> None:
    """Refuses a zip of `file_bytes` whose compressed records, read whole, would take more memory than is
    available: a 3.9 MB file whose one record inflates to 4 GB was read (peak 4.4 GB), and one of 20 MB
    would have the process killed rather than say why.

    Raises:
        Unreadable: their inflated size exceeds the available memory."""
    inflated = sum(r.file_size for r in records if r.compress_type != zipfile.ZIP_STORED)
    available = available_memory()
    if available is not None and inflated > available:
        ratio = inflated / max(1, file_bytes)
        raise Unreadable(f"its compressed records inflate to {mib(inflated)} ({ratio:.0f}x the file), more than the "
                         f"{mib(available)} of memory available: nothing was checked (torch.save never compresses; "
                         "an uncompressed copy is read mapped, in no memory)")


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"
