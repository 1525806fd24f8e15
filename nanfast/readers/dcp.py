"""Reading a torch.distributed.checkpoint (DCP) directory without running pickled code: its `.metadata`
through an unpickler that knows only DCP's own record classes, then each stored item from its
`.distcp` file, weights-only (see NOTE: [Distributed checkpoints])."""

from __future__ import annotations

import functools
import math
import os
import pathlib
import pickle
from collections.abc import Iterator
from typing import Any, Optional

import torch

from . import NotRead, Refused, Unreadable, first_sentence
from .torch_save import saved_item

METADATA = ".metadata"

# NOTE: [Distributed checkpoints]
# FSDP2 and other sharded training save with torch.distributed.checkpoint: a directory of `.distcp`
# files and one `.metadata` that says where each item lies (file, offset, length) and, for a tensor,
# which chunk of it (offsets, sizes). DCP reads `.metadata` with pickle.load, which would run any code a
# hostile file names; nanfast unpickles it with find_class limited to DCP's record classes (dataclasses
# whose construction runs nothing), torch's Size, dtypes, layouts and memory formats, and paths, and
# refuses a file that names anything else. Each item is then read on its own: a tensor chunk is a
# torch.save of that chunk, a non-tensor (a step counter, an optimizer's hyper-parameters) a torch.save
# of the object, both loaded weights-only (other libraries' objects as data: NOTE: [Other libraries'
# objects in checkpoints]). An item stored through a transform (DCP's compression extensions) or in
# another serialization format is listed as not checked. A chunk is named by its tensor's name and,
# when the tensor has several chunks, its offsets ("model.w[0, 512]").


@functools.lru_cache(maxsize=1)
def _allowed() -> dict[str, Any]:
    """What a DCP `.metadata` may name, by name (see the NOTE)."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[str, Any] = {f"torch.distributed.checkpoint.metadata.{name}": getattr(metadata, name)
                               for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                                            "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
                                            "_MEM_FORMAT_ENCODING")
                               if hasattr(metadata, name)}
    allowed["torch.distributed.checkpoint.filesystem._StorageInfo"] = filesystem._StorageInfo
    allowed["torch.Size"] = torch.Size
    allowed["torch.serialization._get_layout"] = torch.serialization._get_layout
    # Python 3.13 moved the path classes to pathlib._local and pickles them under that name; a file
    # written by either Python is read by both.
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        for module in ("pathlib", "pathlib._local"):
            allowed[f"{module}.{name}"] = getattr(pathlib, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's unpickler with find_class limited to what a DCP `.metadata` holds (see the NOTE)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed().get(f"{module}.{name}")
        if found is None and module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                found = value
        if found is None:
            raise Refused(f"its {METADATA} names {module}.{name}, which a distributed checkpoint's metadata does not "
                          "hold; nanfast does not load it")
        return found


def is_dcp_directory(path: str) -> bool:
    """Whether `path` is a directory holding a torch.distributed.checkpoint (its `.metadata` file)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


def dcp_shard(path: str) -> bool:
    """Whether `path` names one `.distcp` file of a DCP checkpoint (read through its directory's metadata)."""
    return path.endswith(".distcp") and os.path.isfile(path)


def dcp_items(path: str, only: Optional[str] = None) -> Iterator[tuple[str, Any]]:
    """A DCP directory's (name, value) pairs: each tensor chunk as a tensor, each other item as the object
    it stores, an item that cannot be read as NotRead (see NOTE: [Distributed checkpoints]). With `only`
    (a `.distcp` file's name), the items stored in that file alone.

    Raises:
        Refused: its `.metadata` names a class a DCP metadata does not hold.
        Unreadable: its `.metadata` is not a DCP metadata."""
    try:
        _allowed()
    except ImportError as e:  # a torch built without torch.distributed
        raise Unreadable(f"reading a distributed checkpoint needs torch.distributed ({e})") from None
    with open(os.path.join(path, METADATA), "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise Unreadable(f"its {METADATA} is not a distributed checkpoint's metadata ({type(e).__name__}: {e})") from None
    items = getattr(metadata, "storage_data", None)
    described = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(items, dict) or not isinstance(described, dict):
        raise Unreadable(f"its {METADATA} is not a distributed checkpoint's metadata (no storage_data)")
    chunks = {fqn: len(getattr(entry, "chunks", ()) or ()) for fqn, entry in described.items()}
    placed = False  # with `only`: the metadata places an item in that file
    unread: set[str] = set()  # the items a chunk of which was not read
    for index, where in items.items():
        if only is not None and getattr(where, "relative_path", None) != only:
            continue
        placed = True
        fqn = index.fqn
        name = fqn if index.offset is None or chunks.get(fqn, 1) <= 1 else f"{fqn}{list(index.offset)}"
        if getattr(where, "transform_descriptors", None):
            yield name, NotRead(f"stored through {', '.join(map(str, where.transform_descriptors))}, which nanfast "
                                "does not read")
            continue
        value = _as_described(_item(path, where), described.get(fqn), index)
        if isinstance(value, NotRead):
            unread.add(fqn)
        yield name, value
    if only is not None:  # the other files hold the rest
        if not placed:
            raise Unreadable(f"the {METADATA} beside it names no item stored in {only}: nothing was checked")
        return
    # An item or chunk described with no entry saying where its data is (a rank's entries lost in a merge)
    # would otherwise be left out unsaid; DCP's own load fails on it. Each chunk is matched by its offsets:
    # counted, an entry with no offset stood for the missing chunk holding a NaN (a probe, session 44).
    stored = {(index.fqn, None if index.offset is None else tuple(index.offset)) for index in items}
    for fqn, entry in described.items():
        described_chunks = getattr(entry, "chunks", None) or ()
        if not described_chunks:  # a non-tensor item: one entry
            if not any(stored_fqn == fqn for stored_fqn, _ in stored):
                yield fqn, NotRead(f"its {METADATA} describes it but says where no data of it is stored")
            continue
        for chunk in described_chunks:
            if (fqn, tuple(chunk.offsets)) not in stored:
                several = len(described_chunks) > 1
                unread.add(fqn)
                yield (f"{fqn}{list(chunk.offsets)}" if several else fqn,
                       NotRead(f"its {METADATA} describes {'this chunk' if several else 'it'} but says where no data "
                               "of it is stored"))
        size = getattr(entry, "size", None)
        if size is not None and fqn not in unread and not _tiles(described_chunks, tuple(size)):
            yield fqn, NotRead(f"its {METADATA} describes a tensor of {math.prod(size)} elements {list(size)} in chunks "
                               f"of {sum(math.prod(c.sizes) for c in described_chunks)} in all that do not tile it: "
                               "some of it is stored nowhere, or twice")


def _tiles(chunks: Any, size: tuple[int, ...]) -> bool:
    """Whether `chunks` (boxes: offsets, sizes) cover a tensor of `size` exactly: each inside it, no two
    overlapping, their elements as many as its. Equal totals alone passed chunks [0:4] and [2:6] of an [8]
    tensor, elements 6 and 7 stored nowhere, and the scan said clean (a probe, session 52)."""
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
    if any(len(o) != len(size) or len(n) != len(size) or any(a < 0 or a + k > d for a, k, d in zip(o, n, size))
           for o, n in boxes):
        return False
    # A sweep along dim 0: each box is compared with the boxes whose rows it shares (one per rank of a
    # row-sharded tensor, not every pair of a thousand ranks' chunks).
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for o, n in sorted(b for b in boxes if math.prod(b[1]) and size):
        active = [(o2, n2) for o2, n2 in active if o2[0] + n2[0] > o[0]]
        if any(all(a1 < a2 + k2 and a2 < a1 + k1 for a1, k1, a2, k2 in zip(o, n, o2, n2)) for o2, n2 in active):
            return False
        active.append((o, n))
    return sum(math.prod(n) for _, n in boxes) == math.prod(size)


def _as_described(item: Any, described: Any, index: Any) -> Any:
    """A tensor chunk as the `.metadata` describes it (its chunk's sizes, its tensor's dtype), else NotRead:
    a damaged `.metadata` (a flipped bit in a size) still points at intact items, which read clean
    while DCP's own load of the checkpoint fails on them."""
    if not isinstance(item, torch.Tensor):
        return item
    if index.offset is None:  # DCP places each chunk of a tensor at its offsets
        return NotRead(f"its {METADATA} stores it with no chunk offset: damaged") if getattr(described, "chunks", None) else item
    chunk = next((c for c in getattr(described, "chunks", None) or () if c.offsets == index.offset), None)
    dtype = getattr(getattr(described, "properties", None), "dtype", None)
    if chunk is None or tuple(chunk.sizes) != tuple(item.shape) or dtype != item.dtype:
        said = "no such chunk" if chunk is None else f"sizes {list(chunk.sizes)}, {dtype}"
        return NotRead(f"its {METADATA} describes it as {said}, but the item stored is {list(item.shape)}, "
                       f"{item.dtype}: the metadata or the item is damaged")
    return item


def _item(path: str, where: Any) -> Any:
    """One stored item: the object its torch.save holds, or NotRead."""
    file = os.path.join(path, where.relative_path)
    # A link is followed only to a file in the directory itself (one to /etc/passwd is not read).
    if (os.path.dirname(os.path.normpath(where.relative_path)) or not os.path.isfile(file)
            or os.path.dirname(os.path.realpath(file)) != os.path.realpath(path)):
        return NotRead(f"its file {where.relative_path!r} is not a file in the checkpoint's directory")
    try:
        with open(file, "rb") as f:
            # The declared extent is checked against the file before anything is read or allocated.
            if where.offset < 0 or where.length < 0 or where.offset + where.length > os.fstat(f.fileno()).st_size:
                return NotRead(f"{where.relative_path} ends before the item's {where.length} bytes at {where.offset}")
            f.seek(where.offset)
            blob = f.read(where.length)
    except OSError as e:
        return NotRead(f"{where.relative_path} could not be read ({type(e).__name__}: {first_sentence(e)})")
    if len(blob) != where.length:
        return NotRead(f"{where.relative_path} ends before the item's {where.length} bytes at {where.offset}")
    if not blob.startswith(b"PK\x03\x04"):
        return NotRead("not stored as a torch.save (another DCP serialization format), which nanfast does not read")
    return saved_item(blob)
