"""What a watch does about a bad step: raise, warn, call the user's action, or skip the optimizer step
(see NOTE: [Skipping a step]) leaving parameters, optimizer state and module buffers as they were, or,
once the parameters are non-finite, roll back to the last good snapshot (rollback.py); and, with
on_event="locate", re-running the step under nanfast.locate first."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Optional

import torch

from .located_agrees import disagreement
from ..report import MAX_NAMED_IN_MESSAGE, NonFiniteError, first_few
from . import agree, step as steps
from ..locator.source import warn_at_user_line
from .events import Event, absorbed_key, did_no_harm
from .inputs import entry_names
from .options import SKIPPING
from .closure import RanClosure
from .stepped import lacks_state, nonfinite_unstepped
from .spikes import SpikeError


class Actions:
    """The actions of `Watch` (a part of it: the state they use is the Watch's)."""

    def _evaluate(self, read: steps.Read, acting: bool = True) -> None:
        """Reads a step's checks on the host; if the step is bad, makes its event and acts on it; a
        healthy step's values go to the spike alarms; the step's record goes to the timeline. With
        `acting` False (a `with` block left by an exception), the events and the record are kept but
        nothing is acted on, and no collective is started."""
        agree.wait(read)
        if self._rollback is not None and self._rollback.stale(read.step):
            # Computed from the parameters a rollback replaced (see NOTE: [Rolling back]): no event, but
            # its update was not applied (the rollback skipped it), which its record says (it had none:
            # a lagged timeline went from step 5 to 7, a probe, session 49). w.rolled_back_steps counts it.
            if self._timeline.wanted:
                _, summary, _ = steps.verdict(read)
                losses, scale, _ = read.tail.unpack(summary[len(steps.SUMMARY):])
                self._timeline.add(read.step, summary, read.tail, losses, scale, skipped=True)
            return
        # (a late loss's step was applied: its buffers are the next step's, NOTE: [A loss passed after its step])
        before_step = read.host is None and not read.within_step and not read.late_loss
        bad, summary, rows = steps.verdict(read)
        if read.evaluation:  # see NOTE: [Evaluation forwards between optimizer steps]
            if bad and read.abandoned:  # a non-finite parameter is named (no optimizer step ran since)
                rows = steps.with_params(read, rows, summary, self._fused_pass(read_params=True), self.ignore)
            places = steps.places(rows, read, False, self.nan_only, self.model.forward) if bad else []
            if places:
                self.last = event = Event(read.step, places[0], tuple(places[1:]),
                                          evaluation=not (read.abandoned or read.late_loss or read.unended),
                                          abandoned=read.abandoned, late_loss=read.late_loss and not read.after_inference,
                                          unended=read.unended)
                self.events.append(event)
                if acting:
                    self._act(event, False, before_step)
            return
        self._summary_values, self._summary_step, self._summary_tail = summary, read.step, read.tail
        losses, scale, modules = read.tail.unpack(summary[len(steps.SUMMARY):])
        headroom = [] if self._headroom is None else self._headroom.observe(
            read.step, read.headroom, lambda microbatch, rows: entry_names(read.inputs.get(microbatch), rows,
                                                                             self.model.forward), scale)
        scaler_skipped = read.scaler_skipped or (bad and summary[7] > 0)
        if scaler_skipped:
            self.scaler_skipped_steps += 1
        # NOTE: [A scaler skipping at a scale of 1]
        # A step the GradScaler skipped does not report its scaled phases: their infs are the scale's
        # overflow, which it backs off. A NaN that backward makes at every step (inf * 0 in a gradient) is
        # no overflow: the scaler skipped every step, its scale fell from 65536 to 6e-8, and the watch
        # said nothing (a probe, session 47). At a scale of 1 or less the scaled values are no larger
        # than the unscaled ones, so whatever is non-finite there is no artifact of scaling: reported.
        reported_as_overflow = scaler_skipped and not (scale is not None and scale <= 1.0)
        event = spike = notice = None
        absorbed = False  # see NOTE: [-inf that did no harm] (events.py)
        if bad:
            # None: only values scaled by the GradScaler overflowed: it skipped the step and lowers its scale
            places = steps.places(rows, read, reported_as_overflow, self.nan_only, self.model.forward)
            # The parameters are read again only while they are as the step found them (see NOTE:
            # [Parameters read when they add information]), and not for -inf absorbed before (NOTE: [-inf
            # that did no harm]).
            harm_followed = read.loss_checked, read.tail.grads and read.reported[2]
            if read.params_unread and (before_step or self._params_as_found()) and not (
                    did_no_harm(places, *harm_followed) and absorbed_key(places) in self._absorbed):
                rows = steps.with_params(read, rows, summary, self._fused_pass(read_params=True), self.ignore)
                places = steps.places(rows, read, reported_as_overflow, self.nan_only, self.model.forward)
            event = agree.event(read.step, places, self.process_group) if acting else agree.local_event(read.step, places)
            absorbed = event is not None and did_no_harm(event.places, *harm_followed)
            if absorbed:  # a healthy step (spikes watch it too), told once for these places
                names = absorbed_key(event.places)
                notice, event = (None if names in self._absorbed else event.absorbed()), None
                self._absorbed.add(names)
        if (not bad or absorbed) and self._spikes is not None and not scaler_skipped:
            spike = self._spikes.observe(read.step, losses, summary[steps.GRAD_NORM] if read.tail.grads else None, modules)
            if acting and (callable(self._spikes.options.action) or self._spikes.options.action in ("skip", "raise")):
                # see NOTE: [A spike on one rank]
                spike = agree.spike(read.step, spike, self.process_group)
        if event is not None and event.kind == "nonfinite" and event.first.microbatch in read.eval_mode_with_grad \
                and event.first.phase not in ("param", "grad"):
            event = dataclasses.replace(event, eval_mode_with_grad=True)
        if event is not None and event.kind == "nonfinite" and event.first.phase == "param" and read.params_rewritten:
            event = dataclasses.replace(event, params_rewritten=True)
        if event is not None and event.kind == "nonfinite" and event.first.phase == "param" and self.every > 1:
            event = dataclasses.replace(event, every=self.every)
        if event is not None and event.kind == "nonfinite" and read.forward_unchecked:
            event = dataclasses.replace(event, forward_unchecked=True)
        if event is not None and self.on_event == "locate" and acting:
            located = agree.located(self._locate(read.step_state), event.rank, self.process_group)
            differs = None if located is None else disagreement(
                self.model, event.first.phase, event.first.name, event.first.where(), located)
            event = dataclasses.replace(event, located=located, located_differs=differs)
        if event is not None and headroom:
            # A place that went non-finite this step is no longer near its max: its warning ("97% of
            # float16's max" of the finite values beside +inf) is left to the event (a probe, session 51).
            hit = {(p.phase, p.name, p.module_class, p.call) for p in event.places}
            headroom = [h for h in headroom if (h.phase, h.name, h.module_class, h.first.call) not in hit]
        found = (*headroom, *(e for e in (notice, event, spike) if e is not None))
        skipped_before, rolled_back_before = self.skipped_steps, self.rolled_back_steps
        try:
            for e in found:
                self.events.append(e)
                self.last = e
            if not acting:
                return
            for warning in (*headroom, *([notice] if notice is not None else [])):
                self._warn(warning, "warn", before_step)
            if event is not None:
                self._act(event, scaler_skipped, before_step=before_step, unrestored=read.unrestored)
            if spike is not None:
                self._warn(spike, self._spikes.options.action, before_step)
        finally:  # a raise still leaves its step in the timeline
            if self._timeline.wanted:
                top = self._headroom.last if self._headroom is not None else None
                self._timeline.add(
                    read.step, summary, read.tail, losses, scale, skipped=self.skipped_steps > skipped_before,
                    scaler_skipped=scaler_skipped, rolled_back=self.rolled_back_steps > rolled_back_before,
                    headroom=None if top is None else top[0], headroom_place=None if top is None else top[1].where(),
                    events=found)

    def _warn(self, event: Event, action: Any, before_step: bool) -> None:
        """Acts on a warning event (kinds spike and headroom; headroom always warns): warn (and the
        watch's callable action gets it too), raise SpikeError, only record it, skip the step (the
        watch's skip: action="skip", eager), or call the given callable."""
        if callable(action):
            with self._idle():
                action(event)
        elif action == "raise":
            raise SpikeError(event)
        elif action == "skip":
            self._act(event, scaler_skipped=False, before_step=before_step)
        elif action == "warn":
            warn_at_user_line(event.summary(), RuntimeWarning)
            if callable(self.action):
                with self._idle():
                    self.action(event)

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        # args: the step's own arguments, the optimizer first
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if self.action in SKIPPING and closure is not None and not isinstance(closure, RanClosure):
            raise ValueError(f"nanfast.watch: action={self.action!r} cannot skip optimizer.step(closure) of "
                             f"{type(optimizer).__name__}, an optimizer outside torch.optim: the closure runs the step's "
                             "forward and backward after the point where the watch decides, and the watch runs it "
                             "first only for torch's own optimizers; call backward before optimizer.step()")
        self._stepped = True
        self._untell_accelerate()
        gradless = self._step.gradless  # the step's, before _end_step starts the next one
        skipping_on_device = self._skip_on_device and self.action in SKIPPING
        read = None
        try:
            read = self._end_step(found_inf=getattr(optimizer, "found_inf", None),
                                  grad_scale=getattr(optimizer, "grad_scale", None), defer_undo=skipping_on_device)
        finally:
            # A skip on the device puts the buffers back in the post-hook, which then takes the deferred
            # snapshot (NOTE: [Buffers of compiled forwards]); with none to make (no read, a skip made
            # here, an action that raised) it is taken now.
            if not (skipping_on_device and read is not None and not self._skip_now):
                self._begin_undo()
        if self.action not in SKIPPING:
            return
        if self._skip_on_device and not self._skip_now:
            if read is None:
                return
            found = (read.summary[0] > 0).to(torch.float32)
            self._saved_found_inf = vars(optimizer).get("found_inf")
            # A GradScaler's own flag (fused optimizers) is kept: either one skips.
            optimizer.found_inf = found if self._saved_found_inf is None else torch.maximum(self._saved_found_inf, found)
            self._found = found
        elif self._skip_now:
            # NOTE: [Gradients a skipped step gives back]
            # Every torch optimizer leaves a parameter without a .grad, and its state, untouched; the
            # post-hook gives the gradients back zeroed, which code after optimizer.step() can still
            # read (a loop whose zero_grad sets them to None drops them again). But where some
            # parameters had a .grad when the step's first forward began and others none (zero_grad(
            # set_to_none=False); an expert or a branch only the bad batch reached), those others get
            # none back: given a zero tensor, zero_grad kept it, and every later step updated that
            # parameter (weight decay, momentum, new optimizer state), which a run without the batch
            # never does (a probe, session 42).
            self._held_grads = []
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._held_grads.append((p, None if gradless is not None and id(p) in gradless else p.grad))
                        p.grad = None

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._skip_on_device and self._found is not None:
            if self._saved_found_inf is None:
                del optimizer.found_inf
            else:
                optimizer.found_inf = self._saved_found_inf
            skip = self._found.bool()
            if self._undo is not None:
                self._undo.restore(where=skip)
                self._begin_undo()  # see NOTE: [Buffers of compiled forwards]
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.masked_fill_(skip, 0)
            self._found = self._saved_found_inf = None
        elif self._held_grads:
            for p, grad in self._held_grads:
                p.grad = None if grad is None else grad.zero_()
            self._held_grads = []
            if self._accelerated is not None:
                self._tell_accelerate_skipped()

    def _tell_accelerate_skipped(self) -> None:
        """NOTE: [A skipped step for accelerate's scheduler]
        accelerate's AcceleratedScheduler (a prepared LR scheduler) and HF's Trainer step the LR schedule
        only after an optimizer step that was not skipped, as its `step_was_skipped` says; a skip of the
        watch's left it False, and the schedule ran one step ahead of a run that never saw the batch (its
        learning rate halved a step early under StepLR: a probe, session 45). So a skip sets it, as a
        GradScaler's overflow does: without a scaler accelerate never writes the flag (the watch clears
        it when the next step begins); with one, accelerate sets it after the step from whether the
        optimizer's step ran, which the watch says did not. Only for a skip decided on the host: a skip
        on the device is a flag no host code sees."""
        self._accelerated._is_overflow = self._told_skipped = True
        if hasattr(self._accelerated, "_accelerate_step_called"):
            self._accelerated._accelerate_step_called = False

    def _untell_accelerate(self) -> None:
        """Clears what _tell_accelerate_skipped set, once the next step begins or the watch is removed:
        without a scaler accelerate never clears it, and its scheduler would never step again."""
        if self._told_skipped:
            self._accelerated._is_overflow = self._told_skipped = False

    def _needs_host_verdict(self) -> bool:
        """A lagged skip on the device cannot undo this step: it creates optimizer state (fused SGD makes
        its momentum buffers before it looks at found_inf), or changed a buffer with no copy to restore it
        from, or re-assigned one to a tensor of another shape. Such a step is read at once (a first step,
        or a buffer seen changing for the first time)."""
        return self._skip_on_device and (lacks_state(self.optimizer) or bool(self._undo.missed or self._undo.host_only))

    def _skip_at_once(self, read: steps.Read) -> None:
        """Skips a bad lagged step on the host now, on a rank whose step a skip on the device cannot undo;
        its event comes with every rank's, at the next step's end.

        NOTE: [A lagged step one rank must read at once]
        A single process reads such a step at once, as an eager watch does. With other ranks that choice
        is this rank's alone (its forward alone ran a BatchNorm branch, its optimizer alone lacks state):
        read at once, a bad step gathered its places while the other ranks, reading it a step later, had
        gone on into the next step's gradient all-reduce: a hang (a probe, session 42). So this rank
        reads the flag at once (the ranks' MAX, the verdict every rank acts on, one wait for it), and
        for a bad step takes the gradients away before the optimizer runs and puts back the buffers it
        can, as an eager skip does; the step stays pending, and every rank makes its event and decides
        together at the next step's end. Buffers it could not put back make every rank raise there
        (NOTE: [Decisions that only one rank can see]), a step late, as a lagged watch raises."""
        read.unrestored = tuple(self._undo.restore()) if self._undo is not None else ()
        self._skip_now = True

    def _locate(self, state: Optional[Any]) -> Optional[Any]:
        """Re-runs the step (self.rerun) under nanfast.locate from `state`, the RNG states the step began
        with (Read.step_state); the watch's hooks stay idle meanwhile (the re-run is not a step). Every
        rank re-runs (all see the same verdict), so the collectives of a DDP backward match."""
        if state is None:
            return None
        from ..locator import locate_step

        with self._idle():
            return locate_step(self.rerun, state)

    @contextlib.contextmanager
    def _idle(self) -> Iterator[None]:
        """The hooks stay idle while the watch runs code that may run the model and is no step: the
        locate re-run, or a callable action (one that ran the model again to look at it was a bad step
        of its own, which called it again, without end: a probe, session 44)."""
        active, idling = self._active, self._idling
        self._active, self._idling = False, True
        try:
            yield
        finally:
            self._active, self._idling = active, idling
            self._steps.reset()  # the forwards run meanwhile are not the next step's

    def _act(self, event: Event, scaler_skipped: bool, before_step: bool, unrestored: tuple = ()) -> None:
        """Acts on a bad step's event; `before_step`: read before the optimizer applied the step (eager),
        so a skip or a raise can still leave the model as the step found it; `unrestored`: the buffers a
        skip at once could not put back (NOTE: [A lagged step one rank must read at once]). An evaluation
        forward's event, or an abandoned batch's (but for non-finite parameters), has no optimizer step to
        skip: a skip or rollback watch puts back the buffers it changed and warns."""
        if event.late_loss and agree.with_other_ranks(self.process_group):
            # A late loss is read on its rank alone (a rank may log alone): a raise there left the others
            # waiting in their next collective (a probe, session 48). Its step was applied everywhere.
            warn_at_user_line(f"{event.summary()}: said, not acted on: the other ranks did not read this rank's "
                              "loss, and a raise here alone would leave them waiting in a collective", RuntimeWarning)
            return
        if callable(self.action):
            try:
                with self._idle():
                    self.action(event)
            except BaseException:
                # Raised from to stop, as "raise" stops: the buffers the step's forward wrote are put back
                # too (left, a caught stop kept the bad batch's BatchNorm statistics: a probe, session 48).
                if before_step and self._undo is not None:
                    self._undo.restore()
                raise
        elif self.action == "warn":
            warn_at_user_line(event.summary(), RuntimeWarning)
        else:
            missed = self._undo.restore() if before_step and self._undo is not None else list(unrestored)
            # A rank that cannot skip makes every rank raise (NOTE: [Decisions that only one rank can see]);
            # event.rank is set when the ranks agreed on the event: all of them are here.
            agreed = event.rank is not None and not event.evaluation and self.action != "raise"
            elsewhere = agreed and agree.any_rank(bool(missed), self.process_group) and not missed
            if (event.evaluation or event.late_loss or event.unended or event.abandoned and event.phase != "param") \
                    and self.action in SKIPPING:
                unrestored = f"; its buffers {missed} changed in place could not be put back" if missed else ""
                what = ("an evaluation forward" if event.evaluation else "its step was already applied" if event.late_loss
                        else "no step followed its forwards" if event.unended else "the loop dropped the batch itself")
                warn_at_user_line(f"{event.summary()}: {what}, so no optimizer step to skip{unrestored}", RuntimeWarning)
                return
            # Buffers changed in place with no copy taken (a kind not copied, or not seen changing before).
            unrestored = (f": its forward changed the buffers {missed} in place, which could not be restored (no copy "
                          "was taken: not seen changing in an earlier step, or not a plain dense tensor)") if missed else ""
            if self.action == "raise":
                raise NonFiniteError(event, f"{event.summary()}{unrestored}" if missed else None)
            # See NOTE: [Parameters another optimizer steps].
            unstepped = nonfinite_unstepped(self.model, self.optimizer, self.ignore, self.nan_only)
            # Asked on every rank: pipeline stages watch different modules, some with no such parameters
            # (asked only where there were, the ranks' collectives went out of step: a probe, session 47).
            if agreed and agree.any_rank(bool(unstepped), self.process_group) and not unstepped:
                unstepped = ["(on another rank)"]
            if unstepped:
                raise NonFiniteError(event, f"{event.summary()}: the step cannot be skipped: the model's parameters "
                                     f"{first_few(unstepped, MAX_NAMED_IN_MESSAGE)}, which the optimizer does not step, "
                                     "are non-finite (another optimizer or the loop wrote them, or they were frozen "
                                     "so), and a skip cannot put them back")
            if event.phase == "param":
                if self._rollback is not None:
                    return self._roll_back(event)
                raise NonFiniteError(event, f"{event.summary()}: a step cannot be skipped once the parameters are non-finite")
            if missed:
                raise NonFiniteError(event, f"{event.summary()}: the step cannot be skipped{unrestored}")
            if elsewhere:
                raise NonFiniteError(event, f"{event.summary()}: the step cannot be skipped: another rank's forward "
                                     "changed buffers in place that could not be restored, and all ranks skip or "
                                     "raise together")
            # The GradScaler already skipped it, or (lagged) the optimizer skips it on the device (found_inf).
            self._skip_now = not scaler_skipped and before_step
            self.skipped_steps += 1
            warn_at_user_line(f"{event.summary()}: skipped the optimizer step (parameters, optimizer state and module "
                              "buffers unchanged, grads zeroed)", RuntimeWarning)

    def _roll_back(self, event: Event) -> None:
        """action="rollback" with non-finite parameters: puts back the last snapshot proven finite and
        skips the step that is ending (its gradients come from the bad parameters)."""
        restored, added = self._rollback.roll_back(event.step, now=self.step_count - 1)
        if added:
            names = {id(p): name for name, p in self.model.named_parameters()}
            named = first_few([names.get(id(p), f"a {tuple(p.shape)} parameter outside the model") for p in added],
                              MAX_NAMED_IN_MESSAGE)
            raise NonFiniteError(event, f"{event.summary()}: cannot roll back: the optimizer's parameters {named} were "
                                 "added after the last snapshot (step "
                                 f"{self._rollback.latest_step}), which holds no values of theirs to put back; the "
                                 "next snapshot is taken at the first step that proves them finite")
        if restored is None:
            raise NonFiniteError(event, f"{event.summary()}: cannot roll back: no snapshot was taken yet (one is taken "
                                 "at the end of a checked step whose parameters were found finite; none was before "
                                 "this one)")
        self._skip_now = True
        self.rolled_back_steps += 1
        self.last_rollback = (event.step, restored)
        undone = f"step {restored}" if restored == event.step - 1 else f"steps {restored} to {event.step - 1}"
        skipped = " (the loop dropped this batch itself)" if event.abandoned else " and skipped the optimizer step"
        warn_at_user_line(f"{event.summary()}: rolled back to the state step {restored} began with (parameters, "
                          f"optimizer state and module buffers; the updates of {undone} are undone){skipped}",
                          RuntimeWarning)
