"""`NanfastCallback` for Lightning's `Trainer`: a `nanfast.watch` on the LightningModule (or a
submodule) and its torch optimizer from the start of training to its end, with the watch's statistics
logged through the module's logger. See docs/integrations.md."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import watcher
from ..watcher.closure import run_closure_first, runs_closure_first
from .common import OwnsWatch, metrics, missing_extra

try:
    from lightning.pytorch import Callback
except ImportError as error:  # an optional extra
    raise missing_extra("lightning", "lightning") from error

__all__ = ["NanfastCallback"]


class NanfastCallback(OwnsWatch, Callback):
    """Watches Lightning training with `nanfast.watch`: `Trainer(callbacks=[NanfastCallback(action="skip")])`.

    At `on_train_start` it makes a watch on the LightningModule (or on its submodule named `module`)
    and the trainer's one torch optimizer (the precision plugin's GradScaler is passed as `scaler=`
    unless given), and removes it at `on_train_end` or `on_exception`. `options` go to `nanfast.watch`
    unchanged (`action`, `sync`, `every`, `ignore`, `nan_only`, ...): a bad step raises `NonFiniteError`
    out of `trainer.fit()`, or is skipped (parameters and optimizer state unchanged; an LR scheduler
    still steps); with action="rollback", parameters an update made non-finite are put back with the
    optimizer state to the last good snapshot (not an LR scheduler nor `trainer.global_step`).

    Lightning hands the torch optimizer a closure that runs training_step and backward inside
    `optimizer.step(closure)`, after the point where the watch decides (its step pre-hook). The callback
    therefore adds a step pre-hook of its own, ahead of the watch's, that runs the closure first and
    passes the step on without it (see NOTE: [Lightning's closure]).

    The loss given to backward goes to `w.loss` (`on_before_backward`; divided by
    `accumulate_grad_batches` as Lightning does; not with a GradScaler, which has scaled it by then).

    Logs: after each checked optimizer step, the watch's numbers (`w.stats()`, prefixed "nanfast/",
    plus "nanfast/skipped_steps", "nanfast/rolled_back_steps" and "nanfast/events") go to
    `pl_module.log_dict` (on_step), so they reach the trainer's loggers.

    Args:
        module: the attribute path of the submodule to watch (e.g. "model") when training_step calls it
            rather than the LightningModule's own forward; None: the LightningModule.
        **options: keyword options of `nanfast.watch`.

    Raises:
        ValueError: (at on_train_start) the trainer has more than one optimizer, or none.

    Attributes:
        watch: the current `nanfast.Watch` (None before training; kept after it for `events`, `stats()`)."""

    def __init__(self, module: Optional[str] = None, **options: Any):
        self.module = module
        self.options = options
        self.watch: Optional[watcher.Watch] = None
        self._hook: Optional[Any] = None  # the step pre-hook running the closure first
        self._scaled_loss = False
        self._logged_step = -1.0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.remove()
        if len(trainer.optimizers) != 1:
            raise ValueError(f"nanfast.integrations.lightning: NanfastCallback watches one optimizer, the trainer has "
                             f"{len(trainer.optimizers)}; with several, call nanfast.watch in the LightningModule "
                             "(see docs/watch.md)")
        optimizer = trainer.optimizers[0]
        options = dict(self.options)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            options.setdefault("scaler", scaler)
        self._scaled_loss = options.get("scaler") is not None
        model = pl_module if self.module is None else pl_module.get_submodule(self.module)
        # The watch runs the closure first itself for torch's own optimizers (runs_closure_first); the
        # callback does it for the others, as it always has, but LBFGS, which calls it many times.
        if not isinstance(optimizer, torch.optim.LBFGS) and not runs_closure_first(optimizer):
            self._hook = optimizer.register_step_pre_hook(run_closure_first)
        self._logged_step = -1.0
        options.setdefault("first_step", trainer.global_step)  # a resumed or continued fit keeps its numbers
        self.watch = watcher.watch(model, optimizer, **options)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self.watch is not None and not self._scaled_loss:
            self.watch.loss(loss)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.watch is None:
            return
        values = metrics(self.watch)
        step = self.watch.stats().get("step", -1.0)
        if values and step != self._logged_step:  # once per checked step (not per microbatch)
            self._logged_step = step
            pl_module.log_dict(values, on_step=True, on_epoch=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end(flush=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.remove()
