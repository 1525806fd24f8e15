"""The health timeline: a `StepRecord` per checked step (loss, norms, counts, events), made from the
values the step's one read brought back; the watch's bounded `history`, `save()` as JSON Lines, and the
`log_to=` sinks (a JSONL stream, a TensorBoard SummaryWriter, any callable such as wandb.log). Also the
extra values packed after the summary for it (see `Tail`)."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import errno
import gc
import json
import math
import os
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional, Union

import torch

from .events import Event

DEFAULT_HISTORY = 10000


class Tail(NamedTuple):
    """What follows the fixed summary in a step's packed read: the mean of each loss given to
    Watch.loss, the GradScaler's scale, each module's gradient norm; and which norms were computed."""

    losses: tuple[str, ...] = ()
    scale: bool = False
    modules: tuple[str, ...] = ()
    grads: bool = False
    params: bool = False

    @staticmethod
    def scale_kept(scale: Any, device: torch.device) -> Optional[torch.Tensor]:
        """The GradScaler's scale tensor if the tail can hold it: on `device` (another device would cost
        a sync), one value; else None."""
        return scale if isinstance(scale, torch.Tensor) and scale.device == device and scale.numel() == 1 else None

    def unpack(self, tail: list[float]) -> tuple[dict[str, float], Optional[float], dict[str, float]]:
        """The losses, the scale and the modules' norms from the tail's values."""
        n = len(self.losses)
        scale = tail[n] if self.scale else None
        n += self.scale
        return dict(zip(self.losses, tail[:len(self.losses)])), scale, dict(zip(self.modules, tail[n:]))


def _number(x: Optional[float]) -> Optional[float]:
    return x if x is None or math.isfinite(x) else None  # JSON has no NaN/inf: null


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One checked step of the health timeline. Norms are of the finite elements (as ``w.stats()``);
    None where not known (no gradients, the value not checked). ``loss`` is the first name given to
    Watch.loss this step (its mean over its elements and microbatches), ``losses`` every name's."""

    step: int
    loss: Optional[float] = None
    losses: Mapping[str, float] = dataclasses.field(default_factory=dict)
    grad_norm: Optional[float] = None
    param_norm: Optional[float] = None
    grad_max_abs: Optional[float] = None
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    headroom: Optional[float] = None
    headroom_place: Optional[str] = None
    loss_scale: Optional[float] = None
    skipped: bool = False
    scaler_skipped: bool = False
    rolled_back: bool = False
    events: tuple[Event, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Returns:
            The record as the JSON object of a JSON Lines timeline (non-finite numbers become null:
            JSON has none; the counts and events say what happened)."""
        return {
            "step": self.step, "loss": _number(self.loss),
            "losses": {name: _number(v) for name, v in self.losses.items()},
            "grad_norm": _number(self.grad_norm), "param_norm": _number(self.param_norm),
            "grad_max_abs": _number(self.grad_max_abs), "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf,
            "headroom": _number(self.headroom), "headroom_place": self.headroom_place,
            "loss_scale": _number(self.loss_scale), "skipped": self.skipped, "scaler_skipped": self.scaler_skipped,
            "rolled_back": self.rolled_back,
            "events": [{"kind": e.kind, "phase": e.phase, "name": e.name, "summary": e.summary()} for e in self.events],
        }

    def scalars(self) -> dict[str, float]:
        """Returns:
            The record's numbers for a logger, flat, keyed "nanfast/<name>" (losses "nanfast/loss/<name>");
            unknown values left out."""
        values: dict[str, Any] = {
            "step": self.step, "loss": self.loss, "grad_norm": self.grad_norm, "param_norm": self.param_norm,
            "grad_max_abs": self.grad_max_abs, "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf,
            "headroom": self.headroom, "loss_scale": self.loss_scale, "skipped": self.skipped,
            "scaler_skipped": self.scaler_skipped, "rolled_back": self.rolled_back, "events": len(self.events),
        }
        values.update({f"loss/{name}": v for name, v in self.losses.items()})
        return {f"nanfast/{key}": float(v) for key, v in values.items() if v is not None}


def record(step: int, summary: list[float], tail: Tail, losses: dict[str, float], scale: Optional[float],
           **flags: Any) -> StepRecord:
    """The record of a step from its read: `summary` the values of SUMMARY (watcher/step.py) in its
    order, the tail unpacked; `flags`: skipped, scaler_skipped, events."""
    nan, posinf, neginf, grad_norm, grad_max_abs, param_norm = summary[1:7]  # SUMMARY[1:7], in that order
    return StepRecord(
        step=step, loss=next(iter(losses.values()), None), losses=losses,
        grad_norm=grad_norm if tail.grads else None, param_norm=param_norm if tail.params else None,
        grad_max_abs=grad_max_abs if tail.grads else None,
        nan=int(nan), posinf=int(posinf), neginf=int(neginf), loss_scale=scale, **flags)


def header(model_class: str, headroom_thresholds: tuple[float, ...]) -> dict[str, Any]:
    """The first line of a timeline file (no "step" key: readers skip it); the plot draws the headroom
    thresholds."""
    from .. import __version__

    return {"nanfast": __version__, "model": model_class, "headroom_thresholds": list(headroom_thresholds),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _line(obj: dict) -> str:
    return json.dumps(obj, allow_nan=False) + "\n"


class _Stream:
    """A JSON Lines file written a line per checked step, flushed each time; one writer per file in a
    process (two watches' lines interleaved mid-record made a file no reader could parse)."""

    # The real paths streams of this process are writing: a stream dropped with its watch (never removed)
    # leaves, its file closed with it (the path stayed taken for the life of the process: a probe, session 43).
    _open: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    @staticmethod
    def refuse_taken(paths: list) -> None:
        """Raises ValueError if a file of `paths` is written by a stream of this process, or named twice,
        and what open() would raise if one is a directory or lies in none: before any is opened, so a bad
        second entry leaves the first file as it was (it was truncated: a probe, session 44)."""
        seen: set[str] = set()
        for path in paths:
            real = os.path.realpath(path)
            if real in _Stream._open:
                # A watch dropped with its model without remove() is a reference cycle (the model's hooks
                # hold it), freed only by the cyclic collector: a sweep making a model and a watch on one
                # path per run was refused until a collection happened to run (a probe, session 45).
                gc.collect()
            if real in _Stream._open or real in seen:
                raise ValueError(f"nanfast.watch: log_to {os.fspath(path)!r} is already written by another watch in "
                                 "this process (or named twice); give each watch its own file (or remove() the other "
                                 "watch first)")
            if os.path.isdir(real):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
            if not os.path.isdir(os.path.dirname(real)):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
            seen.add(real)

    def __init__(self, path: Union[str, os.PathLike], first: dict):
        """Opens `path` for writing (Timeline has refused the paths taken first: refuse_taken)."""
        self._path = os.path.realpath(path)
        self._file = open(path, "w", encoding="utf-8")
        _Stream._open[self._path] = self
        self._file.write(_line(first))
        self._file.flush()

    def __call__(self, rec: StepRecord) -> None:
        self._file.write(_line(rec.to_dict()))
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
            _Stream._open.pop(self._path, None)


def _give(sink: Callable[[StepRecord], None], rec: StepRecord) -> None:
    """Gives a record to one sink. A sink that raises (a logger's lost connection) is warned about and
    the step goes on: a logging failure must not cancel a healthy step's update, keep the record from
    the other sinks, or hide the NonFiniteError of a bad step being raised."""
    try:
        sink(rec)
    except Exception as e:  # noqa: BLE001  (any logger's error)
        warnings.warn(f"nanfast.watch: a log_to sink raised {type(e).__name__}: {e}; the records it raised on are "
                      "not in it (training, the watch and the other sinks go on)", RuntimeWarning, stacklevel=2)


def _opener(target: Any) -> Callable[[dict], Callable[[StepRecord], None]]:
    """What makes the sink of one `log_to` entry from the header: checked for every entry before any
    file is opened (a bad second entry must not leave the first file truncated)."""
    if isinstance(target, (str, os.PathLike)):
        return lambda first: _Stream(target, first)
    add_scalar = getattr(target, "add_scalar", None)
    if callable(add_scalar):  # a TensorBoard SummaryWriter (or anything with its method)
        return lambda first: lambda rec: [add_scalar(key, value, global_step=rec.step)
                                          for key, value in rec.scalars().items()]
    if callable(target):  # wandb.log, mlflow.log_metrics, ...
        return lambda first: lambda rec: target(rec.scalars())
    raise TypeError(f"nanfast.watch: log_to entries must be a path (str or os.PathLike), an object with add_scalar "
                    f"(a SummaryWriter) or a callable taking a dict, got {type(target).__name__}")


class Timeline:
    """A watch's records: the last `keep` kept in memory, each also sent to the `log_to` sinks."""

    def __init__(self, keep: Any, log_to: Any, model_class: str, headroom_thresholds: tuple[float, ...]):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise ValueError(f"nanfast.watch: history must be an int >= 0 (records kept; 0 keeps none), got {keep!r}")
        self._header = (model_class, headroom_thresholds)
        self._kept: collections.deque = collections.deque(maxlen=keep)  # StepRecords, or record()'s arguments
        targets = [] if log_to is None else list(log_to) if isinstance(log_to, (list, tuple)) else [log_to]
        openers = [_opener(target) for target in targets]
        _Stream.refuse_taken([t for t in targets if isinstance(t, (str, os.PathLike))])
        first = header(*self._header)
        self._sinks: list[Callable[[StepRecord], None]] = []
        try:
            for opener in openers:
                self._sinks.append(opener(first))
        except BaseException:
            self.close()
            raise
        self.wanted = keep > 0 or bool(self._sinks)

    def add(self, *args: Any, **flags: Any) -> None:
        """Adds the record of a step, given as `record`'s arguments."""
        # NOTE: [Records made when read]
        # Without a sink nothing needs a record until `records` is read, so its arguments are kept and
        # the StepRecord is made then: built at every step's end (a frozen dataclass of 16 fields, where
        # each line pays cold caches) it cost 18 us a step inside the watch suite's small transformer.
        if self._sinks:
            rec = record(*args, **flags)
            if self._kept.maxlen:
                self._kept.append(rec)
            for sink in self._sinks:
                _give(sink, rec)
        elif self._kept.maxlen:
            self._kept.append((args, flags))

    @property
    def records(self) -> list[StepRecord]:
        """The kept records, oldest first."""
        kept = self._kept
        for i in range(len(kept) - 1, -1, -1):  # the ones not made yet are the newest
            if not isinstance(kept[i], tuple):
                break
            args, flags = kept[i]
            kept[i] = record(*args, **flags)
        return list(kept)

    def save(self, path: Union[str, os.PathLike]) -> None:
        if os.path.realpath(path) in _Stream._open:  # truncated under the stream, which wrote on at its offset
            raise ValueError(f"nanfast.watch: save({os.fspath(path)!r}): a log_to stream of this process is writing "
                             "that file (it holds every record already); save to another path")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_line(header(*self._header)))
            f.writelines(_line(rec.to_dict()) for rec in self.records)

    def close(self) -> None:
        for sink in self._sinks:
            if isinstance(sink, _Stream):
                sink.close()
        self._sinks = []
