"""What a watch tells a logger or a benchmark, beyond its events: the last step's numbers (`stats`), the
health timeline (`history`, `save`) and what the watch cost (`costs`). A part of `Watch`."""

from __future__ import annotations

import os
from typing import Union

from .history import StepRecord
from .step import SUMMARY


class Readings:
    """The readings of `Watch` (a part of it: the state they use is the Watch's)."""

    def costs(self) -> dict[str, float]:
        """What this watch has cost so far, for benchmarks: seconds inside it ("hooks": its hooks and
        its gradient checks, reads included), seconds in its fused kernels ("kernels"), the bytes they
        read ("bytes") and the number of fused-op calls made ("calls": one per record, or with fuse=True
        one per forward, and one per fused pass; each a few kernel launches on a GPU; the step's summary,
        one more call, is not included), and the
        part of those in the step's pass over parameters and gradients ("pass", "pass_bytes").

        Returns:
            The totals since the watch was made, as a dict with those six keys.

        Raises:
            RuntimeError: the watch was made without profile=True (it measures nothing)."""
        if self._profile is None:
            raise RuntimeError("Watch.costs: this watch measures nothing; make it with nanfast.watch(..., profile=True)")
        return self._profile.totals(self._recorder, self._hooks)

    def stats(self) -> dict[str, float]:
        """The last checked step's numbers, from the same fused pass: total grad norm, param norm and max
        |grad| (of the finite elements), and the NaN/+inf/-inf counts over everything checked. Empty before
        the first checked step. They come with the step's one read. The param norm is there only on
        steps whose pass read the parameters (every ``params_every`` checked steps by default; see
        `nanfast.watch`), the gradients' only on steps whose pass read gradients (not an inference
        step's, as in ``w.history``).

        Returns:
            A dict with keys step, grad_norm and grad_max_abs (when read), param_norm (when read), nan,
            posinf, neginf (floats)."""
        if self._summary_values is None:
            return {}
        values = dict(zip(SUMMARY, self._summary_values))
        stats = {"step": float(self._summary_step), "grad_norm": values["grad_norm"], "param_norm": values["param_norm"],
                 "grad_max_abs": values["grad_max_abs"], "nan": values["nan"], "posinf": values["posinf"],
                 "neginf": values["neginf"]}
        if not self._summary_tail.params:
            del stats["param_norm"]
        if not self._summary_tail.grads:  # an inference step's pass read none (0.0 is no norm it took)
            del stats["grad_norm"], stats["grad_max_abs"]
        return stats

    @property
    def history(self) -> list[StepRecord]:
        """The records of the last checked steps (at most ``history=`` of them, oldest first; a copy, made
        at each read: 10,000 records take about 0.1 ms. For the last step's numbers at every step, read
        ``w.stats()``, or give ``log_to`` a callable, which gets each record as it is made)."""
        return self._timeline.records

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Writes the kept records as JSON Lines: a header line ({"nanfast": version, "model": class,
        "started": time, "headroom_thresholds": [...]}), then one line per record (StepRecord.to_dict()).

        Args:
            path: the file to write (replaced if it exists).

        Raises:
            OSError: the file cannot be written."""
        self._timeline.save(path)
