"""Where an op ran: the innermost line of the user's code (outside torch and nanfast), and, for a
backward op, the line where its autograd node's forward op ran; for a line in an installed library,
the line of the user's own code that called into it."""

from __future__ import annotations

import contextlib
import os
import re
import site
import sys
import sysconfig
import warnings
from typing import NamedTuple, Optional

import torch

from .._stack import ENGINE_RUN, frames_up

_FORWARD_SOURCE_KEY = "nanfast.forward_source"


class SourceLine(NamedTuple):
    """A line of the user's code: the innermost frame outside torch and nanfast; when that line is in an
    installed library (transformers' loss functions), `called_from` is the innermost line outside every
    library, the user's own. (A NamedTuple, not a dataclass: one is made per op, and a tuple is the
    cheapest object to make.)"""

    filename: str
    lineno: int
    function: str
    called_from: Optional["SourceLine"] = None

    def __str__(self) -> str:
        line = f"{self.filename}:{self.lineno} in {self.function}"
        return line if self.called_from is None else f"{line} (called from {self.called_from})"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANFAST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# NOTE: [demo code is user code]
# The demo lives inside the package but plays the user: its model's lines are what a report should
# point at, so it is the one nanfast file that user_frame does not skip.
_USER_FILES_IN_PACKAGE = (os.path.join(_NANFAST_DIR, "cli", "demo.py"),)
_internal_by_filename: dict[str, bool] = {}
# Where installed libraries live (site-packages, the standard library): a line there is not the user's.
_LIBRARY_DIRS = tuple({os.path.abspath(d) + os.sep for d in (
    *site.getsitepackages(), site.getusersitepackages(), sysconfig.get_paths()["purelib"],
    sysconfig.get_paths()["platlib"], sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]) if d})
_library_by_filename: dict[str, bool] = {}


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    internal = (path.startswith(_TORCH_DIR) or path.startswith(_NANFAST_DIR)) and path not in _USER_FILES_IN_PACKAGE
    _internal_by_filename[filename] = internal
    return internal


def _internal(filename: str) -> bool:
    internal = _internal_by_filename.get(filename)
    return _is_internal(filename) if internal is None else internal


def _in_library(filename: str) -> bool:
    """Whether `filename` is an installed library's: under site-packages or the standard library, or one
    of the standard library's frozen modules ("<frozen runpy>"); the demo, user code inside the package
    (NOTE: [demo code is user code]), is not, wherever the package is installed."""
    library = _library_by_filename.get(filename)
    if library is None:
        if filename.startswith("<"):
            library = filename.startswith("<frozen ")
        else:
            path = os.path.abspath(filename)
            library = path.startswith(_LIBRARY_DIRS) and path not in _USER_FILES_IN_PACKAGE
        _library_by_filename[filename] = library
    return library


def user_frame() -> Optional[SourceLine]:
    """The innermost frame of the calling thread outside torch and nanfast, and, when that frame is in an
    installed library, the innermost one outside every library as its `called_from`. Walks frames,
    never formats a traceback: it runs per op.

    Returns:
        That frame's line, or None on threads that run no user code (the CUDA autograd workers).
    """
    return _line_of(_first_user_frame(sys._getframe(1))[0])


def backward_lines() -> tuple[Optional[SourceLine], Optional[SourceLine]]:
    """For an op that runs in backward: the line of the Python code autograd called that ran it (a tensor
    or module hook, an autograd.Function's backward; None for torch's own backward formulas), and the
    line that called backward() (as user_frame() answers from outside the engine; None on threads that
    run no user code)."""
    frame, _ = _first_user_frame(sys._getframe(1))
    engine = next((f for f in frames_up(frame) if f.f_code is ENGINE_RUN), None) if ENGINE_RUN else None
    if engine is None:
        return None, _line_of(frame)
    return _line_of(frame), _line_of(_first_user_frame(engine.f_back)[0])


def _line_of(frame) -> Optional[SourceLine]:
    """`frame`'s line (None for None), with the innermost line outside every library as its `called_from`
    when `frame` is in an installed library."""
    if frame is None:
        return None
    code = frame.f_code
    caller = None
    if _in_library(code.co_filename):
        outer = next((f for f in frames_up(frame.f_back)
                      if not (_in_library(f.f_code.co_filename) or _internal(f.f_code.co_filename))), None)
        if outer is not None:
            caller = SourceLine(outer.f_code.co_filename, outer.f_lineno, outer.f_code.co_name)
    return SourceLine(code.co_filename, frame.f_lineno, code.co_name, caller)


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warning issued by the caller point at the user's line (the innermost
    frame outside torch and nanfast), however many of torch's frames (a module's hooks) lie between;
    1 if there is none."""
    frame, level = _first_user_frame(sys._getframe(1))
    return level if frame is not None else 1


# NOTE: [Warnings of events]
# warnings.warn keeps each text it showed in the registry of the module it points at, for the life of the
# process, to show each text once per line. A watch's event warnings name their step, so no text comes
# twice, and the registry only grew: a run with action="warn" whose weight stayed NaN kept 0.7 MB more
# per 1000 steps, which removing the watch or clearing w.events never gave back (a probe, session 45).
# They go through warn_explicit with a registry of their own for each, dropped with it: the filters
# ("ignore", "error", pytest's capture) apply as to any warning, and each is shown, as before.
def warn_at_user_line(message: str, category: type[Warning]) -> None:
    """Warns as warnings.warn(message, category, stacklevel=user_stacklevel()) would, without keeping the
    text in the module's warning registry (see NOTE: [Warnings of events])."""
    frame, _ = _first_user_frame(sys._getframe(1))
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    # No module_globals (warnings.warn passes none either): with them the line's source is asked of the
    # module's loader, and __main__'s in a REPL, `python -c` or a script piped to stdin is BuiltinImporter,
    # which raised ImportError out of optimizer.step() at every warning event (a probe, session 51).
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry={})


def _first_user_frame(frame) -> tuple:
    """The first frame from `frame` outward outside torch and nanfast, and its depth counted from `frame`
    as 1; (None, 0) if none."""
    return next(((f, level) for level, f in enumerate(frames_up(frame), 1) if not _internal(f.f_code.co_filename)),
                (None, 0))


def _record_forward_source(node) -> None:
    # Runs once per autograd node created under locate, right after its forward op returned.
    source = user_frame()
    if source is not None:
        node.metadata[_FORWARD_SOURCE_KEY] = source


def _forward_source_recorder() -> contextlib.AbstractContextManager:
    hook = getattr(torch.autograd.graph, "node_creation_hook", None)
    if hook is not None:
        return hook(_record_forward_source)
    # NOTE: [Forward lines without node_creation_hook]
    # torch 2.11 has no node_creation_hook. Anomaly mode stores each new node's forward stack instead
    # (formatted, so slower: this is locate, not the watch); forward_source() takes the user's line from
    # it. check_nan=False: it checks nothing, and locate's own checks are unchanged. (A finding raised in
    # backward then also comes with torch's warning that prints the node's forward stack.)
    return torch.autograd.set_detect_anomaly(True, check_nan=False)


_ANOMALY_FRAME = re.compile(r'  File "(.*)", line (\d+), in (.*)')


def forward_source(node) -> Optional[SourceLine]:
    """The user's line where `node`'s forward op ran: recorded when the node was made, or taken from
    anomaly mode's stack of it (NOTE: [Forward lines without node_creation_hook]).

    Returns:
        That line, or None where neither was recorded (a node made before locate, or on a thread
        without user code).
    """
    metadata = node.metadata
    source = metadata.get(_FORWARD_SOURCE_KEY)
    if source is not None or "traceback_" not in metadata:
        return source
    frames = [frame for frame in map(_ANOMALY_FRAME.match, reversed(metadata["traceback_"]))  # innermost first
              if frame is not None and not _internal(frame[1])]
    if frames:
        first = frames[0]
        caller = next((SourceLine(f[1], int(f[2]), f[3]) for f in frames if not _in_library(f[1])), None)
        source = SourceLine(first[1], int(first[2]), first[3], caller if _in_library(first[1]) else None)
        metadata[_FORWARD_SOURCE_KEY] = source
        return source
    return None
