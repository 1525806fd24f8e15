"""Reading the weights and constants of a PT2 archive (what torch.export.save and AOTInductor's packaging
write) without loading its program or running pickled code (see NOTE: [PT2 archives])."""

from __future__ import annotations

import functools
import json
import math
import os
import posixpath
import sys
import zipfile
from collections.abc import Iterator
from typing import Any, Optional

import torch

from . import NotRead, Unreadable, first_sentence
from .torch_save import saved_item

# NOTE: [PT2 archives]
# torch.export.save (and torch._inductor's aoti_compile_and_package) write a zip whose record
# `<root>/archive_format` reads "pt2". Each model's tensors are listed in
# `<root>/data/weights/<model>_weights_config.json` and `<root>/data/constants/<model>_constants_config.json`:
# for each name, its record in that folder (`path_name`), whether the record is a torch.save pickle
# (`use_pickle`: tensor subclasses, custom objects) or the raw bytes of the tensor's storage, and the
# tensor's metadata (dtype as a number of torch.export's schema, sizes, strides, storage offset).
# torch.export.load reads the pickled records with weights_only=False, which runs whatever a file names;
# nanfast reads raw records as bytes (bounds checked against the sizes and strides) and pickled ones
# weights-only, and never loads the program (models/*.json, an AOTInductor library). A record with no
# bytes (a fake tensor's) or a payload it cannot decode is listed as not checked. An archive with no
# weights config (an AOTInductor package whose weights live inside its compiled library) is
# unreadable: nothing in it was checked. torch.export.save before torch 2.8 wrote another zip: flat
# records `serialized_exported_program.json`, and `serialized_state_dict.pt` and
# `serialized_constants.pt`, each a torch.save of a dict of tensors; those two are read weights-only.

ARCHIVE_FORMAT = "archive_format"
FORMAT_VALUE = b"pt2"
CONFIG_FOLDERS = ("data/weights", "data/constants")
LEGACY_PROGRAM = "serialized_exported_program.json"
LEGACY_TENSORS = ("serialized_state_dict.pt", "serialized_constants.pt")


def exported_program_items(path: str) -> Optional[Iterator[tuple[str, Any]]]:
    """The (name, value or NotRead) pairs of the exported program's tensors in the zip at `path`, or None
    when it holds none: neither a PT2 archive nor torch.export.save's layout before torch 2.8 (NOTE: [PT2
    archives]). The pairs' iterator raises Unreadable for an archive that lists no weights."""
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            if LEGACY_PROGRAM in names and LEGACY_TENSORS[0] in names:
                return _legacy_items(path)
            for info in z.infolist():
                if (posixpath.basename(info.filename) == ARCHIVE_FORMAT and info.file_size <= 16
                        and z.read(info).strip() == FORMAT_VALUE):
                    return _pt2_items(path, posixpath.dirname(info.filename))
    except (zipfile.BadZipFile, OSError):
        return None
    return None


def _legacy_items(path: str) -> Iterator[tuple[str, Any]]:
    with zipfile.ZipFile(path) as z:
        for record in LEGACY_TENSORS:
            if record in z.namelist():
                value = saved_item(z.read(record))  # a dict: its keys name the tensors
                yield (record if isinstance(value, NotRead) else ""), value


@functools.lru_cache(maxsize=1)
def _dtypes() -> dict[int, torch.dtype]:
    """torch.export's schema numbers of dtypes, from its own table."""
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    return {int(code): dtype for code, dtype in _SERIALIZE_TO_TORCH_DTYPE.items()}


def _dtype(number: int) -> torch.dtype:
    if number not in _dtypes():
        raise ValueError(f"dtype number {number} is not one this torch knows")
    return _dtypes()[number]


def _ints(values: list) -> list[int]:
    """torch.export's symbolic ints, which a saved weight holds as {"as_int": n}."""
    out = []
    for v in values:
        if not isinstance(v, dict) or not isinstance(v.get("as_int"), int):
            raise ValueError(f"a size, stride or offset that is not a plain integer ({v!r})")
        out.append(v["as_int"])
    return out


def _raw_tensor(data: bytearray, meta: dict) -> Any:
    """The tensor a raw record's bytes hold, as its metadata lays them out; NotRead when they cannot."""
    dtype = _dtype(meta["dtype"])
    sizes, strides = _ints(meta["sizes"]), _ints(meta["strides"])
    (offset,) = _ints([meta["storage_offset"]])
    if len(sizes) != len(strides) or min(sizes + strides + [offset], default=0) < 0:
        return NotRead("its sizes, strides and offset do not describe a tensor")
    if math.prod(sizes) == 0:
        return torch.empty(sizes, dtype=dtype)
    if not data:
        return NotRead("no values stored (a fake tensor's record)")
    itemsize = dtype.itemsize
    needed = offset + sum((s - 1) * st for s, st in zip(sizes, strides)) + 1
    if len(data) % itemsize or len(data) // itemsize < needed:
        return NotRead(f"its record holds {len(data)} bytes, fewer than its sizes and strides need "
                       f"({needed} elements of {itemsize} bytes)")
    storage = torch.frombuffer(data, dtype=dtype)
    return storage.as_strided(sizes, strides, offset)


def _pt2_items(path: str, root: str) -> Iterator[tuple[str, Any]]:
    """Each weight and constant of the PT2 archive at `path` (root: the folder of its records) as (name,
    tensor or other leaf, or NotRead); a model other than the default "model" prefixes its names with its
    own.

    Raises:
        Unreadable: the archive lists no weights (nothing in it could be checked).
    """
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        configs = [n for folder in CONFIG_FOLDERS for n in sorted(names)  # weights first, then constants
                   if posixpath.dirname(n) == posixpath.join(root, folder) and n.endswith("_config.json")]
        if not any(n.endswith("_weights_config.json") for n in configs):
            raise Unreadable("a PT2 archive with no weights config (an AOTInductor package keeps its weights in "
                             "its compiled library): nothing was checked")
        order = posixpath.join(root, "byteorder")
        if order in names and z.read(order).strip().decode(errors="replace") != sys.byteorder:
            raise Unreadable(f"a PT2 archive written in {z.read(order).strip().decode(errors='replace')!r} byte order, "
                             f"not this machine's ({sys.byteorder}): its raw tensors are not read, nothing was checked")
        for config_name in configs:
            model = posixpath.basename(config_name).rsplit("_", 2)[0]
            prefix = "" if model == "model" else f"{model}."
            try:
                entries = json.loads(z.read(config_name))["config"]
                items = list(entries.items())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                yield config_name, NotRead(f"its config is not a PT2 payload config ({type(e).__name__})")
                continue
            for fqn, payload in items:
                yield _payload(z, names, posixpath.dirname(config_name), prefix + str(fqn), payload)


def _payload(z: zipfile.ZipFile, names: set, folder: str, name: str, payload: Any) -> tuple[str, Any]:
    """One listed item: its tensor (a raw record), the object its torch.save holds (a pickled one), or
    NotRead."""
    try:
        record = posixpath.join(folder, payload["path_name"])
        if posixpath.normpath(record) != record or posixpath.dirname(record) != folder or record not in names:
            return name, NotRead(f"its record {payload['path_name']!r} is not in the archive's folder {folder}")
        info = z.getinfo(record)
        # Its declared size is checked before anything is allocated: a stored record holds what it stores,
        # and deflate inflates at most ~1032x.
        inflation = 1 if info.compress_type == zipfile.ZIP_STORED else 1032
        if info.compress_size > os.path.getsize(z.filename) or info.file_size > info.compress_size * inflation:
            return name, NotRead(f"its record {record} declares {info.file_size} bytes, more than the archive holds")
        data = bytearray(info.file_size)  # read in place: frombuffer needs a writable buffer
        with z.open(record) as f:
            if f.readinto(data) != len(data):
                return name, NotRead(f"its record {record} ends early")
        if payload.get("use_pickle"):
            return name, saved_item(bytes(data))
        return name, _raw_tensor(data, payload["tensor_meta"])
    except Exception as e:  # noqa: BLE001  (a damaged record or config fails in many ways)
        return name, NotRead(f"could not be read ({type(e).__name__}: {first_sentence(e)})")
