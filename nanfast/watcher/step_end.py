"""The step boundary of `Watch` (a part of it, as install.py, hooks.py and actions.py are): the step's
end (the pass over parameters and gradients, the summary packed and read, eager or lagged, then the
actions), a new Step, and what the loop calls there: `step()` without an optimizer, `flush()`,
`clip_grad_norm_()`."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..clip import check_norm_type, norm_dtype, scale_grads_, total_norm
from .. import _C
from . import agree, step as steps
from .fused_pass import Pass, reads_params, run as run_fused_pass
from .step import Read, Step


class StepEnd:
    """The step boundary of `Watch` (a part of it: the state it uses is the Watch's)."""

    def _reset_step(self) -> None:
        """A new step: its records cleared, a new Step."""
        if self._undo is not None:
            self._undo.close()
        self._step = Step()
        # The records dropped, the forward forgotten (see NOTE: [Checking each tensor once]), the new
        # slot list and whether this step is checked, in one call.
        self._hooks.new_step(self._step.slots, self._step.outputs, self._installed and self.step_count % self.every == 0)
        self._steps.reset()

    def _capture_step_state(self) -> None:
        """on_event="locate": takes the RNG states the step about to begin starts from, for its re-run."""
        # NOTE: [A compiled step's RNG states]
        # The states were taken only by the model's forward pre-hook at a step's first forward, which does
        # nothing inside a compiled forward (NOTE: [The watch and torch.compile]): with a compiled model,
        # on_event="locate" never re-ran a bad step, and its event said nothing of why (a probe, session
        # 46). So they are also taken when the watch begins and when each step ends; an eager first
        # forward takes them again, closer to the step (the loop may draw random numbers in between).
        from ..locator import StepState

        self._step_state = StepState.capture(self.model)  # the RNG states: a few KB

    def step(self) -> None:
        """Ends the step: checks parameters and gradients and reads the step's results. In a loop without
        an optimizer, at every step; with one (whose step() does this), where the loop abandons a batch
        itself before optimizer.step() (its own NaN-loss guard), so that the next batch's step does not
        hold that forward's checks (see docs/watch.md, "Where a step begins and ends")."""
        self._steps.ended_by_user = True
        self._end_step()

    def _scaler_step_begins(self) -> None:
        self._stepped = False

    def _scaler_step_ended(self, optimizer: torch.optim.Optimizer) -> None:
        # The GradScaler skipped the step without calling optimizer.step() (see NOTE: [AMP and GradScaler]).
        if optimizer is self.optimizer and not self._stepped:
            self._end_step(scaler_skipped=True)

    def flush(self) -> None:
        """Reads the results still pending now and acts on them: a lagged watch's last step (one host
        sync), then the checks of submodules an evaluation ran outside the model's forward, read at the
        next forward otherwise (a trainer's last validation calls self.net(x): its dirty batch was never
        reported, a probe, session 44)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._evaluate(pending)
        if self._outside_evaluation is not None:
            self._end_outside_evaluation()

    def _end_unended(self) -> None:
        """At the `with` block's end (after flush()): reads the checks of forwards that no step end read."""
        # NOTE: [Forwards the loop never ended]
        # A step is read at its end: optimizer.step(), or w.step(). Forwards after the last one (a final
        # test batch run in eval mode without torch.no_grad(), or under no_grad in train mode; inference
        # with gradients and no optimizer, which never calls w.step()) ended no step, and the watch's
        # removal dropped their checks unread: a NaN output with no event and no warning (a probe,
        # session 49). So the block's end reads them as an evaluation is read (one host read; an
        # event, Event.unended, and no step to skip). remove() alone, and a block left by an exception,
        # drop them as before (as a lagged watch's pending step: flush() first).
        if self._active and self._step.slots:
            self._end_step(fused_pass=False, evaluation=True, unended=True)

    def _record_pending(self) -> None:
        """Keeps the step still pending in a lagged watch in the events and the timeline without acting on
        it: the `with` block is left by an exception, which a raise of the watch's would hide (the last
        step the run completed was missing from a crashed run's timeline)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._evaluate(pending, acting=False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the watched parameters' gradients to total norm `max_norm` (as
        torch.nn.utils.clip_grad_norm_) and returns the total norm before clipping, from the fused pass
        the step's check makes anyway: call it right before optimizer.step(). No host sync; norms are of
        the finite elements (finite gradients never become NaN); non-finite gradients are reported by
        the watch (phase grad). Gradients changed after it (replaced, or scaled in place: divided by a
        token count of 0) are read again at the step.

        Args:
            max_norm: the largest total norm kept.
            norm_type: 2 or inf.

        Returns:
            The total norm before clipping (0-dim, on the gradients' device, in their `norm_dtype` as torch's;
            zero without gradients).

        Raises:
            ValueError: norm_type is not 2 or inf.
            NotImplementedError: the watched parameters are sharded DTensors (use torch's own clip)."""
        norm_type = check_norm_type(norm_type, "Watch.clip_grad_norm_")
        if self._sharded:
            raise NotImplementedError("Watch.clip_grad_norm_: the watch reads sharded (DTensor) parameters' local shards, "
                                      "so its norms are this rank's; use torch.nn.utils.clip_grad_norm_, which reduces "
                                      "DTensor norms over their mesh")
        with torch.no_grad():
            fused = self._fused_pass()
            if fused is None or not fused.grads:
                return torch.zeros(())
            n = fused.n_params
            total = total_norm([fused.norm[n:]], [fused.absmax[n:]], norm_type, fused.grads)
            scale_grads_(fused.grads, total, max_norm)
        self._step.clipped = fused  # counts are unchanged by a finite scale <= 1; norms are those before clipping
        self._step.clipped_versions = tuple(g._version for g in fused.grads)
        return total.to(norm_dtype(fused.grads))

    def _clipped_pass(self) -> Optional[Pass]:
        """The pass clip_grad_norm_ made this step, if its gradients are still the ones the optimizer will
        apply: the same tensors, not written since (a loop that normalises them after the clip, by a
        token count of 0, made inf that no check saw); else None, and the step reads them again."""
        clipped = self._step.clipped
        if clipped is None:
            return None
        _, _, grads, _ = self._gathered()
        # A sparse gradient is gathered as its values, a new view at each gather: the same view's memory.
        if len(grads) == len(clipped.grads) and all(
                (g is c or (g.data_ptr() == c.data_ptr() and g.shape == c.shape and g.dtype == c.dtype))
                and g._version == v for g, c, v in zip(grads, clipped.grads, self._step.clipped_versions)):
            return clipped
        return None

    def _end_step(self, found_inf: Optional[torch.Tensor] = None, grad_scale: Optional[torch.Tensor] = None,
                  scaler_skipped: bool = False, fused_pass: bool = True, evaluation: bool = False,
                  abandoned: bool = False, late_loss: bool = False, unended: bool = False,
                  defer_undo: bool = False) -> Optional[Read]:
        """The step boundary: packs this step's checks (with the fused pass over parameters and gradients
        unless fused_pass is False), reads them (eager) or starts their copy and reads the previous step's
        (lagged), and acts. Returns this step's packed read if the step was checked. `evaluation`: the
        checks of an evaluation forward, read at once, the step number kept (see NOTE: [Evaluation
        forwards between optimizer steps]); with `abandoned`, those of a batch the loop dropped, read so
        (see NOTE: [A batch the loop abandons]); with `late_loss`, a loss passed after its step, numbered
        as that step (NOTE: [A loss passed after its step]); with `unended`, forwards no step end read, at the
        watch's end (NOTE: [Forwards the loop never ended]). `defer_undo`: a compiled forward's next
        buffer snapshot is left due, for the caller to take (_begin_undo) once a skip put them back."""
        self._skip_now = False
        self._drop_failed_backward()
        if self._outside_evaluation is not None and not evaluation:
            self._end_outside_evaluation()
        forward_began_undo, self._undo_by_forward = self._undo_by_forward, False
        read = None
        if not evaluation:  # an evaluation through a submodule is no training step run outside the forward
            self._steps.step_ends(self._step.forwards, self._step.slots, self.step_count, self.model)
        if self._active:
            fused = None
            if fused_pass and (self._check_params or self._check_grads):
                fused = self._clipped_pass() or self._fused_pass()
            # The scale this step's loss was multiplied by, a tensor on the device (get_scale() would sync).
            scale = getattr(self.scaler, "_scale", None)
            groups = self._spikes.groups if self._spikes is not None and self._spikes.options.modules else None
            if self._written is not None and fused_pass and not evaluation and self._step.forwards == 0:
                self._written.record(self._record)  # a compiled forward's (NOTE: [Buffers a forward writes])
            recorded, counted, recorded_slots, absmax, limited = self._recorder.take()
            read = self._step.pack(recorded, counted, recorded_slots, fused, params=self._check_params,
                                   grads=self._check_grads, ignore=self.ignore, nan_only=self.nan_only,
                                   found_inf=found_inf, grad_scale=grad_scale, device=self._device,
                                   step=self.step_count - late_loss, scaler_skipped=scaler_skipped, scale=scale,
                                   groups=groups)
            read.params_unread = self._step.params_unread
            read.evaluation, read.abandoned, read.late_loss, read.unended = evaluation, abandoned, late_loss, unended
            read.after_inference = late_loss and self._inference_ended
            read.step_state = self._step_state
            read.params_rewritten = self._steps.params_rewritten
            read.loss_checked = self._step.given_loss and self._check_loss
            # NOTE: [A step without the model's own forward]
            # No forward of the model ran where its own hooks saw it: a compiled forward (its hooks idle),
            # the loop calling submodules itself (Lightning's self.net(x)), or both at once: past
            # torch.compile's recompile limit the forward runs uncompiled, its submodules' hooks work
            # again, and the model's own, compiled on their own, stay idle. Its input and output were not
            # checked: a dirty batch first showed at the first submodule, read as that module's fault (a
            # probe, session 48). The event says so whatever the submodules' hooks recorded.
            read.forward_unchecked = not evaluation and self._step.forwards == 0
            if self._headroom is not None and not evaluation:
                read.headroom = self._headroom.start(
                    self._step.slots, absmax, limited, fused, params=self._check_params, grads=self._check_grads,
                    ignore=self.ignore, scale=scale,  # None until an enabled scaler scales
                    grads_scaled=isinstance(grad_scale, torch.Tensor), device=self._device,
                    scale_in_summary=read.tail.scale)  # see NOTE: [The loss scale read with the summary]
            if not evaluation:
                agree.start(read, self.process_group)
        if not evaluation:  # an evaluation keeps the number of the step it comes before
            self.step_count += 1
            # A loss passed before any forward of the next step is late only after a step whose own forward
            # ran and that was given no loss (NOTE: [A loss passed after its step]).
            self._loss_may_come_late = self._step.forwards > 0 and not self._step.given_loss
            self._inference_ended = False
        self._reset_step()
        if self.on_event == "locate" and not evaluation:
            self._capture_step_state()
        try:
            self._read_ended(read, evaluation)
        finally:  # also after an action raised: the next step begins with the buffers as they are now
            if self._undo is not None and not forward_began_undo and not evaluation and self._active:
                self._undo_due = True  # see NOTE: [Buffers of compiled forwards]
                if not defer_undo:
                    self._begin_undo()
        return read

    def _read_ended(self, read: Optional[Read], evaluation: bool) -> None:
        """_end_step's read of the step that ended (eager: now; lagged: the previous one's, this one's
        started), and what acting on it takes."""
        at_once = self.sync == "lagged" and not evaluation and read is not None and self._needs_host_verdict()
        if self.sync == "lagged" and not evaluation and not (at_once and not agree.with_other_ranks(self.process_group)):
            if read is not None:
                agree.wait(read)
                steps.start_copy(read)
            pending, self._pending = self._pending, read
            if pending is not None:
                self._evaluate(pending)
            if at_once and bool(read.summary[0] > 0):  # see NOTE: [A lagged step one rank must read at once]
                self._skip_at_once(read)
        elif read is not None:
            # NOTE: [An evaluation on one rank]
            # A validation pass may run on one rank only. Read at once, an evaluation also read the lagged
            # watch's pending training step first, and acting on that step makes collectives (a bad step
            # gathers the ranks' places, a spike is agreed on): on one rank, they waited for the others,
            # which were in the next step's backward (a hang, a probe, session 46). With other ranks, the
            # pending step is left for the next training step's end, where every rank reads it.
            if not evaluation or not agree.with_other_ranks(self.process_group):
                self.flush()  # lagged: the previous step's read comes first
            self._evaluate(read)
        if read is not None and self._rollback is not None and not evaluation:
            self._rollback.step_ended(read.step, proven=self._pending is not read)

    def _begin_undo(self) -> None:
        """Takes the next step's buffer snapshot where no forward of it will (NOTE: [Buffers of compiled
        forwards]), if one is due."""
        if self._undo_due:
            self._undo_due = False
            self._undo.begin()

    def _end_evaluation(self, first_slot: int, microbatch: Optional[int]) -> None:
        """Reads an evaluation's checks at once: those of slots `first_slot` on, recorded by the forward
        of `microbatch` (None: a loss alone) (see NOTE: [Evaluation forwards between optimizer steps])."""
        if self._steps.grad_forwards == 0 and first_slot == 0:  # the step holds nothing else
            self._end_step(fused_pass=False, evaluation=True)
            return
        # NOTE: [An evaluation inside a training step]
        # Lightning runs its validation loop wherever `val_check_interval` falls, inside a window of
        # gradient accumulation too: between two microbatches of one optimizer step. Read with the step,
        # a dirty validation batch was that step's (named its input, microbatch 2 of a step of two),
        # so a skip dropped a healthy training step and a raise stopped fit(). It is read now, alone:
        # its records are taken out of the step's (WatchRecorder.take(first_slot)), packed and read as
        # an evaluation's, and its slots and microbatch number are given back, so the step goes on as if
        # it had never run (its next microbatch takes the number). Nothing of the training step is put
        # back for it (`within_step`): in eval mode under no_grad it changed no buffer and no gradient.
        recorded, counted, recorded_slots, _, _ = self._recorder.take(first_slot)
        try:
            if recorded_slots:
                own = Step()  # none of the step's losses; numbered as an evaluation between steps is: microbatch 0
                own.slots = self._step.slots[:first_slot] + [(*label[:3], 0) for label in self._step.slots[first_slot:]]
                own.inputs = {0: self._step.inputs[microbatch]} if microbatch in self._step.inputs else {}
                own.outputs = self._step.outputs  # by slot id: the same ids
                read = own.pack(recorded, counted, recorded_slots, None, params=False, grads=False, ignore=self.ignore,
                                nan_only=self.nan_only, found_inf=None, grad_scale=None, device=self._device,
                                step=self.step_count, scaler_skipped=False)
                read.evaluation = read.within_step = True
                self._evaluate(read)
        finally:
            self._step.truncate(first_slot)
            if microbatch is not None:
                self._step.inputs.pop(microbatch, None)
                self._step.forwards = microbatch
            self._steps.last = None

    def _params_as_found(self) -> bool:
        """Whether a bad verdict is read while the parameters are still as the step found them: eager,
        or lagged with the skip on the device (see NOTE: [Parameters read when they add information])."""
        return self.sync == "eager" or self._skip_on_device

    def _gathered(self) -> tuple:
        """_C.ParamGrads.gather's parameters (the optimizer's, else the model's), gradients and names."""
        if self.optimizer is not None:
            return self._params.gather(self.optimizer.param_groups, groups=True)
        return self._params.gather(list(self.model.parameters()), groups=False)

    def _fused_pass(self, read_params: Optional[bool] = None) -> Optional[Pass]:
        """The pass over parameters and gradients; `read_params` None: as NOTE: [Parameters read when
        they add information] decides for this step."""
        gathered = self._gathered()
        decided, gated = read_params is None, False
        if decided:
            as_found = self._params_as_found()
            records_finite = None if as_found else self._recorder.finite()
            read_params = reads_params(
                self.step_count // self.every, self._params_every, as_found=as_found,
                forward_checked=self._step.output_checked,
                snapshot_due=self._rollback is not None and self._rollback.due(self.step_count),
                records_finite=records_finite)
            gated = not read_params and records_finite is True
        run = functools.partial(run_fused_pass, gathered, self._sharded, self._device, self._profile,
                                headroom=self._headroom is not None, op=self._pass_op)
        fused = run(read_params=read_params)
        if gated and fused is not None and _C.counts_zero(fused.counts) is False:
            # A non-finite gradient with finite records (a parameter reached the loss outside the forward,
            # as an L2 term): read the parameters while they are as the step found them (see NOTE:
            # [Parameters read when they add information]).
            read_params = True
            fused = run(read_params=True)
        if decided:
            self._step.params_unread = self._check_params and not read_params
        return fused
