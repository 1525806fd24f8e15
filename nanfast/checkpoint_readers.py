"""Reading checkpoint files without running pickled code, one format each: torch.save files (zip or
legacy, weights-only, numpy arrays allowed, other libraries' objects read as data), safetensors files and numpy's .npy/.npz, as (name, tensor
or array) pairs; and the errors that say why a file is not read (`Refused`, `Unreadable`). nanfast.scan
checks what they give."""

from __future__ import annotations

import _compat_pickle
import contextlib
import importlib
import io
import os
import pickle
import pickletools
import re
import stat
import sys
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch

from . import _tree

# A legacy (non-zip) torch.save file begins with a pickle of this number.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C.to_bytes(10, "little")


class Refused(Exception):
    """nanfast will not read the file: its pickle asks to run code, it holds a numpy array of Python objects,
    or it is not a regular file."""


class Unreadable(Exception):
    """The file cannot be read here; the message says what it is and why."""


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


def _zip_directory(path: str) -> Optional[list[zipfile.ZipInfo]]:
    """The records a zip lists (its directory, read once for all torch_load asks of it), or None when
    Python's zipfile cannot read it (then torch's reader says what is wrong)."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.infolist()
    except zipfile.BadZipFile:
        return None


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


# NOTE: [numpy arrays in checkpoints]
# A checkpoint may hold numpy arrays: the HF Trainer's rng_state.pth keeps numpy's RNG state, and a
# hand-made checkpoint may keep weights or statistics as arrays. Weights-only loading refuses them
# unless numpy's array reconstruction is allowed: `_reconstruct` makes an empty array of a class,
# `numpy.dtype` a dtype from its code (its class's state set), and the array's state is set from bytes;
# none runs code named by the file (an object array's items are loaded by the same restricted
# unpickler), so they are allowed here, under their numpy 2 and numpy 1 names; so is `scalar`, which makes
# a numpy scalar (a saved `np.mean(losses)`) from a dtype and its bytes. Numeric arrays and scalars are
# checked as tensors, as check_all reads them (check.values_tensor: no copy); others are listed as not
# checked. .npy and .npz files are read with allow_pickle=False.
def _numpy_globals() -> list:
    try:
        import numpy as np
    except ImportError:
        return []
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    reconstruct, scalar = multiarray._reconstruct, multiarray.scalar
    dtypes = [getattr(np.dtypes, name) for name in getattr(np.dtypes, "__all__", ())]  # a dtype's state is set too
    return [reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"), scalar,
            (scalar, "numpy.core.multiarray.scalar"), np.ndarray, np.dtype, *dtypes]


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
    # inflating to 3.7 GB was read whole: a probe, session 44).
    sizes = {record.filename: record.file_size for record in _zip_directory(path) or ()}
    available = available_memory()
    with loaded:
        for name in loaded.files:
            size = sizes.get(f"{name}.npy", sizes.get(name, 0))
            if available is not None and size > available:
                yield name, NotRead(f"it inflates to {_mib(size)}, more than the {_mib(available)} of memory available")
                continue
            try:
                array = loaded[name]
            except ValueError as e:
                if not _holds_objects(e):
                    raise
                yield name, NotRead(_OBJECTS)
                continue
            yield name, array


_OBJECTS = "it holds an array of Python objects (a pickle), which nanfast does not load"


def _holds_objects(e: ValueError) -> bool:
    """Whether numpy refused an array because it holds Python objects (its two messages: loading with
    allow_pickle=False, and a .npy's memory-mapping)."""
    return "Object arrays cannot be loaded when allow_pickle=False" in str(e) or "Python objects in dtype" in str(e)


# NOTE: [Other libraries' objects in checkpoints]
# A checkpoint may pickle objects of other libraries: the HF Trainer's training_args.bin is a
# TrainingArguments holding transformers' and accelerate's enums and configs. Weights-only loading
# refuses every class it does not know, and loading the file for real would import those libraries and
# run their code on the file's say-so; refusing it made a scan of every healthy Trainer checkpoint
# directory exit 2. So the classes and functions a file names are given inert stand-ins (a StandIn: a
# dict of the arguments and the state the file gives the object), registered under the names the file
# uses: nothing is imported, nothing the file names runs, and the values in them (a learning rate, a
# stored loss) are checked as anywhere else; the names are listed with the scan's result. A file that
# names anything of a module whose objects run code (os, subprocess, builtins, ...) is refused as
# before: no checkpoint needs them, and a hostile pickle does. Legacy (non-zip) files are not listed
# this way (torch cannot list their globals) and stay refused. The list below is of the modules known
# to load, run or compile code; a name it does not hold is read as data and listed with the result,
# which is what to read before loading the file with weights_only=False (a class's own __setstate__
# runs then, which no list can vouch for).
_CODE_MODULES = frozenset({
    "os", "posix", "nt", "sys", "subprocess", "_posixsubprocess", "builtins", "__builtin__", "shutil", "socket",
    "importlib", "imp", "zipimport", "pkgutil", "runpy", "site", "sysconfig", "pty", "code", "codeop", "ctypes",
    "pickle", "_pickle", "shelve", "marshal", "types", "webbrowser", "pydoc", "pdb", "bdb",
    "trace", "timeit", "profile", "cProfile", "platform", "io", "_io", "operator", "tempfile", "glob", "tarfile",
    "zipfile", "signal", "multiprocessing", "threading", "_thread", "concurrent", "asyncio", "urllib", "http",
    "ftplib", "smtplib", "telnetlib", "xmlrpc", "requests", "distutils", "setuptools", "pip", "dill",
    "cloudpickle", "joblib", "yaml", "IPython", "sympy", "numexpr"})
# And the parts of other packages that load or run code (torch.hub.load, cpp_extension.load_inline,
# numpy.testing's runstring, torch.load itself and torch.storage._load_from_bytes, which calls it without
# weights_only; torch.fx's GraphModule, rebuilt by executing its source; the compilers), by dotted prefix.
_CODE_PREFIXES = ("torch.hub", "torch.utils.cpp_extension", "torch._dynamo", "torch._inductor", "torch.fx",
                  "torch.jit", "torch.package", "torch.export", "torch._export", "torch.library",
                  "torch.serialization", "torch.load", "torch.save", "torch.storage._load_from_bytes", "torch.ops",
                  "torch._ops", "torch.distributed", "torch.multiprocessing", "torch.compile", "torch._C",
                  "torch.utils.collect_env", "torch.utils.data.datapipes", "numpy.testing", "numpy.f2py",
                  "numpy.distutils", "numpy.load", "numpy.lib.format", "numpy.lib.npyio", "numpy.lib._npyio_impl",
                  "numpy.ctypeslib", "pandas.read_pickle", "pandas.io", "uuid._get_command_stdout",
                  "logging.config", "transformers.dynamic_module_utils", "huggingface_hub")


def _runs_code(name: str) -> bool:
    """Whether a global a pickle names belongs to a module whose objects run code (see the NOTE)."""
    return _python3_module(name) in _CODE_MODULES or any(name == p or name.startswith(p + ".") for p in _CODE_PREFIXES)


class StandIn(dict):
    """An object of a class (or the result of a function) a checkpoint names, never imported: the
    arguments (under "args") and the state the file gives it, as data (see NOTE: [Other libraries'
    objects in checkpoints])."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "StandIn":
        self = super().__new__(cls)
        if args:
            self["args"] = args
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # the arguments are kept by __new__
        super().__init__()

    # Hashed as the object it stands for would be by default: an enum member is a dict key in
    # Lightning's saved hyper_parameters (unhashable as a dict, the load failed as "damaged").
    __hash__ = object.__hash__

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.update(state)
        else:
            self["state"] = state


def _python3_module(name: str) -> str:
    """The top-level module of a global a pickle names, under its Python 3 name: a pickle of protocol 2
    (torch.save's default) names some modules by their Python 2 names, which the unpickler maps back
    (subprocess as commands, builtins as __builtin__ or exceptions, pickle as cPickle)."""
    module, _, attribute = name.rpartition(".")
    module, _ = _compat_pickle.NAME_MAPPING.get((module, attribute), (module, attribute))
    top = module.split(".", 1)[0]
    return _compat_pickle.IMPORT_MAPPING.get(top, top).split(".", 1)[0]


def _stand_ins(source: Union[str, io.BytesIO], is_zip: bool) -> list[tuple[type, str]]:
    """A stand-in class for each global the file names that weights-only loading does not allow, under
    its name; none for a file that names a module whose objects run code or whose globals torch cannot
    list (a legacy file)."""
    if not is_zip:
        return []
    if not isinstance(source, str):
        source.seek(0)  # the failed load left it anywhere
    with torch.serialization.safe_globals(_numpy_globals()):  # those are allowed: no stand-in for them
        names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    if any(_runs_code(name) for name in names):
        return []
    # Sorted: torch lists them in a set's order, which changed from run to run what "and 1 more" hid.
    return [(type(name.rsplit(".", 1)[-1], (StandIn,), {"__module__": __name__}), name) for name in sorted(names)]


def is_torch_save(path: str) -> bool:
    """Whether `path` is a regular file that begins as a torch.save file does, whatever its name (a zip
    whose first record is <folder>/data.pkl, or the legacy format's magic number): a directory's
    accelerate `random_states_0.pkl` and `custom_checkpoint_0.pkl` are torch.save files."""
    try:
        if not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            head = f.read(30 + 256)
    except OSError:
        return False
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
    records = _zip_directory(path) if is_zip else None
    if records is not None and _is_torchscript(records):
        return _torchscript_load(path)
    # mmap: tensors stay in the page cache, not copied into memory. Compressed records (torch.load(mmap=
    # True) would take their compressed bytes for values; torch.save never compresses, a re-zipped file
    # does), a zip Python cannot read and the legacy (non-zip) format are read whole.
    mappable = records is not None and all(r.compress_type == zipfile.ZIP_STORED for r in records)
    if records is not None and not mappable:
        _check_inflated_size(records, os.path.getsize(path))
    if records is not None:
        _check_checksums(path)
    return load_weights_only(path, is_zip, records=records if mappable else None)


# NOTE: [Records checked against their checksums]
# torch.load never compares a zip record's bytes with the CRC-32 its directory lists: a torch.save file
# with a flipped byte in a tensor's record loaded, with a wrong but finite value, and was scanned clean (a
# probe, session 42), while a TorchScript or .pt2 file, read through zipfile, said "Bad CRC-32". Every
# record is checked first (zipfile's own test, reading the file once at ~3 GB/s on one core here; the
# values are then read from the page cache). A legacy file and a safetensors file hold no checksums.
def _check_checksums(source: Union[str, io.BytesIO]) -> None:
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


def _check_inflated_size(records: list[zipfile.ZipInfo], file_bytes: int) -> None:
    """Refuses a zip of `file_bytes` whose compressed records, read whole, would take more memory than is
    available: a 3.9 MB file whose one record inflates to 4 GB was read (peak 4.4 GB), and one of 20 MB
    would have the process killed rather than say why.

    Raises:
        Unreadable: their inflated size exceeds the available memory."""
    inflated = sum(r.file_size for r in records if r.compress_type != zipfile.ZIP_STORED)
    available = available_memory()
    if available is not None and inflated > available:
        ratio = inflated / max(1, file_bytes)
        raise Unreadable(f"its compressed records inflate to {_mib(inflated)} ({ratio:.0f}x the file), more than the "
                         f"{_mib(available)} of memory available: nothing was checked (torch.save never compresses; "
                         "an uncompressed copy is read mapped, in no memory)")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


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
        with torch.serialization.safe_globals(_numpy_globals() + stand_ins):  # NOTE: [numpy arrays in checkpoints]
            mapped = records is not None and _records_fit(source, records)
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mapped)

    try:
        try:
            return load([]), ()
        except pickle.UnpicklingError as e:
            if "torch._dynamo" in str(e) and "torch._dynamo" not in sys.modules:
                importlib.import_module("torch._dynamo")  # allows the names a nested jagged tensor's pickle holds
                return load([]), ()
            stand_ins = _stand_ins(source, is_zip) if re.search(r"GLOBAL (\S+)", str(e)) else []
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


class NotRead:
    """An item of a checkpoint that cannot be read, and why (the scan lists it as not checked)."""

    def __init__(self, reason: str):
        self.reason = reason


def saved_item(blob: bytes) -> Any:
    """The object a torch.save's bytes hold (an item inside another format's file), loaded weights-only,
    or NotRead saying why it could not be: a damaged item alone is not read."""
    is_zip = blob.startswith(b"PK\x03\x04")
    try:
        if is_zip:  # see NOTE: [Records checked against their checksums]
            _check_checksums(io.BytesIO(blob))
            with zipfile.ZipFile(io.BytesIO(blob)) as z:
                _check_inflated_size(z.infolist(), len(blob))
        value, _ = load_weights_only(io.BytesIO(blob), is_zip=is_zip)
    except Unreadable as e:
        return NotRead(str(e))
    except Exception as e:  # noqa: BLE001  (a damaged item fails in many ways)
        return NotRead(f"its torch.save could not be read ({type(e).__name__}: {first_sentence(e)})")
    return value


def safetensors_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A .safetensors file's (name, tensor) pairs, read one at a time."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise Unreadable("reading .safetensors needs the safetensors package "
                         "(pip install 'nanfast[safetensors]')") from None
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            try:
                tensor = f.get_tensor(name)
            except Exception as e:  # noqa: BLE001  (one entry of a dtype torch lacks: the others are still read)
                yield name, NotRead(f"it could not be read ({type(e).__name__}: {first_sentence(e)})")
                continue
            yield name, tensor


def is_numpy(obj: Any) -> bool:
    """Whether `obj` is a numpy array or scalar (without importing numpy)."""
    numpy = sys.modules.get("numpy")  # a loaded file holding arrays has imported it
    return numpy is not None and isinstance(obj, (numpy.ndarray, numpy.generic))
