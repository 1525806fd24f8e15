"""Reading a health timeline: the JSON Lines file of per-step records that a watch saves or streams.

One JSON object per line. Lines without a "step" key are headers (the first one is kept: "nanfast",
"model", "started", optionally "headroom_thresholds"); blank lines are skipped. Every other key may be
missing or null, and keys not known here are ignored. A line that is not a JSON object, or a known key
with a value of the wrong type, is an error naming the file and the line. Columns are kept in compact
arrays (8 bytes a value) so that a million records fit in a few tens of MB."""

from __future__ import annotations

import dataclasses
import json
import math
from array import array
from typing import Any, Optional

# The numeric columns read from each record (NaN where missing or null).
COLUMNS = ("loss", "grad_norm", "headroom")
# Boolean keys that mark a step.
MARKS = ("skipped", "scaler_skipped", "rolled_back")


class TimelineError(ValueError):
    """A timeline file that cannot be read: the message names the file and, where it applies, the line."""


@dataclasses.dataclass
class Timeline:
    """The records of one file, as columns in file order (sorted by step when the file was not).

    Attributes:
        path: the file read.
        header: the first header line's object ({} when none).
        headroom_thresholds: the header's "headroom_thresholds" (fractions of the dtype's largest
            finite value at which the run warned; [] when not given).
        steps: the step of each record.
        columns: name in COLUMNS -> value per record (NaN where missing or null; a recorded NaN or
            inf is kept, and `present` tells it apart from a missing value).
        present: name in COLUMNS -> how many records give that key a number (not null).
        losses: each name of the records' "losses" -> its value per record (NaN where missing).
        marks: name in MARKS -> the steps where it is true.
        events: (step, kind, summary) of every event, in file order.
        cut_off: the file's last line was unfinished (a run killed mid-write: each line is written whole,
            newline last) and left out."""

    path: str
    header: dict
    headroom_thresholds: list[float]
    steps: array
    columns: dict[str, array]
    present: dict[str, int]
    losses: dict[str, array]
    marks: dict[str, list[int]]
    events: list[tuple[int, str, str]]
    cut_off: bool = False

    def __len__(self) -> int:
        return len(self.steps)


def parse_steps(text: str) -> tuple[Optional[int], Optional[int]]:
    """Parses "A:B" (steps A to B, both included; either side may be left empty).

    Raises:
        TimelineError: the text is not two optional integers around one colon, or A > B."""
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = tuple(int(s) if s.strip() else None for s in (first, last))
    except ValueError:
        raise TimelineError(f"--steps {text!r}: expected A:B, e.g. 100:2000, 100: or :2000") from None
    if None not in bounds and bounds[0] > bounds[1]:
        raise TimelineError(f"--steps {text!r}: the first step is after the last")
    return bounds


def _number(record: dict, key: str, where: str) -> Optional[float]:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TimelineError(f"{where}: {key!r} must be a number or null, not {_short(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer past float64's range (a file written by hand)
        raise TimelineError(f"{where}: {key!r} is a number past float64's range, {_short(value)}") from None


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _thresholds(header: dict, where: str) -> list[float]:
    given = header.get("headroom_thresholds")
    if given is None:
        return []
    if not isinstance(given, list) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 1 for t in given):
        raise TimelineError(f"{where}: 'headroom_thresholds' must be a list of fractions in (0, 1], not {_short(given)}")
    return [float(t) for t in given]


def _events(record: dict, step: int, where: str) -> list[tuple[int, str, str]]:
    events = record.get("events")
    if events is None:
        return []
    if not isinstance(events, list):
        raise TimelineError(f"{where}: 'events' must be a list, not {_short(events)}")
    found = []
    for i, event in enumerate(events):
        kind = event.get("kind") if isinstance(event, dict) else None
        if not isinstance(kind, str):
            raise TimelineError(f"{where}: events[{i}] must be an object with a string 'kind', not {_short(event)}")
        summary = event.get("summary")
        found.append((step, kind, summary if isinstance(summary, str) else ""))
    return found


def read_timeline(path: str, steps: tuple[Optional[int], Optional[int]] = (None, None)) -> Timeline:
    """Reads the per-step records of a JSON Lines file.

    Args:
        path: the file (as `Watch.save` or `log_to=` writes it).
        steps: keep only records with first <= step <= last (None: no bound).

    Returns:
        The Timeline of the records kept.

    Raises:
        TimelineError: the file cannot be opened or decoded, a line is not a JSON object, a known key
            has a value of the wrong type (named with its line number), or no record is left."""
    first, last = steps
    timeline = Timeline(path, {}, [], array("q"), {name: array("d") for name in COLUMNS}, dict.fromkeys(COLUMNS, 0),
                        {}, {name: [] for name in MARKS}, [])
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    if not line.endswith("\n") and (timeline.steps or timeline.header):  # the last line, cut off mid-write
                        timeline.cut_off = True
                        break
                    raise TimelineError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(record, dict):
                    raise TimelineError(f"{where}: expected a JSON object, not {_short(record)}")
                if "step" not in record:
                    if not timeline.header:
                        timeline.header, timeline.headroom_thresholds = record, _thresholds(record, where)
                    continue
                step = record["step"]
                if isinstance(step, bool) or not isinstance(step, int) or not -2**63 <= step < 2**63:
                    raise TimelineError(f"{where}: 'step' must be a 64-bit integer, not {_short(step)}")
                if (first is None or step >= first) and (last is None or step <= last):
                    _append(timeline, record, step, where)
    except OSError as e:
        raise TimelineError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise TimelineError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not timeline.steps:
        bounds = "" if steps == (None, None) else f" in steps {first if first is not None else ''}:{last if last is not None else ''}"
        raise TimelineError(f"{path}: no per-step records (objects with a 'step' key){bounds}")
    _sort_by_step(timeline)
    return timeline


def _append(timeline: Timeline, record: dict, step: int, where: str) -> None:
    """Adds one record's values to the timeline's columns (every column grows by one)."""
    timeline.steps.append(step)
    for name in COLUMNS:
        value = _number(record, name, where)
        timeline.columns[name].append(math.nan if value is None else value)
        timeline.present[name] += value is not None
    losses = record.get("losses")
    losses = {} if losses is None else losses
    if not isinstance(losses, dict):
        raise TimelineError(f"{where}: 'losses' must be an object of name: number, not {_short(losses)}")
    for name in losses:
        if name not in timeline.losses:  # a name first given now: NaN for the records before
            timeline.losses[name] = array("d", [math.nan]) * (len(timeline.steps) - 1)
    for name, column in timeline.losses.items():
        value = _number(losses, name, f"{where}: 'losses'")
        column.append(math.nan if value is None else value)
    for name in MARKS:
        flag = record.get(name)
        if flag is not None and not isinstance(flag, bool):
            raise TimelineError(f"{where}: {name!r} must be true, false or null, not {_short(flag)}")
        if flag:
            timeline.marks[name].append(step)
    timeline.events += _events(record, step, where)


def _sort_by_step(timeline: Timeline) -> None:
    """A file that holds steps out of order (a resumed run appended to it) is drawn by step."""
    steps = timeline.steps
    if all(steps[i] <= steps[i + 1] for i in range(len(steps) - 1)):
        return
    order = sorted(range(len(steps)), key=steps.__getitem__)
    timeline.steps = array("q", (steps[i] for i in order))
    for columns in (timeline.columns, timeline.losses):
        for name, column in columns.items():
            columns[name] = array("d", (column[i] for i in order))
