"""Where an op ran: the innermost line of the user's code (outside torch and nanfast), and, for a
backward op, the line where its autograd node's forward op ran."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import NamedTuple, Optional

import torch

_FORWARD_SOURCE_KEY = "nanfast.forward_source"


class SourceLine(NamedTuple):
    """A line of the user's code: the innermost frame outside torch and nanfast. (A NamedTuple, not a
    dataclass: one is made per op, and a tuple is the cheapest object to make.)"""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANFAST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# NOTE: [demo code is user code]
# The demo lives inside the package but plays the user: its model's lines are what a report should
# point at, so it is the one nanfast file that user_frame does not skip.
_USER_FILES_IN_PACKAGE = (os.path.join(_NANFAST_DIR, "cli", "demo.py"),)
_internal_by_filename: dict[str, bool] = {}


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    internal = (path.startswith(_TORCH_DIR) or path.startswith(_NANFAST_DIR)) and path not in _USER_FILES_IN_PACKAGE
    _internal_by_filename[filename] = internal
    return internal


def user_frame() -> Optional[SourceLine]:
    """The innermost frame of the calling thread outside torch and nanfast. Walks frames, never formats
    a traceback: it runs per op.

    Returns:
        That frame's line, or None on threads that run no user code (the CUDA autograd workers).
    """
    frame, _ = _first_user_frame(sys._getframe(1))
    if frame is None:
        return None
    code = frame.f_code
    return SourceLine(code.co_filename, frame.f_lineno, code.co_name)


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warning issued by the caller point at the user's line (the innermost
    frame outside torch and nanfast), however many of torch's frames (a module's hooks) lie between;
    1 if there is none."""
    frame, level = _first_user_frame(sys._getframe(1))
    return level if frame is not None else 1


def _first_user_frame(frame) -> tuple:
    """The first frame from `frame` outward outside torch and nanfast (None if none), and its depth
    counted from `frame` as 1."""
    internal_by_filename = _internal_by_filename
    level = 1
    while frame is not None:
        internal = internal_by_filename.get(frame.f_code.co_filename)
        if internal is None:
            internal = _is_internal(frame.f_code.co_filename)
        if not internal:
            return frame, level
        frame, level = frame.f_back, level + 1
    return None, level


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
    for entry in reversed(metadata["traceback_"]):  # innermost frame last
        frame = _ANOMALY_FRAME.match(entry)
        if frame is not None and not _is_internal(frame[1]):
            source = metadata[_FORWARD_SOURCE_KEY] = SourceLine(frame[1], int(frame[2]), frame[3])
            return source
    return None
