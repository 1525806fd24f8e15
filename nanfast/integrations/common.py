"""What the framework callbacks share: the message of a missing extra, the statistics they log, and the
watch's end at the end of training."""

from __future__ import annotations

from typing import Any, Optional


from ..watcher import Watch

PREFIX = "nanfast/"


def missing_extra(package: str, extra: str) -> ImportError:
    """The error of importing an integration whose framework is not installed.

    Args:
        package: the framework's import name ("transformers", "lightning").
        extra: nanfast's extra that installs it.

    Returns:
        An ImportError naming the module and the pip command."""
    return ImportError(f"nanfast.integrations.{extra} needs the {package} package, which is not installed: "
                       f"pip install 'nanfast[{extra}]'")


def metrics(watch: Watch) -> dict[str, float]:
    """The watch's numbers as a trainer logs them: `w.stats()` of the last checked step (grad_norm,
    param_norm when the step read the parameters, grad_max_abs, nan, posinf, neginf), and the run's totals so far (skipped_steps,
    rolled_back_steps, events), each key prefixed "nanfast/". Empty before the first checked step.

    Args:
        watch: the callback's watch.

    Returns:
        A dict of floats, keys prefixed with "nanfast/"."""
    stats = watch.stats()
    if not stats:
        return {}
    values = {PREFIX + key: value for key, value in stats.items() if key != "step"}
    values[PREFIX + "skipped_steps"] = float(watch.skipped_steps)
    values[PREFIX + "rolled_back_steps"] = float(watch.rolled_back_steps)
    values[PREFIX + "events"] = float(len(watch.events))
    return values


class OwnsWatch:
    """What both callbacks share: the watch they made and one hook of their own beside it (`_hook`, a
    RemovableHandle), both removed together."""

    watch: Optional[Watch]
    _hook: Optional[Any]

    def remove(self) -> None:
        """Removes the watch's hooks and the callback's own hook now (e.g. after training raised)."""
        self._end(flush=False)

    def _end(self, flush: bool) -> None:
        """Ends the watch: reads a lagged watch's last step when `flush` (training ended normally; a bad
        step there acts, so it may raise), then removes every hook."""
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        if self.watch is None:
            return
        try:
            if flush:
                self.watch.flush()
        finally:
            self.watch.remove()
