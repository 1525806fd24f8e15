"""Draw a health timeline: loss, gradient norm and overflow headroom over the steps of a run, with its
events (non-finite values, headroom warnings, spikes) as vertical lines and its skipped and rolled-back
steps marked. Reads the JSON Lines file a watch saves (`w.save("run.jsonl")`) or streams (`log_to=`);
writes PNG, SVG or PDF by the output's suffix."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Any, Optional

from .timeline_file import Timeline, TimelineError, parse_steps, read_timeline

FORMATS = (".png", ".svg", ".pdf")
MISSING_MATPLOTLIB = "nanfast plot needs matplotlib >= 3.7{found}: pip install 'nanfast[plot]'"
# Points drawn per line at most: longer runs are cut into buckets keeping each one's lowest and highest
# value (and a gap where it had one), so spikes stay visible. Events and marks are never thinned.
MAX_POINTS = 4000
# kind -> (colour, legend label). Kinds not listed are drawn in grey, named by their kind.
EVENT_STYLE = {
    "nonfinite": ("tab:red", "non-finite values (NaN/inf)"),
    "spike": ("tab:purple", "loss / gradient norm spike"),
    "headroom": ("tab:orange", "overflow headroom warning"),
}
# mark -> (marker, colour, legend label), drawn along the top edge of every panel.
MARK_STYLE = {
    "skipped": ("v", "black", "step skipped by the watch"),
    "rolled_back": ("X", "tab:brown", "rolled back to the last good state"),
    "scaler_skipped": ("|", "tab:gray", "step skipped by GradScaler (inf gradients)"),
}
# Named losses, when a run gives several (apart from the events' colours).
LOSS_COLOURS = ("tab:blue", "tab:cyan", "navy", "tab:pink", "tab:olive", "tab:green")
# panel -> (column, colour, y label, what to say when the file has none of it).
PANELS = {
    "loss": ("loss", "tab:blue", "loss\n(value given to w.loss)", "no loss in this file (pass it to w.loss(...))"),
    "grad_norm": ("grad_norm", "tab:green", "gradient norm\n(L2 of finite elements)",
                  "no gradient norm in this file (no optimizer step was checked)"),
    "headroom": ("headroom", "tab:olive", "headroom: max |x|\n% of dtype's max finite", ""),
}


def envelope(x: Any, y: Any, max_points: int = MAX_POINTS) -> tuple[Any, Any]:
    """Thins a line to about max_points points for drawing: per bucket of consecutive points, the lowest
    and the highest value and, when the bucket has one, its first NaN (a gap stays a gap).

    Args:
        x, y: numpy arrays of one length (y float).
        max_points: the most points kept is about 3/2 of it (lows and highs: max_points).

    Returns:
        (x, y) thinned, in order; the inputs themselves when short enough."""
    import numpy as np

    n = len(y)
    if n <= max_points:
        return x, y
    buckets = max(1, max_points // 2)
    size = -(-n // buckets)
    padded = np.full(buckets * size, np.nan)
    padded[:n] = y
    rows = padded.reshape(buckets, size)
    nan = np.isnan(rows)
    start = np.arange(buckets) * size
    keep = [start + np.where(nan, np.inf, rows).argmin(1), start + np.where(nan, -np.inf, rows).argmax(1)]
    has_nan = nan.any(1)
    keep.append((start + nan.argmax(1))[has_nan])
    idx = np.unique(np.concatenate(keep))
    idx = idx[idx < n]
    return x[idx], y[idx]


def _log_worthy(values: Any, min_ratio: float, zeros_allowed: bool) -> bool:
    """Log scale when every finite value is positive (or zero, where allowed) and the largest positive
    one is at least min_ratio times the smallest."""
    import numpy as np

    finite = values[np.isfinite(values)]
    positive = finite[finite > 0]
    if not positive.size or finite.min() < 0 or (finite.min() == 0 and not zeros_allowed):
        return False
    return positive.max() >= min_ratio * positive.min()


def _counts(timeline: Timeline) -> str:
    kinds = Counter(kind for _, kind, _ in timeline.events)
    events = f"{len(timeline.events)} event{'s' * (len(timeline.events) != 1)}"
    if kinds:
        events += " (" + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + ")"
    skipped, rolled = len(timeline.marks["skipped"]), len(timeline.marks["rolled_back"])
    text = f"{events}, {skipped} step{'s' * (skipped != 1)} skipped, {rolled} rolled back"
    if timeline.marks["scaler_skipped"]:
        text += f", {len(timeline.marks['scaler_skipped'])} skipped by GradScaler"
    cut = "; its last line, cut off mid-write, left out" if timeline.cut_off else ""
    return f"{text}; steps {timeline.steps[0]}-{timeline.steps[-1]}, {len(timeline):,} records{cut}"


def default_title(timeline: Timeline) -> str:
    """The file's name, and the model's class when the header names it."""
    name = os.path.basename(timeline.path)
    model = timeline.header.get("model")
    return f"{name}: {model}" if isinstance(model, str) and model else name


def figure(timeline: Timeline, title: Optional[str] = None, max_points: int = MAX_POINTS) -> Any:
    """The health timeline as a matplotlib Figure: one panel per quantity over a shared step axis (loss
    and gradient norm always, saying so when the file has none; headroom when the file has some), every
    event a vertical line coloured by kind in every panel, skipped and rolled-back steps marked along
    each panel's top edge, one legend for all of them outside the panels.

    Args:
        timeline: what read_timeline gave.
        title: the first line of the title (default: the file's name and model); the second line
            counts events, skipped and rolled-back steps.
        max_points: the most points drawn per line (see envelope).

    Returns:
        The Figure (pyplot's: close it after saving)."""
    import matplotlib.pyplot as plt
    import numpy as np

    steps = np.frombuffer(timeline.steps, dtype=np.int64)
    panels = [p for p in PANELS if p != "headroom" or timeline.present["headroom"]]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, layout="constrained",
                             figsize=(11, 1.2 + 2.4 * len(panels)))
    axes = list(axes[:, 0])
    for ax, panel in zip(axes, panels):
        _draw_panel(ax, panel, steps, timeline, max_points)
    for ax in axes:
        _draw_events(ax, timeline)
    axes[-1].set_xlabel("step (optimizer steps, as counted by the watch)")
    axes[0].set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
    fig.suptitle(f"{title or default_title(timeline)}\n{_counts(timeline)}", fontsize=10)
    handles: dict[str, Any] = {}  # by label: each panel draws the same events and marks
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(handles=list(handles.values()), loc="outside lower center", ncols=min(3, len(handles)), fontsize=8)
    return fig


def _series(panel: str, timeline: Timeline) -> list[tuple[Optional[str], Any]]:
    """The lines of a panel, (legend label or None, values): the loss panel draws every name given to
    w.loss when there are several (which term went wrong), else the one loss."""
    import numpy as np

    column = PANELS[panel][0]
    if panel == "loss" and len(timeline.losses) > 1:
        return [(f"loss {name!r}", np.frombuffer(values, dtype=np.float64)) for name, values in timeline.losses.items()]
    values = np.frombuffer(timeline.columns[column], dtype=np.float64)
    return [(None, values * 100.0 if panel == "headroom" else values)]


def _draw_panel(ax: Any, panel: str, steps: Any, timeline: Timeline, max_points: int) -> None:
    import numpy as np

    column, colour, label, missing = PANELS[panel]
    ax.set_ylabel(label, fontsize=9)
    ax.grid(True, alpha=0.3)
    if not timeline.present[column]:
        ax.text(0.5, 0.5, missing, transform=ax.transAxes, ha="center", va="center", color="gray")
        ax.set_yticks([])
        return
    series = _series(panel, timeline)
    everything = np.concatenate([values for _, values in series])
    # The loss and the headroom go log when they span a decade; a gradient norm is always read on a log
    # axis (it spans decades in any run with a spike), even with zeros in it (a step whose gradients
    # were all NaN has a norm of 0 over its finite elements): those are left out, and the label says so.
    grad_norm = panel == "grad_norm"
    log = _log_worthy(everything, 1.0 if grad_norm else 10.0, zeros_allowed=grad_norm)
    if log:
        ax.set_yscale("log")
        ax.set_ylabel(label + (", log; 0 not drawn" if (everything == 0).any() else ", log"), fontsize=9)
        ax.yaxis.set_major_formatter(_plain_log_formatter())
        ax.yaxis.set_minor_formatter(_plain_log_formatter(minor_thresholds=(1, 0.5)))
    for k, (name, values) in enumerate(series):
        if log:
            values = np.where(values > 0, values, np.nan)  # a gap, not a line down to the axis's edge
        x, y = envelope(steps, values, max_points)
        line_colour = colour if name is None else LOSS_COLOURS[k % len(LOSS_COLOURS)]
        ax.plot(x, y, color=line_colour, linewidth=1.0, label=name)
        # A value with no finite neighbour (a loss logged every 5th step, headroom of the steps that ran in
        # float16) makes no line segment: drawn as a dot, or the panel stays empty.
        finite = np.isfinite(y)
        alone = finite & ~np.r_[False, finite[:-1]] & ~np.r_[finite[1:], False]
        if alone.any():
            ax.plot(np.asarray(x)[alone], y[alone], linestyle="none", marker="o", markersize=2.5, color=line_colour)
    if panel == "headroom":
        for fraction in timeline.headroom_thresholds:
            ax.axhline(100 * fraction, color="tab:orange", linestyle="--", linewidth=0.8,
                       label=f"threshold {100 * fraction:g}% (from the file's header)")


def _plain_log_formatter(**kwargs: Any) -> Any:
    """Log-axis labels as plain numbers (0.3, not 3e-01) on the ticks matplotlib's LogFormatter labels
    (over a narrow range, some minor ticks too)."""
    from matplotlib.ticker import LogFormatter

    class PlainLog(LogFormatter):
        def __call__(self, x: float, pos: Optional[int] = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLog(labelOnlyBase=False, **kwargs)


def _draw_events(ax: Any, timeline: Timeline) -> None:
    """One LineCollection per event kind (vertical lines over the panel) and one marker line per mark,
    labelled for the legend."""
    by_kind: dict[str, list[int]] = {}
    for step, kind, _ in timeline.events:
        by_kind.setdefault(kind, []).append(step)
    for kind, at in by_kind.items():
        colour, label = EVENT_STYLE.get(kind, ("tab:gray", f"event: {kind}"))
        ax.vlines(at, 0, 1, transform=ax.get_xaxis_transform(), colors=colour, linewidth=1.0, alpha=0.8,
                  label=f"{label} ({len(at)})")
    for mark, at in timeline.marks.items():
        if at:
            marker, colour, label = MARK_STYLE[mark]
            ax.plot(at, [1.0] * len(at), transform=ax.get_xaxis_transform(), linestyle="none", marker=marker,
                    color=colour, markersize=7, clip_on=False, label=f"{label} ({len(at)})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="the JSON Lines file a watch saved (w.save) or streamed (log_to=)")
    parser.add_argument("-o", "--output", default=None,
                        help="the image to write: .png, .svg or .pdf (default: the input's name with .png)")
    parser.add_argument("--title", default=None, help="the title's first line (default: the file's name and model)")
    parser.add_argument("--steps", default=None, metavar="A:B",
                        help="only steps A to B, both included (A: or :B leave one side open)")


def run(args: argparse.Namespace) -> int:
    output = args.output or os.path.splitext(args.path)[0] + ".png"
    if os.path.splitext(output)[1].lower() not in FORMATS:
        return _fail(f"{output}: the output's suffix picks the format, one of {', '.join(FORMATS)}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _fail(MISSING_MATPLOTLIB.format(found=""))
    if getattr(matplotlib, "__version_info__", (0,)) < (3, 7):  # legends "outside" the axes came in 3.7
        return _fail(MISSING_MATPLOTLIB.format(found=f" (found {matplotlib.__version__})"))
    try:
        timeline = read_timeline(args.path, parse_steps(args.steps) if args.steps else (None, None))
    except TimelineError as e:
        return _fail(str(e))
    fig = None
    try:
        fig = figure(timeline, args.title)
        fig.savefig(output, dpi=120)
    except OSError as e:
        return _fail(f"{output}: cannot write ({e.strerror or e})")
    except (ValueError, OverflowError) as e:  # finite values near float64's largest: an axis' span overflows
        return _fail(f"{args.path}: cannot draw it: {e} (values near float64's largest, {sys.float_info.max:.3g}?)")
    finally:
        if fig is not None:
            plt.close(fig)
    print(f"{output}: {_counts(timeline)}")
    return 0


def _fail(message: str) -> int:
    print(f"nanfast plot: {message}", file=sys.stderr)
    return 2
