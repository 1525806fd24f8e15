"""torch.save files (zip or legacy) and TorchScript archives, loaded weights-only on the CPU: memory-mapped
where their records are checked to fit, other libraries' objects read as data, nothing pickled run."""

from __future__ import annotations

import importlib
import io
import os
import pickle
import pickletools
import re
import sys
import zipfile
from typing import Any, Optional, Union

import torch

from .. import _tree
from . import NotRead, Refused, Unreadable, first_sentence
from .pickle_globals import numpy_globals, stand_in_classes
from .zip_records import check_checksums, check_inflated_size, zip_directory

# A legacy (non-zip) torch.save file begins with a pickle of this number.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C.to_bytes(10, "little")


def _is_torchscript(records: list[zipfile.ZipInfo]) -> bool:
    """Whether a zip is a TorchScript archive (torch.jit.save): its folder holds a constants.pkl record, as
    torch.load tells them (and hands them to torch.jit.load)."""
    return any(r.filename.count("/") == 1 and r.filename.endswith("/constants.pkl") for r in records)


# NOTE: [TorchScript archives]
# A torch.jit.save file is a torch.save zip with more in it: its module pickled in data.pkl (parameters,
# buffers and submodules as attributes of objects of its `__torch__.*` classes) with the tensors' bytes in
# data/, and, pickled the same way, its tensor constants (constants.pkl, constants/); its code/ is
# TorchScript source (a traced model's traced_inputs.pkl names tensors whose records hold no bytes: the
# example inputs are not saved). torch.load hands
# such a file to torch.jit.load, which compiles and runs that code. Instead each pickle is read as the
# torch.save file it would be alone (the pickle as data.pkl, its folder as data/, copied into memory),
# weights-only, its classes read as data through stand-ins (NOTE: [Other libraries' objects in
# checkpoints]): the module's tensors are named as in its state_dict, the constants under their record's
# name ("constants.pkl.0"). The code is never read.
def _torchscript_load(path: str) -> tuple[Any, tuple[str, ...]]:
    """A TorchScript archive's module and tensor constants (see the NOTE), loaded weights-only; torch_load's
    returns and raises."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        # torch's reader, and so torch.jit.load, refuses an archive whose records are not all in one
        # folder, and one without its module: read, either came out "no tensors in it" (a probe, session 44).
        folders = sorted({name.split("/", 1)[0] for name in names})
        if len(folders) > 1:
            raise Unreadable(f"a TorchScript archive whose records lie in {len(folders)} folders ({', '.join(folders[:3])}), "
                             "where torch.jit.save writes one: damaged or crafted (nothing was checked)")
        prefix = folders[0] + "/"
        if prefix + "data.pkl" not in names:
            raise Unreadable("a TorchScript archive without its module's record (data.pkl): damaged (nothing was "
                             "checked)")

        def as_checkpoint(pickle_name: str) -> io.BytesIO:
            folder = prefix + pickle_name[: -len(".pkl")] + "/"
            out = io.BytesIO()
            with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as alone:
                alone.writestr("archive/data.pkl", z.read(prefix + pickle_name))
                for name in names:
                    if name.startswith(folder):
                        alone.writestr("archive/data/" + name[len(folder):], z.read(name))
                    elif name in (prefix + "version", prefix + "byteorder"):
                        alone.writestr("archive/" + name[len(prefix):], z.read(name))
            return out

        loaded = {name: load_weights_only(as_checkpoint(name), is_zip=True)
                  for name in ("data.pkl", "constants.pkl") if prefix + name in names}
    module, stand_ins = loaded.pop("data.pkl", (None, ()))
    others = {name: obj for name, (obj, _) in loaded.items() if obj not in ((), [], {}, None)}
    stand_ins = tuple(dict.fromkeys(stand_ins + tuple(n for _, names_ in loaded.values() for n in names_)))
    if not others:
        return module, stand_ins
    if isinstance(module, dict):  # a StandIn of the module's class: its attributes, then the constants
        return {**module, **others}, stand_ins
    return {"data.pkl": module, **others}, stand_ins


def _not_a_checkpoint(path: str) -> str:
    try:
        with open(path, "rb") as f:
            for _ in pickletools.genops(f):  # parses opcodes only: runs nothing
                pass
    except Exception:  # noqa: BLE001  (a malformed pickle fails in many ways)
        return "not a checkpoint: neither a torch.save file (zip or legacy) nor a pickle (nothing was checked)"
    return ("not a checkpoint: a plain pickle (as pickle.dump writes), not a torch.save file; nanfast loads only "
            "torch.save and .safetensors files (nothing was checked)")


def is_torch_save(path: str, unopened: bool = False) -> bool:
    """Whether `path` is a regular file that begins as a torch.save file does, whatever its name (a zip
    whose first record is <folder>/data.pkl, or the legacy format's magic number): a directory's
    accelerate `random_states_0.pkl` and `custom_checkpoint_0.pkl` are torch.save files. A regular file
    that cannot be opened is `unopened` (a directory's scan reports it as not read, never leaves it out)."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(30 + 256)
    except OSError:
        return unopened
    if head.startswith(b"PK\x03\x04") and len(head) >= 30:
        name_length = int.from_bytes(head[26:28], "little")
        name = head[30:30 + name_length]
        return name.count(b"/") == 1 and name.endswith(b"/data.pkl")
    return LEGACY_MAGIC in head[:32]


def torch_load(path: str) -> tuple[Any, tuple[str, ...]]:
    """A torch.save file's object, loaded weights-only on the CPU (memory-mapped where it can be), with
    the names of the classes and functions of other libraries it holds, read as data (see NOTE: [Other
    libraries' objects in checkpoints]).

    Returns:
        (the object, those names: () for most files).

    Raises:
        Refused: its pickle asks to run code.
        Unreadable: an empty file, or not a torch.save file, or a pickle weights-only loading cannot parse."""
    with open(path, "rb") as f:
        head = f.read(32)
    is_zip = head.startswith(b"PK\x03\x04")
    if not head:
        raise Unreadable("an empty file: nothing to check")
    if not is_zip and LEGACY_MAGIC not in head:
        raise Unreadable(_not_a_checkpoint(path))
    records = zip_directory(path) if is_zip else None
    if records is not None and _is_torchscript(records):
        return _torchscript_load(path)
    # mmap: tensors stay in the page cache, not copied into memory. Compressed records (torch.load(mmap=
    # True) would take their compressed bytes for values; torch.save never compresses, a re-zipped file
    # does), a zip Python cannot read and the legacy (non-zip) format are read whole.
    mappable = records is not None and all(r.compress_type == zipfile.ZIP_STORED for r in records)
    if records is not None and not mappable:
        check_inflated_size(records, os.path.getsize(path))
    if records is not None:
        check_checksums(path)
    return load_weights_only(path, is_zip, records=records if mappable else None)


# NOTE: [Records of a memory-mapped load]
# torch.load(mmap=True) maps the file and takes each storage as the bytes from its record's start, as
# many as the pickle asks for, without comparing that with the record's size (the read without mmap
# refuses a mismatch): a record shorter than its storage would be read on into the zip's next records
# and directory, as values, and a damaged or crafted file called clean. So a load mapped from a file is
# first made onto the meta device (the pickle only: no data read), and each storage's declared size is
# compared with its record's. Sparse and quantized tensors cannot be made there (their rebuild reads
# values): a file holding them is read without the mapping, where torch's reader compares the sizes.
def _records_fit(path: str, records: list[zipfile.ZipInfo]) -> bool:
    """Whether the file can be loaded mapped: its storages checked against `records` (its zip's directory)
    on the meta device (True), or not checkable there (False: load it without mmap).

    Raises:
        Unreadable: a storage's declared size is not its record's.
        pickle.UnpicklingError: as torch.load (a global to give a stand-in, or one that runs code)."""
    pending = getattr(torch._utils, "_sparse_tensors_to_validate", [])
    before = len(pending)
    try:
        meta = torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError:
        raise
    except Exception:  # noqa: BLE001  (a rebuild that needs values: sparse, quantized)
        # torch validates the sparse tensors a load rebuilt at its end, and a failed load leaves its own
        # in that list: the next load then validated these meta ones and failed ("Cannot copy out of
        # meta tensor"), calling a healthy file that holds a sparse tensor, then a quantized one, damaged.
        del pending[before:]
        return False
    size_of = {r.filename.split("/", 1)[1]: r.file_size for r in records if "/" in r.filename}  # within its folder
    reader = torch._C.PyTorchFileReader(path)
    sizes = {reader.get_record_offset(name): (name, size_of.get(name, -1))
             for name in reader.get_all_records() if name.startswith("data/")}
    for leaf in _tree.leaves(meta, shared_once=True):  # linear in the file's size, as the scan's own walk
        if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided or leaf.is_nested:
            continue  # a sparse or nested tensor's parts are strided tensors of their own records
        storage = leaf.untyped_storage()
        record = sizes.get(getattr(storage, "_checkpoint_offset", None))
        if record is not None and record[1] != storage.nbytes():  # none: a meta tensor saved as such
            raise Unreadable(f"its record {record[0]} holds {record[1]} bytes but its pickle asks for "
                             f"{storage.nbytes()}: damaged or crafted (nothing was checked)")
    return True


_NOT_REBUILT = "its pickle holds {kind}, which weights-only loading cannot rebuild: nothing was checked"


def load_weights_only(source: Union[str, io.BytesIO], is_zip: bool,
                      records: Optional[list[zipfile.ZipInfo]] = None) -> tuple[Any, tuple[str, ...]]:
    """torch_load's loading of a torch.save file or bytes, once their format is known (is_zip: the zip
    format, else the legacy one; records: the zip's directory when the file may be memory-mapped, None
    to read it whole); the same returns and raises."""

    def load(stand_ins: list) -> Any:
        if not isinstance(source, str):
            source.seek(0)
        with torch.serialization.safe_globals(numpy_globals() + stand_ins):  # NOTE: [numpy arrays in checkpoints]
            mapped = records is not None and _records_fit(source, records)
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mapped)

    try:
        try:
            return load([]), ()
        except pickle.UnpicklingError as e:
            if "torch._dynamo" in str(e) and "torch._dynamo" not in sys.modules:
                importlib.import_module("torch._dynamo")  # allows the names a nested jagged tensor's pickle holds
                return load([]), ()
            stand_ins = stand_in_classes(source, is_zip) if re.search(r"GLOBAL (\S+)", str(e)) else []
            if not stand_ins:
                raise
            return load(stand_ins), tuple(name for _, name in stand_ins)
    except TypeError as e:
        if "Creating a Tensor subclass" in str(e):
            raise Unreadable(_NOT_REBUILT.format(kind="a tensor subclass of another library")) from None
        raise
    except pickle.UnpicklingError as e:
        if found := re.search(r"GLOBAL (\S+)", str(e)):
            raise Refused(f"its pickle asks to run {found.group(1)}; weights-only loading never runs code from "
                          "a file, and nanfast does not load it any other way") from None
        if re.search(r"Can only (SETITEM|append)", str(e)):
            raise Unreadable(_NOT_REBUILT.format(kind="a subclass of dict or list (a config object?)")) from None
        if found := re.search(r"Unsupported operand \S+", str(e)):
            raise Unreadable(f"its pickle uses an instruction weights-only loading does not read ({found.group(0)}; "
                             "torch.save with pickle_protocol above 2?), so nothing was checked") from None
        raise


def saved_item(blob: bytes) -> Any:
    """The object a torch.save's bytes hold (an item inside another format's file), loaded weights-only,
    or NotRead saying why it could not be: a damaged item alone is not read."""
    is_zip = blob.startswith(b"PK\x03\x04")
    try:
        if is_zip:  # see NOTE: [Records checked against their checksums]
            check_checksums(io.BytesIO(blob))
            with zipfile.ZipFile(io.BytesIO(blob)) as z:
                check_inflated_size(z.infolist(), len(blob))
        value, _ = load_weights_only(io.BytesIO(blob), is_zip=is_zip)
    except Unreadable as e:
        return NotRead(str(e))
    except Exception as e:  # noqa: BLE001  (a damaged item fails in many ways)
        return NotRead(f"its torch.save could not be read ({type(e).__name__}: {first_sentence(e)})")
    return value
