"""Loading the compiled extension (nanfast._C) first, so that a checkout never built, or built against
another torch, says so and what to run, instead of a "circular import" or a missing libc10_cuda.so
from whichever module imported _C first (a probe, session 43)."""

from __future__ import annotations

import importlib.machinery
import os
import warnings

import torch

REBUILD = ("pip install --no-build-isolation -e .  (in the nanfast checkout; a nanfast installed from a wheel or "
           "an sdist: install it again from its source with --no-build-isolation, this torch installed; see the "
           "README's Quick start)")


def build_record() -> dict | None:
    """The record setup.py wrote when it built the extension (nanfast/_build.py), or None for a build
    that did not go through setup.py."""
    try:
        from ._build import BUILD
    except ImportError:
        return None
    return dict(BUILD)


def other_torch() -> str | None:
    """The torch version the extension was built against, as its record says, when it is not the one
    running; else None (the same one, or no record)."""
    record = build_record()
    built = record.get("torch") if record is not None else None
    return built if built != torch.__version__ else None


def load() -> None:
    """Imports nanfast._C; warns when it was built against another torch than the one running.

    Raises:
        ImportError: the extension is not built, or cannot be loaded with this torch (the message says
            which, and the command that builds it).
        RuntimeError: NANFAST_CPU_ISA or NANFAST_CPU_PREFETCH holds a value they do not take."""
    try:
        from . import _C  # registers torch.ops.nanfast
    except ImportError as e:
        raise ImportError(_why_not(e)) from None  # the message holds what the first error said
    # The CPU kernel table, chosen now: a bad NANFAST_CPU_ISA or NANFAST_CPU_PREFETCH is named here, not
    # in the first check's error, where it was put on whichever tensor came first.
    _C.cpu_isa()
    built = other_torch()
    if built is not None:
        warnings.warn(f"nanfast: its extension was built against torch {built}, and torch {torch.__version__} is "
                      f"running: if anything fails, rebuild it: {REBUILD}", UserWarning, stacklevel=3)


def _why_not(error: ImportError) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    built = [name for name in os.listdir(here)
             if name.startswith("_C.") and name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))]
    if not built:
        return f"nanfast: its compiled extension (nanfast/_C) is not built in {here}: build it with {REBUILD}"
    against = other_torch()
    if against is not None:
        return (f"nanfast: its extension ({built[0]}) was built against torch {against}, and torch "
                f"{torch.__version__} is running, which cannot load it ({error}): rebuild it with {REBUILD}")
    return f"nanfast: its extension ({built[0]}) could not be loaded ({error}): rebuild it with {REBUILD}"
