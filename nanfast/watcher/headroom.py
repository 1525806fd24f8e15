"""Overflow headroom: each checked float16, bfloat16 or float8 place's max |x| as a fraction of its dtype's
largest finite value, a warning event (kind "headroom") the first time a place crosses each threshold,
with its growth trend. Read with the step's one read (see NOTE: [Headroom without a host read])."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch

from ..ops import reads_dtype
from .host_copy import HostCopy
from .events import Event, InputEntry, Place
from .options import ignored

# NOTE: [Default headroom thresholds]
# A checked place is a module's output (or a gradient, a parameter): values between two checked places
# can be larger (a residual add of two outputs, a dropout's 1/(1-p), a matmul's sum), so a place still
# below the maximum is not safe. 1/4 leaves two doublings before an overflow: the early warning, while
# the trend says how many steps that is. 1/2 leaves one: a residual add x + f(x) of two such values
# overflows. 0.9 leaves a factor 1.11, which a dropout with p=0.1 already spends. See docs/watch.md.
DEFAULT_THRESHOLDS = (0.25, 0.5, 0.9)
WINDOW = 32  # the recent samples of a place the trend is fitted over
_MIN_SAMPLES = 4  # fewer samples give no trend
# Phases whose values a GradScaler multiplies by its scale (as step._SCALED_PHASES; "grad" only when
# the optimizer unscales inside its own kernel, fused=True).
_SCALED_PHASES = frozenset(("loss", "backward"))


def _low_precision_dtypes() -> list[torch.dtype]:
    """The floating dtypes of 16 bits or fewer that the kernels read and that have a largest finite value
    (float4_e2m1fn_x2 packs two values a byte and saturates: it has none)."""
    def has_max(dtype: torch.dtype) -> bool:
        try:
            return math.isfinite(torch.finfo(dtype).max)
        except (TypeError, RuntimeError):
            return False

    dtypes = {value for value in vars(torch).values() if isinstance(value, torch.dtype)}
    return sorted((d for d in dtypes if d.is_floating_point and d.itemsize <= 2 and reads_dtype(d) and has_max(d)), key=str)


# The dtypes whose headroom is watched and their largest finite values (the recorder's own table,
# max_finite in csrc/python/watch_recorder.cpp, gives the same values; tested).
LIMITS: dict[torch.dtype, float] = {dtype: float(torch.finfo(dtype).max) for dtype in _low_precision_dtypes()}
# The dtype named in a warning, by its largest finite value (float8_e5m2fnuz shares float8_e5m2's 57344).
_NAMES: dict[float, str] = {}
for _dtype, _limit in reversed(list(LIMITS.items())):
    _NAMES[_limit] = str(_dtype).replace("torch.", "")


def thresholds(value: Union[None, float, Iterable[float]]) -> tuple[float, ...]:
    """The ``headroom`` option of nanfast.watch as sorted thresholds; () turns headroom warnings off.

    Args:
        value: None or () (off), one fraction, or fractions of the dtype's largest finite value.

    Returns:
        The distinct thresholds, ascending.

    Raises:
        TypeError: value is not None, a number or an iterable of numbers.
        ValueError: a threshold is not a fraction in (0, 1]."""
    if value is None:
        return ()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = (value,)
    if isinstance(value, (str, bytes)):  # "0.5" would be read character by character
        raise TypeError(f"nanfast.watch: headroom must be None or fractions such as (0.5, 0.9), got {value!r}")
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"nanfast.watch: headroom must be None or fractions such as (0.5, 0.9), got {value!r}") from None
    for t in items:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
            raise ValueError(f"nanfast.watch: headroom thresholds must be fractions in (0, 1] of the dtype's largest "
                             f"finite value, got {t!r} in {value!r}")
    return tuple(sorted({float(t) for t in items}))


# NOTE: [Headroom without a host read]
# The fused op gives every checked tensor's max |x| on the device anyway (the recorder keeps it for the
# low-precision records: see NOTE: [Overflow headroom in the recorder]; the step's fused pass has it
# for parameters and gradients). At the step's end those values are packed into one small float64
# tensor (with the loss scale under a GradScaler) and copied to pinned host memory without blocking,
# before the step's read: in an eager watch the read's own sync has waited for the copy by the time
# the fractions are taken, in a lagged one they are read with the step's read, a step later (flush()
# reads the last one). The division by each dtype's maximum, the per-place maximum over rows and
# microbatches, the trend and the thresholds are host arithmetic on those few numbers. A step with no
# low-precision place packs nothing.

# NOTE: [Headroom under a GradScaler]
# A GradScaler multiplies the loss by its scale so that float16 gradients sit near the top of the range
# on purpose: it doubles the scale every growth_interval steps until they overflow, then halves it. The
# scaled gradients' fraction of the maximum therefore says nothing. Under a watched scaler the scaled
# places (phases loss and backward; grad for a fused optimizer, which unscales in its own kernel) are
# measured at scale 1: their max |x| divided by the scale, the fraction the gradients need before
# scaling. 1 / that fraction is the largest scale that still fits, the scale's headroom: past a
# threshold of 1/4 the scaler can keep no scale above 4, and as the fraction nears 1 it must scale down
# (below 1) and the step's gradients no longer fit float16 at all: exploding gradients, which the
# scaler's halving then hides as skipped steps.


class Pending:
    """One step's max |x| of its low-precision places, on its way to the host: `values` (a HostCopy)
    and, per value, (place key, largest finite value, scaled by the GradScaler, and for a row of the
    input's record (slot, microbatch, row) to name its entry, else None) or None; the loss scale is the
    value at `scale_index`, else the step's summary's (NOTE: [The loss scale read with the summary])."""

    __slots__ = ("values", "keys", "scale_index", "input_rows")

    def __init__(self, values: torch.Tensor, keys: list, scale_index: Optional[int], input_rows: dict[int, int]):
        self.values = HostCopy(values)
        self.keys = keys
        self.scale_index = scale_index
        self.input_rows = input_rows  # slot of an input record -> its rows

    def fractions(self, summary_scale: Optional[float]
                  ) -> dict[tuple, tuple[float, float, bool, Optional[tuple[int, int, int]]]]:
        """Per place key: (largest fraction this step, the dtype's largest finite value, measured at scale 1,
        and for the input (slot, microbatch, row) of the row with that fraction, else None).
        `summary_scale`: the GradScaler's scale as the step's summary read it (None: it holds none), used
        where no scale was copied with the values."""
        values = self.values.tolist()  # enqueued before the step's read, which waited for it: no wait here
        scale = values[self.scale_index] if self.scale_index is not None else summary_scale
        found: dict[tuple, tuple] = {}
        for entry, value in zip(self.keys, values):
            if entry is None:
                continue
            key, limit, scaled, row = entry
            fraction = value / limit
            unscaled = scaled and scale is not None and scale > 0
            if unscaled:
                fraction /= scale
            if key not in found or fraction > found[key][0]:
                found[key] = (fraction, limit, unscaled, row)
        return found


class Headroom:
    """The watch's headroom tracker: per place, recent fractions and the thresholds already crossed."""

    def __init__(self, levels: tuple[float, ...]):
        self.thresholds = levels
        self._samples: dict[tuple, collections.deque] = {}
        self._crossed: dict[tuple, int] = {}  # place key -> how many thresholds it has crossed
        # The last observed step's largest fraction and its place (None without low-precision places).
        self.last: Optional[tuple[float, Place]] = None

    def start(self, step_slots: list, absmax: Optional[torch.Tensor], limited: list, fused: Optional[Any], *,
              params: bool, grads: bool, ignore: tuple[str, ...], scale: Optional[torch.Tensor], grads_scaled: bool,
              device: torch.device, scale_in_summary: bool) -> Optional[Pending]:
        """Starts copying a step's max |x| of its low-precision places to the host.

        Args:
            step_slots: Step.slots, (phase, site, call, microbatch) by slot id.
            absmax, limited: the recorder's (WatchRecorder.take()): max |x| per row of its low-precision
                records, and (slot id, largest finite value or 0) per row.
            fused: the step's fused pass over parameters and gradients, or None.
            params, grads: whether the watch checks parameters / parameter gradients.
            ignore: the watch's ignore patterns (parameter names).
            scale: the GradScaler's scale tensor, or None (no scaler, or one that does not scale).
            grads_scaled: the parameters' gradients are still scaled (a fused optimizer under GradScaler).
            device: where the watch's results are.
            scale_in_summary: the step's summary carries `scale` (Step.pack's Tail): it is read from there.

        Returns:
            The Pending copy, or None when the step checked no low-precision place."""
        keys: list = []
        parts: list[torch.Tensor] = []
        input_rows: dict[int, int] = {}  # input slot -> its rows (every row of a record is in `limited`)
        named_rows: dict[int, int] = {}  # buffers' slot -> the index of its row seen last
        if absmax is not None:
            for slot, limit in limited:
                phase, site, call, microbatch = step_slots[slot]
                row = None
                if phase == "input":  # its entry is named if it warns (see NOTE: [Naming the input's entries])
                    row = (slot, microbatch, input_rows.get(slot, 0))
                    input_rows[slot] = row[2] + 1
                if isinstance(site, tuple):  # a row per named buffer (NOTE: [Buffers a forward writes])
                    index = named_rows[slot] = named_rows.get(slot, -1) + 1
                    name, module_class = site[index], ""
                else:
                    name, module_class = site.name, site.module_class
                keys.append(((phase, name, module_class, call), limit, phase in _SCALED_PHASES, row)
                            if limit else None)
            parts.append(absmax)
        if fused is not None and any(fused.limits):
            names = [("param", n) for n in fused.param_names] + [("grad", n) for n in fused.grad_names]
            for (phase, name), limit in zip(names, fused.limits):
                wanted = params if phase == "param" else grads
                keep = limit and wanted and not ignored(ignore, name)
                keys.append(((phase, name, "", 1), limit, phase == "grad" and grads_scaled, None) if keep else None)
            parts.append(fused.absmax)
        if not any(keys):
            return None
        scale_index = None
        # NOTE: [The loss scale read with the summary]
        # Places measured at scale 1 need the GradScaler's scale. Appended to the max |x| copied to the host,
        # it cost a float64 copy and a cat, two launches in every step of a float16 model under a GradScaler
        # (the fused watch's step 5 ops, with a GPU's bookkeeping); the step's summary holds the scale
        # already (its Tail), read at the same point of the stream, so it is taken from there.
        if scale is not None and not scale_in_summary and any(entry[2] for entry in keys if entry is not None):
            scale_index = len(keys)
            parts.append(scale.detach().reshape(1).to(device=device, dtype=torch.float64))
        with torch.no_grad():  # one part is taken as it is (a cat of one tensor is a copy: a launch on a GPU)
            parts = [p.to(device=device, dtype=torch.float64) for p in parts]
            values = parts[0] if len(parts) == 1 else torch.cat(parts)
        return Pending(values, keys, scale_index, input_rows)

    def observe(self, step: int, pending: Optional[Pending], input_names: Callable[[int, int], Optional[list[str]]],
                scale: Optional[float]) -> list[Event]:
        """Takes a step's fractions (read with the step: see NOTE: [Headroom without a host read]).

        Args:
            step: the step's number.
            pending: what start() returned for it.
            input_names: the names of the entries of a microbatch's input record of `rows` rows (None:
                they cannot be named), for an event at the input.
            scale: the GradScaler's scale as the step's summary read it (None: it holds none; NOTE: [The
                loss scale read with the summary]).

        Returns:
            The headroom events of this step: one per place that crossed thresholds it had not crossed
            before (all of them named in one event)."""
        if pending is None:
            self.last = None
            return []
        events = []
        found = pending.fractions(scale)
        for key, (fraction, limit, unscaled, row) in found.items():
            samples = self._samples.get(key)
            if samples is None:
                samples = self._samples[key] = collections.deque(maxlen=WINDOW)
            if fraction > 0:
                samples.append((step, math.log2(fraction)))
            before = crossed = self._crossed.get(key, 0)
            while crossed < len(self.thresholds) and fraction >= self.thresholds[crossed]:
                crossed += 1
            if crossed > before:  # one event for every threshold this step crossed at once
                names = None if row is None else input_names(row[1], pending.input_rows[row[0]])
                entry = names[row[2]] if names is not None else None
                events.append(self._event(step, key, fraction, limit, unscaled, self.thresholds[before:crossed], entry))
            self._crossed[key] = crossed
        if found:
            key, (fraction, *_) = max(found.items(), key=lambda item: item[1][0])
            self.last = (fraction, _place(key))
        else:
            self.last = None
        return events

    def doubling_steps(self, key: tuple) -> Optional[float]:
        """Steps for the place's max |x| to double, from a least-squares fit of log2(fraction) over its
        recent samples; inf when it is not growing; None with fewer than 4 samples."""
        samples = self._samples.get(key, ())
        if len(samples) < _MIN_SAMPLES:
            return None
        n = len(samples)
        mean_x = sum(x for x, _ in samples) / n
        mean_y = sum(y for _, y in samples) / n
        sxx = sum((x - mean_x) ** 2 for x, _ in samples)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in samples)
        slope = sxy / sxx if sxx else 0.0
        return 1.0 / slope if slope > 0 else math.inf

    def _event(self, step: int, key: tuple, fraction: float, limit: float, unscaled: bool,
               thresholds: tuple[float, ...], entry: Optional[str] = None) -> Event:
        place = _place(key)
        dtype = _NAMES.get(limit, f"its dtype ({limit:g})")
        where = place.where()
        if entry is not None:  # the input's entry, named as a dirty input's are
            place = dataclasses.replace(place, entries=(InputEntry(entry, 0, 0, 0),))
            where += f" ({entry})"
        text = f"{where} at {_percent(fraction)} of {dtype}'s max"
        if unscaled:
            # See NOTE: [Headroom under a GradScaler]: the largest scale at which these values still fit.
            text += f" before loss scaling (the largest GradScaler scale that fits is ~{1 / fraction:.3g})"
        named = [_percent(t) for t in thresholds]
        crossed = f"threshold {named[0]}" if len(named) == 1 else f"thresholds {', '.join(named[:-1])} and {named[-1]}"
        text += f" ({crossed}), " + _trend(self.doubling_steps(key), len(self._samples[key]))
        return Event(step, place, (), kind="headroom", detail=text)


def _place(key: tuple) -> Place:
    phase, name, module_class, call = key
    return Place(phase, name, module_class, 0, 0, 0, call)


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%" if fraction >= 0.01 else f"{100 * fraction:.2g}%"


def _trend(doubling: Optional[float], samples: int) -> str:
    if doubling is None:
        return "too few steps seen for a trend"
    if math.isinf(doubling):
        return f"not growing over the last {samples} checked steps"
    return f"doubling every ~{doubling:.1f} steps" if doubling < 10 else f"doubling every ~{doubling:.0f} steps"
