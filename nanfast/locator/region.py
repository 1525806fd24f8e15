"""`locate`: the context manager and decorator that runs a region under the dispatch mode and
collects (or raises) its findings."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import warnings
from typing import Any, Optional, Union

import torch

from ..report import NonFiniteError
from .findings import LocateFinding
from .mode import _LocateMode
from .source import _forward_source_recorder

ACTIONS = ("raise", "record")


class Locate(contextlib.ContextDecorator):
    """Context manager and decorator returned by `locate`. `findings` holds what the last (or current)
    entry found, in order; with action="raise" the first one is also raised as NonFiniteError."""

    def __init__(self, action: str = "raise", dump: Optional[Union[str, os.PathLike]] = None):
        if action not in ACTIONS:
            raise ValueError(f"nanfast.locate: action must be one of {ACTIONS}, got {action!r}")
        self.action = action
        self.dump = os.fspath(dump) if dump is not None else None
        if self.dump is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.dump))):
            raise ValueError(f"nanfast.locate: dump={self.dump!r}: its directory does not exist (the dump is saved "
                             "at the first finding, which must not be lost to a bad path)")
        self.findings: list[LocateFinding] = []
        # Producers inside a backward node that what the node returned does not confirm (its gradients
        # were finite, or it received non-finite ones): torch's formulas masking 0/0, or propagation
        # (NOTE: [masked inside a node]). Debug notes, never raised.
        self.masked: list[LocateFinding] = []
        self._mode: Optional[_LocateMode] = None
        self._hook: Optional[Any] = None
        self._lock = threading.Lock()

    @property
    def finding(self) -> Optional[LocateFinding]:
        """The first finding, or None."""
        return self.findings[0] if self.findings else None

    def _dump_path_for_next(self) -> Optional[str]:
        return self.dump if self.dump is not None and not self.findings else None

    def _report(self, finding: LocateFinding, repro: Optional[dict[str, Any]]) -> None:
        path = self._dump_path_for_next()
        if path is not None and repro is not None:
            try:
                torch.save(repro, path)
                finding = dataclasses.replace(finding, dump=path)
            except (OSError, RuntimeError) as e:  # a full disk, a directory gone since: the finding still counts
                warnings.warn(f"nanfast.locate: could not save the dump to {path!r} ({e}); the finding is reported "
                              "without it", RuntimeWarning, stacklevel=2)
        self.findings.append(finding)
        if self.action == "raise":
            raise NonFiniteError(finding, str(finding))

    def __enter__(self) -> Locate:
        with self._lock:
            if self._mode is not None:
                raise RuntimeError("nanfast.locate: this locate() is already active; "
                                   "use a new nanfast.locate() for a nested or concurrent region")
            self._mode = _LocateMode(self)
        self.findings = []
        self.masked = []
        self._hook = _forward_source_recorder()
        self._hook.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        mode = self._mode
        try:
            mode.nodes.close()
            mode.__exit__(*exc)
        finally:
            self._hook.__exit__(*exc)
            self._mode = None
            self._hook = None
        mode.off_path.close(report_alive=exc[0] is None)  # after the mode: a finding reported here may raise
        if exc[0] is None:
            mode.settle_root()


def locate(*, action: str = "raise", dump: Optional[Union[str, os.PathLike]] = None) -> Locate:
    """Checks every ATen op that runs inside it, forward and backward, and reports the first one that
    makes NaN/inf from inputs that held none (see LocateFinding), or the first to consume NaN that came
    from outside (dirty data). Use as ``with nanfast.locate():`` or as a decorator ``@nanfast.locate()``.

    action="raise" (default) raises NonFiniteError(finding) at that op (a forward op off the gradient
    path: once its value matters; see docs/locate.md), with the op's report as message;
    action="record" runs on and collects every finding in ``.findings``. An op inside a backward node is
    reported only if the node returns a non-finite gradient from finite ones (else it goes to ``.masked``:
    torch masks 0/0 in norms, std, atan2, ...); ``finding.diagnosis`` says the pattern in words where
    one is recognized (nanfast.locator.diagnosis). dump="path.pt" saves the first
    reported op's inputs for nanfast.replay(path). Run forward and backward inside it: a backward node's
    forward line is known only for nodes created inside. Each checked op costs one fused check and, on
    CUDA, one host sync.

    Args:
        action: "raise" or "record".
        dump: a path to save the first reported op's inputs to, or None.
    Returns:
        A Locate (a context manager and decorator; ``.findings`` after the region).
    Raises:
        ValueError: action is not one of ACTIONS, or dump's directory does not exist. Inside the region: NonFiniteError at the first finding
        (action="raise"); RuntimeError on entering a Locate that is already active.
    """
    return Locate(action, dump)

