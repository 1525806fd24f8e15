"""`NanfastCallback` for Hugging Face `transformers.Trainer`: a `nanfast.watch` on the trainer's model
and the torch optimizer its steps run, from the start of `train()` to its end, with the watch's
statistics added to the trainer's logs. See docs/integrations.md."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from .. import watcher
from .common import OwnsWatch, metrics, missing_extra

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler
except ImportError as error:  # an optional extra
    raise missing_extra("transformers", "transformers") from error

__all__ = ["NanfastCallback"]


class NanfastCallback(OwnsWatch, TrainerCallback):
    """Watches HF Trainer training with `nanfast.watch`: `Trainer(..., callbacks=[NanfastCallback(action="skip")])`.

    At `on_train_begin` it makes a watch on the trainer's model and on the torch optimizer that
    accelerate's wrapper steps (the GradScaler of fp16 training is passed as `scaler=` unless given), and
    removes it at `on_train_end` (or at the next `train()` when one raised: call `remove()` yourself to
    leave the model without hooks at once). `options` go to `nanfast.watch` unchanged (`action`, `sync`,
    `every`, `ignore`, `nan_only`, ...), so every action of the watch works as in a plain loop: a bad
    step raises `NonFiniteError` out of `trainer.train()`, or is skipped (parameters and optimizer state
    unchanged; the Trainer does not step its LR scheduler after it, as after a GradScaler's overflow); with
    action="rollback", parameters an update made
    non-finite are put back with the optimizer state to the last good snapshot (not the LR scheduler nor
    `state.global_step`).

    The loss: a model that computes its loss (given `labels`) returns it in its output; a forward hook
    gives it to `w.loss` (phase loss_value) in training forwards. A loss computed outside the model
    (`compute_loss_func`, label smoothing) is not seen there.

    Logs: at the first `on_log` of each logged step, the watch's numbers (`w.stats()` of the last
    checked step, prefixed "nanfast/", plus "nanfast/skipped_steps", "nanfast/rolled_back_steps" and
    "nanfast/events") go into the logs, so the reporters (`report_to`) and `state.log_history` get them.

    Args:
        **options: keyword options of `nanfast.watch`.

    Attributes:
        watch: the current `nanfast.Watch` (None before training; kept after it for `events`, `stats()`)."""

    def __init__(self, **options: Any):
        self.options = options
        self.watch: Optional[watcher.Watch] = None
        self._hook: Optional[Any] = None  # the forward hook giving the model's loss to w.loss
        self._logged_step = -1

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._lead()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Optional[torch.nn.Module] = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        self._lead()
        self.remove()  # a previous train() that raised left its watch on
        self._logged_step = -1
        options = dict(self.options)
        if getattr(optimizer, "scaler", None) is not None:
            options.setdefault("scaler", optimizer.scaler)  # accelerate's GradScaler (fp16)
        options.setdefault("first_step", state.global_step)  # a resumed run's steps keep their numbers
        self.watch = watcher.watch(model, optimizer, **options)  # it hooks the torch optimizer accelerate's wraps
        self._hook = model.register_forward_hook(self._give_loss)

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        # Once per logged step, into the training log alone: not into the run's summary
        # ("train_runtime"...) or an evaluation's logs ("eval_loss"...), whichever comes first at a step.
        if (self.watch is None or logs is None or state.global_step == self._logged_step or "loss" not in logs
                or any(key.startswith("eval_") or key == "train_runtime" for key in logs)):
            return
        self._logged_step = state.global_step
        values = metrics(self.watch)
        logs.update(values)
        # Trainer.log appended {**logs, "step": ...} to the history before calling on_log.
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and set(last) - {"step"} <= set(logs):
            last.update(values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end(flush=True)

    def _give_loss(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.watch is None or not (module.training and torch.is_grad_enabled()):
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            self.watch.loss(loss)

    def _lead(self) -> None:
        """Moves this callback to the front of the trainer's list.

        NOTE: [Callback order]
        The Trainer calls its callbacks in list order, and puts the reporters of `report_to` (TensorBoard,
        W&B, MLflow) before the user's callbacks: added to `logs` in a later `on_log`, the statistics
        would miss them. No callback event passes the trainer or its CallbackHandler, so the handler is
        taken from the caller's frame (CallbackHandler.call_event, which calls on_init_end and
        on_train_begin). Moving an element from index k to 0 while call_event iterates at k neither skips
        nor repeats a callback. If the caller is not a CallbackHandler, the order is left as it is."""
        frame = inspect.currentframe()
        try:
            caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
            handler = caller.f_locals.get("self") if caller is not None else None
        finally:
            del frame
        if isinstance(handler, CallbackHandler) and any(c is self for c in handler.callbacks):
            if handler.callbacks[0] is not self:
                handler.callbacks.remove(self)
                handler.callbacks.insert(0, self)
