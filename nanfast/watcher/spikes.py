"""Spike alarms (events of kind "spike"): a loss or the total gradient norm jumping far above its running
median, a module's gradient norm exploding above its own, or its share of the modules' falling far below
its usual one (vanishing). Judged on the host from
the values the step's one read brought back (see NOTE: [Spikes]); no host read of their own."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch

from .. import _C
from .events import MODEL, Event, Place

SPIKE_ACTIONS = ("warn", "raise", "record", "skip")


class SpikeError(RuntimeError):
    """Raised by a watch made with ``spikes=SpikeOptions(action="raise")`` at a spike.

    Args:
        event: the spike's Event (kept as ``.event``; its summary is the message)."""

    def __init__(self, event: Event):
        self.event = event
        super().__init__(event.summary())


@dataclasses.dataclass(frozen=True)
class SpikeOptions:
    """What counts as a spike, and what the watch does about one.

    A series (each loss given to ``Watch.loss``, the total gradient norm, each module's gradient norm)
    spikes at a step when its value is more than ``factor`` times its running median over its last
    ``window`` finite values (checked steps), once it has ``warmup`` of them, and its excess over that
    median is more than twice the largest in the window (a converged classifier's loss jumps 26x at a
    hard batch now and then: those recur, so the window holds them); a module's gradient norm
    vanishes when its share of the median of the step's positive module gradient norms stays below its
    running median share divided by ``factor`` for ``vanishing_steps`` checked steps in a row (one step
    is noise: a small layer's gradient over a small batch can dip that low now and then; a converging
    run, whose gradients all fall together, keeps its shares). (A series that can be negative,
    or whose interquartile range exceeds two thirds of its level, is judged by its excess over the
    median: more than ``factor - 1`` times max(|median|, 1.5 x its interquartile range), or, where both
    are 0, its largest |value|; a window of zeros judges no spike.) An alarm fires once per
    excursion: the series must come back within the threshold before it can fire again.

    ``action``: "warn" (a RuntimeWarning; the watch's callable ``action``, if it has one, gets the
    event too), "raise" (``SpikeError`` from the step's read: eager, before the optimizer applies the
    step), "record" (only ``w.events`` and the history), "skip" (skip the optimizer step as the watch's
    action="skip" does, which it needs, with sync="eager"), or a callable taking the Event."""

    factor: float = 10.0
    window: int = 100
    warmup: int = 20
    vanishing_steps: int = 10
    loss: bool = True
    grad_norm: bool = True
    modules: bool = True
    action: Union[str, Callable[[Event], Any]] = "warn"

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and self.factor > 1 and math.isfinite(self.factor)):
            raise ValueError(f"nanfast.watch: spikes factor must be a finite number > 1, got {self.factor!r}")
        for name in ("window", "warmup", "vanishing_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"nanfast.watch: spikes {name} must be an int >= 1, got {value!r}")
        for name in ("loss", "grad_norm", "modules"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"nanfast.watch: spikes {name} must be True or False, got {getattr(self, name)!r}")
        if self.warmup > self.window:
            raise ValueError(f"nanfast.watch: spikes warmup ({self.warmup}) must not exceed window ({self.window})")
        if not callable(self.action) and self.action not in SPIKE_ACTIONS:
            raise ValueError(f"nanfast.watch: spikes action must be one of {SPIKE_ACTIONS} or a callable, "
                             f"got {self.action!r}")


def spike_options(spikes: Union[bool, Mapping, SpikeOptions], action: Any, sync: str) -> Optional[SpikeOptions]:
    """The ``spikes=`` option as SpikeOptions (None: off), given the watch's ``action`` and ``sync``.

    Raises:
        TypeError: not a bool, a mapping of SpikeOptions fields, or SpikeOptions.
        ValueError: a field out of its allowed values, or action "skip" without the watch's skip."""
    if isinstance(spikes, bool):
        options = SpikeOptions() if spikes else None
    elif isinstance(spikes, Mapping):
        options = SpikeOptions(**spikes)
    elif isinstance(spikes, SpikeOptions):
        options = spikes
    else:
        raise TypeError(f"nanfast.watch: spikes must be a bool, a dict of SpikeOptions fields or a SpikeOptions, "
                        f"got {type(spikes).__name__}")
    if options is not None and options.action == "skip" and (action != "skip" or sync != "eager"):
        # The skip of a healthy step uses the watch's own: gradients held back before the optimizer
        # step and the forward's buffer writes put back, both set up by action="skip" and decided on
        # the host before the step (a lagged watch's on-device skip only sees the non-finite flag).
        raise ValueError("nanfast.watch: spikes action 'skip' needs the watch's action='skip' and sync='eager'")
    return options


class ModuleGroups:
    """Each gradient's owning module (the parameter name less its last part), as the index the step's
    summary sums the gradients' squared norms by (see NOTE: [The step's summary in one call])."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._classes: dict[str, str] = {}
        self._key: Optional[tuple[str, ...]] = None
        self._names: tuple[str, ...] = ()
        self._index: Optional[torch.Tensor] = None

    def module_class(self, name: str) -> str:
        return self._classes.get(name, "")

    def index(self, grad_names: tuple[str, ...], device: torch.device) -> tuple[tuple[str, ...], torch.Tensor]:
        """Which module each gradient belongs to (made once per set of names).

        Args:
            grad_names: the gradients' parameter names ("param[i]" for a parameter outside the model
                is its own group).
            device: where the index goes (the fused pass's results).

        Returns:
            The modules' names, in order of first appearance, and each gradient's module number (int64
            [len(grad_names)] on `device`)."""
        key = tuple(grad_names)  # the pass hands out the same tuple while its names stay the same
        if (key is not self._key and key != self._key) or self._index is None or self._index.device != device:
            # The model as it is now (a head swapped in after watch(): NOTE: [A model changed after watch()]).
            self._classes = {name: type(module).__name__ for name, module in self._model.named_modules()}
            params = {name for name, _ in self._model.named_parameters()}
            owners = [name.rpartition(".")[0] if name in params else name for name in key]
            order = {name: i for i, name in enumerate(dict.fromkeys(owners))}
            self._key, self._names = key, tuple(order)
            self._index = torch.tensor([order[o] for o in owners], dtype=torch.long, device=device)
        return self._names, self._index


class Spikes:
    """The spike detectors of one watch: each series' window and alarms, kept in C++ (see NOTE: [Spike
    windows in C++]), and which series each window stands for."""

    def __init__(self, options: SpikeOptions, groups: ModuleGroups):
        self.options = options
        self.groups = groups
        self._windows = _C.SpikeWindows(options.window, float(options.factor), options.warmup, options.vanishing_steps)
        self._ids: dict[tuple, int] = {}  # series key -> window id
        self._names: Optional[tuple] = None  # the last step's series names, and for them:
        self._keys: list[tuple] = []  # each series' key, in judging order
        self._key_ids: list[int] = []  # and its window id
        self._seen: set[str] = set()  # every module that has had a gradient
        self._total_windows = 0  # the total gradient norm's windows so far, less one

    def observe(self, step: int, losses: Mapping[str, float], grad_norm: Optional[float],
                modules: Mapping[str, float]) -> Optional[Event]:
        """Judges one healthy checked step's values and adds them to the windows.

        Returns:
            The step's spike event (every series that spiked, the first in phase order), or None."""
        # NOTE: [Spikes]
        # A running median over the last `window` values, not a mean: a spike does not drag the
        # threshold up for the steps after it, and a smooth trend (a loss going down, a gradient norm
        # growing over the first steps) moves the median with it. The threshold is a ratio to that
        # median, which a user can reason about ("10x the usual"), with the interquartile range as a
        # floor for series near zero or below. An alarm fires when a series crosses the
        # threshold and re-arms only once it is back under it: one event per excursion, not one per
        # step while a wrecked run stays high.
        opts = self.options
        names = (tuple(losses) if opts.loss else (), opts.grad_norm and grad_norm is not None,
                 tuple(modules) if opts.modules else ())
        if names != self._names:  # the series keys and ids, made again only when the names change
            self._names = names
            # Modules with gradients never seen before (a backbone unfrozen, a head added) add their norms
            # to the total from now on: a step up that is no spike. The total starts a new window.
            if not self._seen.issuperset(names[2]):
                self._total_windows += bool(self._seen)
                self._seen.update(names[2])
            # A module's norm is two series: its spikes, and its share for vanishing (NOTE: [Vanishing as a
            # share] in csrc/python/spike_windows.cpp); modules in backward order (the model's reversed),
            # so that the one nearest the output, where a cut-off gradient starts, is named first.
            modules_backward = names[2][::-1]
            self._keys = [*(("loss", name) for name in names[0]),
                          *((("grad_norm", "", self._total_windows),) if names[1] else ()),
                          *(("module", name) for name in modules_backward),
                          *(("module share", name) for name in modules_backward)]
            self._key_ids = [self._id(key) for key in self._keys]
        if not self._keys:
            return None
        module_values = tuple(modules.values())[::-1] if opts.modules else ()
        values = [*(losses.values() if opts.loss else ()), *((grad_norm,) if names[1] else ()), *module_values,
                  *module_values]
        fired = self._windows.observe(self._key_ids, values)
        if not fired:
            return None
        vanishing = any(direction == "down" for _, direction, _, _ in fired)
        found = [self._describe(self._keys[i], direction, values[i], median, judged)
                 for i, direction, median, judged in fired]
        rule = (f" (running medians of the last {opts.window} checked steps at most; threshold {opts.factor:g}x"
                + (f", vanishing: below 1/{opts.factor:g} for {opts.vanishing_steps} steps in a row)" if vanishing else ")"))
        return Event(step, found[0][0], tuple(p for p, _ in found[1:]), kind="spike",
                     detail="; ".join(text for _, text in found) + rule)

    def _id(self, key: tuple) -> int:
        """The window of series `key`, made at its first value (a module's can also vanish)."""
        if key not in self._ids:
            self._ids[key] = self._windows.add(key[0] == "module share")
        return self._ids[key]

    def _describe(self, key: tuple, direction: str, value: float, median: float, judged: float) -> tuple[Place, str]:
        kind, name = key[:2]
        if kind == "loss":
            place, what = Place("loss_value", name, "", 0, 0, 0), f"loss {name!r}"
        elif kind == "grad_norm":
            place, what = Place("grad", "", "", 0, 0, 0), "the total gradient norm"
        else:
            cls = self.groups.module_class(name)
            place = Place("grad", name, cls, 0, 0, 0)
            what = f"the gradient norm of {name or MODEL}" + (f" ({cls})" if cls else "")
        if direction == "down":  # judged on its share of the modules' median gradient norm
            share = judged
            ratio = f"1/{median / share:.3g} of" if share > 0 else "against"
            return place, (f"{what} vanished to {value:.4g}, {share:.3g} of the modules' median gradient norm "
                           f"({ratio} its running median share {median:.3g})")
        ratio = f"{value / median:.3g}x" if median > 0 else f"{value - median:.4g} above"
        label = "exploded" if kind == "module" else "spiked"
        return place, f"{what} {label} to {value:.4g} ({ratio} its running median {median:.4g})"
