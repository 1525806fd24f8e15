"""Where a watch stands within a step, beyond its records: the forward running now and the last one (so
that a microbatch whose forward or backward raised can be forgotten), and, without an optimizer,
whether a training step is open and whether the loop moved on to another step without ending it
(w.step() never called)."""

from __future__ import annotations

import sys
import threading
import warnings
from types import FrameType
from typing import NamedTuple, Optional

import torch

from .._stack import frames_up
from ..locator.source import user_stacklevel
from .restore import rewritten_in_forward

# A step that has taken this many forwards with gradients without ending is taken for a loop that never
# ends its steps: its records are dropped (see NOTE: [Steps that never end]). Forwards under no_grad
# (a long validation loop between two optimizer steps) do not count.
MAX_FORWARDS_PER_STEP = 1024

# NOTE: [Steps that never end]
# Without an optimizer the watch cannot see a step end unless w.step() is called. A loop that never
# calls it would have its records grow forever and never be read. Reading them at the next forward
# would sync the host inside a hook, so instead the watch drops them and warns once. It takes a new
# step to have begun when a forward with gradients starts after the trainable parameters were
# modified in place since the step's first forward (an optimizer the watch was not given stepped
# them; in gradient accumulation they do not change between microbatches), as long as w.step() has
# never been called (a loop that calls it knows it must), or when a step reaches
# MAX_FORWARDS_PER_STEP forwards with gradients (with or without an optimizer).
# NOTE: [An optimizer the watch no longer sees]
# With an optimizer, a step ends at its step(). A loop that builds a new optimizer after watch()
# (common when unfreezing layers) steps one the watch does not hook: no step ends, nothing is read,
# and every fault goes unreported. A step can legitimately change its parameters in place between its
# forwards (SAM and adversarial weight perturbation: perturb, forward again, restore, then step; with
# gradient accumulation, at every microbatch: a warning at the second change was false there, a probe,
# session 44), but its steps end. So a step that found the parameters changed between its forwards at
# least twice warns (once) only when it has gone on for more forwards with gradients than twice the
# longest step that ended, and than UNSEEN_AFTER. Reading nothing it cannot read in a hook, the watch
# only says so; its records are dropped at MAX_FORWARDS_PER_STEP as above.
UNSEEN_AFTER = 16
UNSEEN_OPTIMIZER = ("nanfast.watch: the parameters were updated in place between forwards {updates} times "
                    "without optimizer.step() of the optimizer given to watch(), so no step has ended: is another "
                    "optimizer stepping them (one made after watch())? Watch that one instead (w.remove(); "
                    "nanfast.watch(model, new_optimizer)); until a step ends, nothing this watch records is read.")
# A step whose module hooks recorded while the model's own forward never ran: the loop (a Lightning
# training_step) calls a submodule. Detection and skips still work, but calls are numbered on across
# the step's microbatches (a new forward resets them) and the batch is not checked as the model's input.
OUTSIDE_FORWARD = ("nanfast.watch: step {step}: submodules of the watched {model} ran but its own forward did not "
                   "(the loop, or a Lightning training_step, calls a submodule, as self.net(x); or the model is "
                   "torch.compile'd and its forward now runs uncompiled, past torch.compile's recompile limit, while "
                   "its own hooks stay compiled, idle): their calls are numbered on across the step's microbatches "
                   "and the batch is not checked as the model's input. Watch the module whose forward runs "
                   "(nanfast.watch(model.net, ...); in Lightning, NanfastCallback(module=\"net\")), or keep the "
                   "forward compiled (dynamic=True, torch._dynamo.mark_dynamic, or a higher "
                   "torch._dynamo.config.recompile_limit).")
UNCLOSED_STEP = ("nanfast.watch: a new step began while the previous one was never ended ({why}). A step ends "
                 "at optimizer.step() of the optimizer given to watch(), or at w.step(): without an optimizer, "
                 "call w.step() at the end of each step, or pass the optimizer (nanfast.watch(model, optimizer)). "
                 "The checks of steps never ended are dropped unread.")


class Forward(NamedTuple):
    """A forward of the model in this step: where its records begin, to drop them if it raises."""

    first_slot: int
    microbatch: int
    training: bool  # whether a training forward had opened the step before this one


# NOTE: [A forward interrupted by Ctrl-C]
# torch calls a forward hook registered with always_call=True when the forward raises an Exception, not
# a KeyboardInterrupt (a BaseException): a forward stopped by Ctrl-C in a notebook stayed open, and the
# healthy steps after it raised over its records (a probe, session 44). So each forward notes the frame
# of torch's call that runs it; a forward that begins while one is still open drops the open one (as
# NOTE: [A forward that raised] says) unless that frame is still on the stack: a model calling itself
# within its forward. The frame is let go by the model's last forward hook.
_CALL_CODES = (torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__)

# NOTE: [One watched model called from several threads]
# A watch follows one step at a time: its records, call numbers and step belong to the forward running.
# A model served by a pool of threads, each calling it while another's forward ran, mixed them: healthy
# calls raised over another thread's bad batch, an IndexError escaped a hook, modules were named with
# call numbers they never had (a probe, session 44). So a forward that begins while another thread's
# forward of the model is running is refused, and the running one is left as it is. Calls from several
# threads one after another are fine.
CONCURRENT = ("nanfast.watch: the watched {model} was called in thread {thread} while its forward in thread {other} "
              "was running: a watch follows one forward at a time. Give each thread its own copy of the model with a "
              "watch of its own (copy.deepcopy(model) before watching), or call the model from one thread at a time.")


def calling_frame() -> Optional[FrameType]:
    """In a model's forward pre-hook: the frame of torch's call that runs the forward (None if not found)."""
    return next((frame for frame in frames_up(sys._getframe(1)) if frame.f_code in _CALL_CODES), None)


class StepState:
    """The forward running now and the last one, and (without an optimizer) the training step left open."""

    def __init__(self, model: torch.nn.Module):
        # Less the weights a forward renormalises in place (NOTE: [What a step writes besides the update]):
        # their writes are the forward's own, not an optimizer's update.
        renormed = {id(m.weight) for m in rewritten_in_forward(model)}
        self._trainable = [p for p in model.parameters() if p.requires_grad and id(p) not in renormed]
        self.forward: Optional[Forward] = None  # running now
        # The frame of the model's call that runs now, and its thread (see enter()).
        self._frame: Optional[FrameType] = None
        self._thread = 0
        self._lock = threading.Lock()
        self.last: Optional[Forward] = None  # the last one that began in this step
        self.training = False  # a forward with gradients ran in this step (without an optimizer)
        self.grad_forwards = 0  # forwards with gradients in this step
        self.ended_by_user = False  # w.step() was called at least once
        # The last forward with gradients, with an optimizer, ran with some of its parameters requiring
        # them (see NOTE: [A batch the loop abandons]).
        self._grads_wanted = False
        self._versions = 0
        self._updates = 0  # forwards of this step that found the parameters updated since the previous one
        self._longest = 0  # the most forwards with gradients of a step that ended
        self._warned = False
        self._warned_unseen = False
        self._warned_outside = False

    def reset(self) -> None:
        """The step ended (or was dropped)."""
        self.forward = self.last = None
        self.training = False
        self._longest = max(self._longest, self.grad_forwards)
        self.grad_forwards = 0
        self._updates = 0

    def begin_forward(self, first_slot: int, microbatch: int) -> None:
        self.forward = self.last = Forward(first_slot, microbatch, self.training)

    def end_forward(self) -> Optional[Forward]:
        """The forward returned or raised: returns it if it was still running (it raised)."""
        forward, self.forward = self.forward, None
        return forward

    def enter(self, model: torch.nn.Module) -> Optional[Forward]:
        """At the model's forward pre-hook: takes the model's forward for this thread (see NOTE: [One
        watched model called from several threads]).

        Returns:
            The forward to drop, still open from a call no longer running (see NOTE: [A forward
            interrupted by Ctrl-C]), or None.

        Raises:
            RuntimeError: another thread's forward of the model is running."""
        me = threading.get_ident()
        with self._lock:
            stale = None
            if self._frame is not None:
                frame = sys._getframe(1) if self._thread == me else sys._current_frames().get(self._thread)
                if any(f is self._frame for f in frames_up(frame)):  # still running
                    if self._thread != me:
                        raise RuntimeError(CONCURRENT.format(
                            model=type(model).__name__, thread=threading.current_thread().name,
                            other=next((t.name for t in threading.enumerate() if t.ident == self._thread), "?")))
                    return None  # the model calls itself within its forward: the outer call keeps it
                stale = self.end_forward()
            self._frame, self._thread = calling_frame(), me
        return stale

    def leave(self) -> bool:
        """At the model's last forward hook, called when the forward returns or raises: gives the model's
        forward back. Returns False when another thread holds it (this call was refused by enter())."""
        if self._frame is not None and self._thread != threading.get_ident():
            return False
        self._frame = None
        return True

    def unended(self, grad_enabled: bool, has_optimizer: bool) -> bool:
        """At the start of a forward: True if the current step is one the loop left without ending it
        (see NOTE: [Steps that never end]); warns the first time."""
        if grad_enabled and self.grad_forwards >= MAX_FORWARDS_PER_STEP:
            why = f"{self.grad_forwards} forwards with gradients without the step ending"
        elif has_optimizer:
            if grad_enabled and self.grad_forwards:
                self._note_updates()
            return False
        elif (not grad_enabled or not self.training or self.ended_by_user
              or self._version_sum() == self._versions):
            return False
        else:
            why = "the parameters were updated since the step's first forward"
        if not self._warned:
            self._warned = True
            warnings.warn(UNCLOSED_STEP.format(why=why), UserWarning, stacklevel=user_stacklevel())
        return True

    def note_forward(self, grad_enabled: bool, has_optimizer: bool) -> None:
        """A forward starts (after unended()): one with gradients counts, and opens the training step."""
        self.grad_forwards += grad_enabled
        if has_optimizer and grad_enabled and self.grad_forwards == 1:
            self._versions = self._version_sum()  # see NOTE: [An optimizer the watch no longer sees]
        if has_optimizer or not grad_enabled or self.training:
            return
        self.training = True
        if not self.ended_by_user:
            self._versions = self._version_sum()

    def step_ends(self, forwards: int, slots: list, step: int, model: torch.nn.Module) -> None:
        """At a step's end: warns once if module hooks recorded (phases forward, backward) while none of
        the model's own forwards ran (`forwards`, the Step's count)."""
        if forwards or self._warned_outside or not any(label[0] in ("forward", "backward") for label in slots):
            return
        self._warned_outside = True
        warnings.warn(OUTSIDE_FORWARD.format(step=step, model=type(model).__name__), UserWarning,
                      stacklevel=user_stacklevel())

    def abandoned(self, optimizer: torch.optim.Optimizer, backward_finished: bool) -> bool:
        """At the start of every forward with gradients, with an optimizer: whether the step's forwards so
        far may be a batch the loop abandoned (the caller also asks whether they counted a non-finite
        value). `backward_finished`: a backward of the whole graph finished in the step since the previous
        forward."""
        # NOTE: [A batch the loop abandons]
        # A loop's own guard drops a bad batch after its backward: `if not torch.isfinite(norm):
        # optimizer.zero_grad(); continue`. No optimizer step ends the watch's step, so the dropped
        # batch's checks stayed in it, and the next batch's optimizer.step() read them: a skip watch
        # skipped that healthy batch's update too (a probe, session 47), a raise stopped it, and the
        # event blamed its step. The next forward with gradients tells: since the previous forward, a
        # backward of the whole graph finished and every gradient of the optimizer's was set to None
        # (zero_grad's default) while no parameter changed. In gradient accumulation the gradients are
        # still there; SAM's second forward follows its perturbation of the parameters; a gradient
        # penalty's autograd.grad is no backward of the whole graph; two forwards before one backward
        # have no backward between them; and a forward that ran with every parameter of the optimizer's
        # frozen (Lightning's toggle_optimizer freezes a GAN's discriminator while its generator's step
        # runs it) made no gradient to drop. Sharded parameters are left out: FSDP2 keeps a step's
        # gradients off the parameters until it reduces them. The same pattern is healthy elsewhere: a
        # GAN's discriminator run unfrozen in its generator's step, then zeroed; PGD adversarial
        # training's attack passes (zero_grad, backward, the input's gradient); an accumulation
        # microbatch that reaches none of the optimizer's parameters. Read there, each added a host read
        # to healthy steps (a review, session 47). So the batch is taken for abandoned only where its
        # checks already counted a non-finite value, known on the host without a read (a CPU watch that
        # checks at once: NOTE: [CPU counts kept as numbers]), and then read as an evaluation is (its
        # own read, the step's number kept, no timeline record, nothing to skip: a skip watch puts back
        # the buffers its forward changed). Elsewhere (an accelerator, fuse=True), and where gradients
        # are zeroed in place (`set_to_none=False`) or the guard comes before backward, the loop calls
        # `w.step()` in its guard. So does a distributed run: only the rank whose checks counted the
        # value would take the batch for abandoned, and act on it alone (a rollback on one rank, the
        # replicas apart; a raise while the others wait in DDP's all-reduce: a probe, session 48); there
        # the batch stays in the step, whose end every rank reads the same.
        groups = optimizer.param_groups  # each walk below stops at its first hit: O(1) in a healthy step
        wanted, self._grads_wanted = self._grads_wanted, any(p.requires_grad for g in groups for p in g["params"])
        if not (backward_finished and self.grad_forwards and wanted) or any(
                p.grad is not None for g in groups for p in g["params"]):
            return False
        return self._version_sum() == self._versions

    @property
    def params_rewritten(self) -> bool:
        """A forward of this step found the parameters written in place since the one before it."""
        return self._updates > 0

    def _note_updates(self) -> None:
        """A forward with gradients after the step's first, with an optimizer: counts an in-place update of
        the parameters since the previous one, and warns once the step is long (NOTE: [An optimizer the
        watch no longer sees])."""
        versions = self._version_sum()
        if versions == self._versions:
            return
        self._versions = versions
        self._updates += 1
        if (self._updates >= 2 and self.grad_forwards > max(UNSEEN_AFTER, 2 * self._longest)
                and not self._warned_unseen):
            self._warned_unseen = True
            warnings.warn(UNSEEN_OPTIMIZER.format(updates=self._updates), UserWarning, stacklevel=user_stacklevel())

    def _version_sum(self) -> int:
        return sum(p._version for p in self._trainable)
