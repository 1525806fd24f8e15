"""What a checkpoint's pickle may name: numpy's array reconstruction (allowed), other libraries' classes
and functions (inert stand-ins, read as data), and modules whose objects run code (refused)."""

from __future__ import annotations

import _compat_pickle
import io
from typing import Any, Union

import torch


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
def numpy_globals() -> list:
    try:
        import numpy as np
    except ImportError:
        return []
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    reconstruct, scalar = multiarray._reconstruct, multiarray.scalar
    dtypes = [getattr(np.dtypes, name) for name in getattr(np.dtypes, "__all__", ())]  # a dtype's state is set too
    return [reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"), scalar,
            (scalar, "numpy.core.multiarray.scalar"), np.ndarray, np.dtype, *dtypes]


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


def stand_in_classes(source: Union[str, io.BytesIO], is_zip: bool) -> list[tuple[type, str]]:
    """A stand-in class for each global the file names that weights-only loading does not allow, under
    its name; none for a file that names a module whose objects run code or whose globals torch cannot
    list (a legacy file)."""
    if not is_zip:
        return []
    if not isinstance(source, str):
        source.seek(0)  # the failed load left it anywhere
    with torch.serialization.safe_globals(numpy_globals()):  # those are allowed: no stand-in for them
        names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    if any(_runs_code(name) for name in names):
        return []
    # Sorted: torch lists them in a set's order, which changed from run to run what "and 1 more" hid.
    return [(type(name.rsplit(".", 1)[-1], (StandIn,), {"__module__": __name__}), name) for name in sorted(names)]
