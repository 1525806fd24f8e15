"""What the watch's hooks do per call: each records the fused checks of the tensors it sees in a slot
of the step (see NOTE: [The watch's recorder]); and `Watch.loss`, the one check the loop calls itself.
The hot path, a module's hooks: one call each into C++ (NOTE: [Module hooks in C++]) and one fused op.
Where the hooks go is install.py's."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _C
from ..locator.source import warn_at_user_line
from ..recompute import recomputation
from ..report import NonFiniteError
from . import agree, scaler_hook
from .forwards import Forward
from .inputs import Layout, input_tensors, mask_rows, walked_tensors
from .options import SKIPPING


def transformed() -> bool:
    """Whether a torch.func transform (grad, vmap, jvp, functionalize) is running: the watch's hooks
    then do nothing (NOTE: [The watch under torch.func])."""
    # NOTE: [The watch under torch.func]
    # Inside torch.func.grad, vmap or jvp, a module's outputs and gradients are functorch's wrappers of
    # the transform's level (no storage; vmap's batched tensors, which the fused op has no batching rule
    # for): a watched model raised under per-sample gradients (vmap(grad)), MAML-style grad and vmap'd
    # inference, healthy or not. As under torch.compile, the hooks stand down there; what a transform
    # leaves in the parameters' gradients (a per-sample gradient's mean assigned to .grad) is checked
    # by the step's pass, outside the transform. The same test as the C++ module hooks' (one
    # thread-local read).
    return _C.transformed()


def floating_tensors(obj: Any) -> list[torch.Tensor]:
    """The floating and complex strided tensors in obj: a module's usual arguments and outputs (a
    tensor, a tuple of tensors and None) by a C++ fast path (two calls per hooked module call), anything
    else by the one container walker; the same ones either way."""
    found = _C.plain_floating_tensors(obj)
    return found if found is not None else walked_tensors(obj)[0]


class Hooks:
    """The hooks of `Watch` (a part of it: the state they use is the Watch's)."""

    @property
    def _active(self) -> bool:
        """Whether this step is checked and the hooks are on (the module hooks read it in C++)."""
        return self._hooks.active

    @_active.setter
    def _active(self, value: bool) -> None:
        self._hooks.active = value

    def _forget_last(self) -> None:
        # NOTE: [Checking each tensor once]
        # A container returns its last child's output and passes its input on to its first child: the
        # same tensor. The last output checked is remembered with its version counter, so the container
        # reuses the child's slot (which names the innermost module) unless something changed it in place
        # in between. Gradient hooks are keyed by (autograd node, output): a tensor taken by several
        # modules (a container and its first child, a block's main path and its downsample) is hooked
        # once, for the module that took it last. Both are dropped when the forward returns: no
        # activation outlives its use (but a fused watch's deferred checks, within their bound: NOTE:
        # [Fused records]).
        self._hooks.forget()

    def _record(self, phase: str, site: Any, call: int, tensors: list, masks: tuple[int, ...] = ()) -> None:
        self._recorder.record(tensors, self._hooks.slot(phase, site, call), masks)

    def _hook_grads(self, obj: Any, phase: str, site: Any, call: int) -> None:
        # NOTE: [Where a gradient is checked]
        # The gradient w.r.t. each input of a module is what the module's backward (and any other
        # consumer of the tensor) produced. It is caught by a pre-hook on the autograd node that made the
        # input (what a tensor hook does, for less), registered before the module runs: it sees the value
        # the module received even when the module modifies it in place (ReLU(inplace=True)). Full
        # backward hooks would wrap every module in an autograd Function and forbid in-place ops on module
        # outputs. Leaves have no node (their gradients are the parameters', phase grad); the hooks go
        # with the graph. The recorder places them (C++ pre-hooks, see NOTE: [The watch's recorder]).
        self._hooks.hook_grads(obj, phase, site, call)

    def _hook_output_grads(self, output: Any, walked: Optional[tuple[list[torch.Tensor], Layout]]) -> None:
        """Places the checks of the gradients of the loss w.r.t. the model's output (phase loss): a bare
        tensor's in one slot, each floating tensor of another output in a slot of its own, named by its
        field (NOTE: [Naming the output's fields]). The gradients arrive one by one, each its own record:
        a Siamese model's two outputs in one slot were reported as one place, without saying which output
        held the NaN (adambielski/siamese-triplet#18, a probe, session 51). `walked`: the output's
        walked_tensors() (None for a tensor)."""
        if walked is None:
            self._hook_grads(output, "loss", self._root, self._root.calls)
            return
        tensors, layout = walked
        for tensor, node in zip(tensors, layout.nodes):
            slot = len(self._step.slots)  # the id of the slot hook_grads makes, if it makes one
            self._hook_grads(tensor, "loss", self._root, self._root.calls)
            if len(self._step.slots) > slot:
                self._step.outputs[slot] = Layout(nodes=[node])

    def loss(self, value: torch.Tensor, name: str = "loss") -> torch.Tensor:
        """Checks the loss value itself (phase loss_value), in the step's one read: a loss can be NaN
        with finite gradients (a mean over no elements: cross-entropy whose targets are all
        ignore_index), and no hook sees it, since the loss is not an output of the model. Pass the
        unscaled loss (before GradScaler.scale). Checks nothing in a watch made with loss=False. Its
        mean (over its elements and the step's microbatches; an empty loss adds none) goes to the step's
        record and the spike alarms, read with the step's one read (kept even with loss=False or an
        ignored name). A validation loss (no gradients, the model in eval mode, between optimizer
        steps) is read at once as an evaluation's, without record or spike sample (see NOTE:
        [Evaluation forwards between optimizer steps]).

        Args:
            value: the loss tensor (any floating tensor: each of its elements is checked).
            name: how events name it (several losses: "ce", "aux"; matched by ``ignore``).

        Returns:
            ``value`` itself, so that ``w.loss(criterion(out, y)).backward()`` reads naturally.

        Raises:
            TypeError: value is not a floating (or complex) tensor (an integer one cannot be non-finite
                and has no mean to record), or name is not a string."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Watch.loss: value must be a torch.Tensor, got {type(value).__name__}")
        if not isinstance(name, str):
            raise TypeError(f"Watch.loss: name must be a string, got {name!r}")
        if not (value.is_floating_point() or value.is_complex()):
            raise TypeError(f"Watch.loss: value must be a floating tensor (the loss before .item() or .long()), "
                            f"got one of {value.dtype}")
        if not self._active or torch.compiler.is_compiling() or transformed():
            return value
        evaluating = self._evaluating()  # a validation loss: its own read, not the next step's (see the NOTE)
        # NOTE: [A loss passed after its step]
        # `optimizer.step(); w.loss(loss)` (the tutorials' order for logging) counted a batch's loss into
        # the next step: an all-ignored batch's NaN loss (zero gradients) skipped or stopped the next,
        # healthy update, its step named, and the timeline's losses were a step off (a probe, session
        # 48). A loss passed before any forward of the model in its step, when the step before ran the
        # model's own forward and was given no loss, came after its step's end: it is read at once,
        # alone, as an evaluation's loss is, numbered as the step it came after, with no record or spike
        # sample, and said so once (a host read of its own each time; a lagged watch's pending step is
        # read with it). Not after a compiled forward (its hooks idle: every loss comes "before any
        # forward") or a step given a loss (an encoder's loss passed before a watched decoder runs).
        # Without an optimizer, an inference forward is a step ended when it returns: a loss passed after
        # it is its own, read the same way but neither late nor warned of (an evaluation loop's loss was
        # "passed after optimizer.step()", a probe, session 49).
        late = not evaluating and self._loss_may_come_late and self._step.forwards == 0
        if late:
            self._end_outside_evaluation()  # a validation through submodules before it is read as its own
            late = not self._step.slots  # (else submodules ran since the step ended: the loss goes with them)
        # Given in its place: after a forward of the step (a loss passed before any, and counted into the
        # step, leaves the next one's late losses still told apart: a probe, session 48).
        if self._step.forwards > 0 and not evaluating:
            self._step.given_loss = True
        if late and not self._warned_late_loss and not self._inference_ended:
            self._warned_late_loss = True
            warn_at_user_line("nanfast.watch: Watch.loss was called before any forward of the model in its step "
                              "(after optimizer.step()?): such a loss is read at once, alone (a host read of its "
                              "own, and of a lagged watch's pending step), as the step that ended, which a "
                              "non-finite one can no longer skip or stop; "
                              "call w.loss(loss) before optimizer.step() to have it read with its step", UserWarning)
        if evaluating and self._outside_evaluation is not None:  # read with the submodules' records before it
            first, self._outside_evaluation = self._outside_evaluation, None
        else:
            first = len(self._step.slots)
        if self._keeps_losses and value.is_floating_point() and not (evaluating or late) and value.numel() > 0:
            # float64 on the device, no graph, no sync (see NOTE: [A loss's mean without ATen ops]); an
            # empty loss has no mean (ATen's NaN would enter the records as a NaN loss, with no event)
            self._step.losses.setdefault(name, []).append(_C.loss_mean(value))
        if self._check_loss:
            site = self._loss_sites.get(name)
            if site is None:
                site = self._loss_sites[name] = self._site(name, "")
            tensors = floating_tensors(value)
            if tensors and not site.ignored:
                self._record("loss_value", site, 1, tensors)
        if evaluating and len(self._step.slots) > first:  # nothing recorded (loss=False, ignored): nothing to read
            self._end_evaluation(first, None)
        elif late and self._step.slots:
            try:
                self._end_step(fused_pass=False, evaluation=True, late_loss=True)
            except NonFiniteError:
                if self.scaler is not None:  # between scaler.step() and scaler.update(): that update won't come
                    scaler_hook.end_iteration(self.scaler)
                raise
        return value

    def _outside_forward(self, grad: bool) -> None:
        """Called by ModuleHooks when hooked submodules run outside the model's forward, at the first such
        call and whenever the grad mode of such calls changes (NOTE: [Submodules called outside the
        model's forward], module_hooks.h): the evaluation they ended is read, and calls without
        gradients in an evaluation (an optimizer, the model in eval mode) begin one."""
        self._end_outside_evaluation()
        self._hooks.forward_id += 1  # their calls are numbered from 1, as in a forward of the model's
        if not grad and self._evaluating():
            self._outside_evaluation = len(self._step.slots)

    def _end_outside_evaluation(self) -> None:
        """Reads the records of submodules run outside the model's forward in an evaluation, if any, as
        that evaluation's (see _outside_forward)."""
        first, self._outside_evaluation = self._outside_evaluation, None
        if first is not None:
            self._end_evaluation(first, None)

    def _evaluating(self) -> bool:
        """Whether what runs now is an evaluation (see NOTE: [Evaluation forwards between optimizer steps]
        and NOTE: [An evaluation inside a training step]): an optimizer, no gradients, the model in eval
        mode."""
        return self.optimizer is not None and not torch.is_grad_enabled() and not self.model.training

    # NOTE: [The watch and torch.compile]
    # Inside a region torch.compile traces, the hooks do nothing (is_compiling() is constant-folded
    # while tracing; the submodules' hooks, functions of the extension, are traced as stand-ins that do
    # nothing: NOTE: [Module hooks without a Python frame]): reading a tensor's grad_fn and keeping
    # Python state per call would break the graph at every module. What runs compiled is therefore not
    # checked module by module; the fused pass over parameters and gradients at optimizer.step(),
    # outside the compiled region, still sees every non-finite value the step leaves in them, and
    # anything run eagerly is hooked as usual.
    # Activation checkpointing re-runs modules inside backward (nanfast/recompute.py): that is neither
    # another call nor another forward, and its values were checked when the forward ran. Only with
    # use_reentrant=True does backward flow through the graph it rebuilds: its gradients are hooked there.

    def _before_model(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._idling or torch.compiler.is_compiling() or recomputation() is not None or transformed():
            return
        self._drop_failed_backward()
        if self.optimizer is not None and not self._sharded and torch.is_grad_enabled():
            if (self._steps.abandoned(self.optimizer, self._recorder.backward_finished())
                    and self._recorder.finite() is False  # see NOTE: [A batch the loop abandons]
                    and not agree.with_other_ranks(self.process_group)):
                self._end_step(fused_pass=False, evaluation=True, abandoned=True)
        interrupted = self._steps.enter(self.model)
        if interrupted is not None:
            self._hooks.in_forward = False
            self._drop_forward(interrupted)
        if self._outside_evaluation is not None:
            self._end_outside_evaluation()
        self._hooks.enter_forward()
        grad, has_optimizer = torch.is_grad_enabled(), self.optimizer is not None
        if self._steps.unended(grad, has_optimizer):
            self._reset_step()  # see NOTE: [Steps that never end]
        self._steps.note_forward(grad, has_optimizer)
        if not self._active:
            return
        step, hooks = self._step, self._hooks
        self._steps.begin_forward(len(step.slots), step.forwards)
        hooks.forward_id += 1
        hooks.microbatch = step.forwards
        step.forwards += 1
        if grad and not model.training:
            step.eval_mode_with_grad.add(hooks.microbatch)
        if self._model_changed and hooks.microbatch == 0:  # see NOTE: [A model changed after watch()]
            self._follow_model()
            if self._undo is not None:
                self._undo.relist()
        if self._undo is not None and hooks.microbatch == 0:
            self._undo.begin()
            self._undo_by_forward = True
        if self.action in SKIPPING and self.optimizer is not None and hooks.microbatch == 0:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            gradless = frozenset(id(p) for p in params if p.grad is None)
            step.gradless = gradless if len(gradless) < len(params) else None  # see NOTE: [Gradients a skipped step gives back]
        if self.on_event == "locate" and hooks.microbatch == 0:
            self._capture_step_state()
        if self._check_inputs and not self._input.ignored:
            tensors, layout = input_tensors(args, kwargs)  # see NOTE: [Naming the input's entries]
            if tensors:  # an additive mask's -inf are not counted (see NOTE: [Additive masks])
                self._record("input", self._input, 1, tensors, mask_rows(layout, len(tensors), self.model.forward))
                step.inputs[hooks.microbatch] = layout
        hooks.enter(self._root, args)

    def _after_model(self, model: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._idling or torch.compiler.is_compiling() or recomputation() is not None or transformed():
            return
        forward = self._steps.end_forward()
        self._hooks.in_forward = False
        if self._active:
            if self._check_loss:
                # Any output but a tensor is walked once, for its check, its fields' names (NOTE: [Naming
                # the output's fields], kept by check_output) and its gradients' checks.
                walked = None if isinstance(output, torch.Tensor) else walked_tensors(output)
                if self._hooks.check_output("forward", self._root, output, walked):
                    self._step.output_checked = True
                if torch.is_grad_enabled() and not self._root.ignored:
                    self._hook_output_grads(output, walked)
            if self._written is not None:
                self._written.record(self._record)  # see NOTE: [Buffers a forward writes]
            self._forget_last()
        if self.optimizer is None and not torch.is_grad_enabled() and not self._steps.training:
            # Inference: each forward is a step, of activations only; one inside a training step (an
            # eval pass before w.step()) belongs to that step.
            self._end_step(fused_pass=False)
            self._inference_ended = True  # a loss passed next is this forward's (NOTE: [A loss passed after its step])
        elif self._evaluating():
            # NOTE: [Evaluation forwards between optimizer steps]
            # A forward in eval mode without gradients (a
            # validation pass after optimizer.step(): Lightning and the HF Trainer call model.eval()
            # and run it under inference_mode or no_grad) is not part of the training step that
            # follows: read when it returns, its own event (Event.evaluation). Counted into that step, a
            # dirty validation batch skipped (action="skip") or stopped (raise, at optimizer.step()) a
            # healthy training step, named as its input batch. It is no step of its own either: the
            # step numbers stay the optimizer's, and it leaves no timeline record, spike or headroom
            # sample (those describe training steps), makes no collective (a validation pass may run on
            # one rank only), and, with nothing to skip, a skip or rollback watch warns. A forward
            # without gradients in train mode (a GAN's generator for its discriminator's step, PPO's
            # old log-probabilities) is part of the training step, as before, with no read of its own.
            # A loss given to Watch.loss in an evaluation is read the same way.
            self._end_evaluation(*((forward.first_slot, forward.microbatch) if forward is not None else (0, None)))

    def _after_model_raised(self, model: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._idling or torch.compiler.is_compiling() or transformed() or not self._steps.leave():
            return  # (not leave(): another thread's forward is running, this one was refused at its start)
        forward = self._steps.end_forward()
        self._hooks.in_forward = False
        if forward is not None:
            self._drop_forward(forward)

    def _drop_failed_backward(self) -> None:
        # See NOTE: [A backward that raised].
        if self._recorder.backward_failed() and self._steps.last is not None:
            self._drop_forward(self._steps.last)

    def _drop_forward(self, forward: Forward) -> None:
        # NOTE: [A forward that raised]
        # A forward that raised, or whose backward raised (an OOM caught by the loop, which goes on with
        # the next batch), is forgotten: its records and the gradient checks it placed (made inert) go,
        # with its references to activations, and the next forward takes its microbatch number. Earlier
        # forwards of the step are kept.
        self._recorder.discard(forward.first_slot)
        self._step.truncate(forward.first_slot)
        self._step.forwards = forward.microbatch
        self._steps.training = forward.training
        self._steps.last = None
        self._forget_last()
