"""Spike alarms (events of kind "spike"): a loss or the total gradient norm jumping far above its running
median, and a module's gradient norm exploding above or vanishing below its own. Judged on the host from
the values the step's one read brought back (see NOTE: [Spikes]); no host read of their own."""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch

from .events import Event, Place

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
    ``window`` finite values (checked steps), once it has ``warmup`` of them; a module's gradient norm
    vanishes when it stays below that median divided by ``factor`` for ``vanishing_steps`` checked
    steps in a row (one step is noise: a small layer's gradient over a small batch can dip that low
    now and then). (A series that can be negative,
    or whose interquartile range exceeds two thirds of its level, is judged by its excess over the
    median: more than ``factor - 1`` times max(|median|, 1.5 x its interquartile range).) An alarm fires once per
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
        self._classes = {name: type(module).__name__ for name, module in model.named_modules()}
        self._params = {name for name, _ in model.named_parameters()}
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
            owners = [name.rpartition(".")[0] if name in self._params else name for name in key]
            order = {name: i for i, name in enumerate(dict.fromkeys(owners))}
            self._key, self._names = key, tuple(order)
            self._index = torch.tensor([order[o] for o in owners], dtype=torch.long, device=device)
        return self._names, self._index


class _Window:
    """The last `size` finite values of one series, also kept sorted: its median and quartiles in O(1),
    an update in O(size) memmove (a few microseconds; no tensor ops per step)."""

    __slots__ = ("recent", "ordered")

    def __init__(self, size: int):
        self.recent: collections.deque[float] = collections.deque(maxlen=size)
        self.ordered: list[float] = []

    def judge(self, x: float, factor: float, warmup: int) -> tuple[bool, bool, float]:
        """(x above the threshold, x below median / factor, the median), judged against the window
        before x joins it (if finite)."""
        o, n = self.ordered, len(self.ordered)
        median = (o[(n - 1) // 2] + o[n // 2]) / 2 if n else math.nan
        ready = n >= warmup and math.isfinite(x)
        above = below = False
        if ready:
            spread = max(abs(median), 1.5 * (o[(3 * n) // 4] - o[n // 4]))  # 1.5 IQR: about 2 MAD for symmetric noise
            above = x - median > (factor - 1) * spread
            below = median > 0 and x < median / factor
        if math.isfinite(x):
            if len(self.recent) == self.recent.maxlen:
                del o[bisect.bisect_left(o, self.recent[0])]
            self.recent.append(x)
            bisect.insort(o, x)
        return above, below, median


class Spikes:
    """The spike detectors of one watch: the series' windows and which of them are in an alarm."""

    def __init__(self, options: SpikeOptions, groups: ModuleGroups):
        self.options = options
        self.groups = groups
        self._windows: dict[tuple, _Window] = {}
        self._alarmed: set[tuple] = set()
        self._low: dict[tuple, int] = {}  # checked steps in a row below median / factor, by series

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
        series: list[tuple[tuple, float]] = []
        if opts.loss:
            series += [(("loss", name), value) for name, value in losses.items()]
        if opts.grad_norm and grad_norm is not None:
            series.append((("grad_norm", ""), grad_norm))
        if opts.modules:
            series += [(("module", name), value) for name, value in modules.items()]
        if not series:
            return None
        found: list[tuple[Place, str]] = []
        vanishing = False
        windows, lows, alarmed = self._windows, self._low, self._alarmed
        for key, value in series:
            window = windows.get(key)
            if window is None:
                window = windows[key] = _Window(opts.window)
            above, below, median = window.judge(value, opts.factor, opts.warmup)
            low = lows[key] = lows.get(key, 0) + 1 if below else 0
            vanished = key[0] == "module" and low >= opts.vanishing_steps
            if not (above or vanished or alarmed):
                continue  # nothing crossed and no alarm to re-arm: a healthy step's every series
            for direction, crossed in (("up", above), ("down", vanished)):
                alarm = (key, direction)
                if not crossed:
                    if math.isfinite(value):
                        alarmed.discard(alarm)
                elif alarm not in alarmed:
                    alarmed.add(alarm)
                    vanishing |= direction == "down"
                    found.append(self._describe(key, direction, value, median))
        if not found:
            return None
        rule = (f" (running medians of the last {opts.window} checked steps at most; threshold {opts.factor:g}x"
                + (f", vanishing: below 1/{opts.factor:g} for {opts.vanishing_steps} steps in a row)" if vanishing else ")"))
        return Event(step, found[0][0], tuple(p for p, _ in found[1:]), kind="spike",
                     detail="; ".join(text for _, text in found) + rule)

    def _describe(self, key: tuple, direction: str, value: float, median: float) -> tuple[Place, str]:
        kind, name = key
        if kind == "loss":
            place, what = Place("loss_value", name, "", 0, 0, 0), f"loss {name!r}"
        elif kind == "grad_norm":
            place, what = Place("grad", "", "", 0, 0, 0), "the total gradient norm"
        else:
            cls = self.groups.module_class(name)
            place = Place("grad", name, cls, 0, 0, 0)
            what = f"the gradient norm of {name or '<model>'}" + (f" ({cls})" if cls else "")
        if direction == "down":
            ratio = f"1/{median / value:.3g} of" if value > 0 else "against"
            return place, f"{what} vanished to {value:.4g} ({ratio} its running median {median:.4g})"
        ratio = f"{value / median:.3g}x" if median > 0 else f"{value - median:.4g} above"
        label = "exploded" if kind == "module" else "spiked"
        return place, f"{what} {label} to {value:.4g} ({ratio} its running median {median:.4g})"
