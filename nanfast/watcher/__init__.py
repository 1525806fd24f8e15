"""`watch`: always-on NaN/inf checks for a training loop. Hooks enqueue fused checks whose counts stay
on the device; the host reads them once per step; a non-finite value gives an `Event` that names the
first place, in execution order, where it appeared."""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch

from .. import _C, distributed
from ..check import uncompiled
from ..locator.source import user_stacklevel
from ..recompute import recomputation
from . import agree, scaler_hook
from .actions import Actions
from .buffers import WrittenBuffers
from .events import KINDS, PHASES, Event, InputEntry, Place
from .forwards import StepState
from .fused_pass import parameter_names
from .headroom import DEFAULT_THRESHOLDS, Headroom, thresholds
from .history import DEFAULT_HISTORY, StepRecord, Tail, Timeline
from .hooks import Hooks
from .install import Installation, weakly_bound
from .inputs import walked_tensors
from .options import (ACTIONS, FUSE_BYTES, ON_EVENT, PARAMS_EVERY, PASS_THROUGH, SKIPPING, SYNC_MODES,
                      checks, fused_records, ignored, patterns, results_device, rollback_options, stepped_optimizer,
                      steps_option, typed_options, unknown_options, validate)
from .owned_hook import remove_inert_hooks, unhook_modules
from .profile import Profile
from .readings import Readings
from .restore import BufferUndo
from .rollback import Rollback
from .spikes import ModuleGroups, SpikeError, SpikeOptions, Spikes, spike_options
from .stepped import warn_of_parameters_outside
from .step import Read
from .step_end import StepEnd

__all__ = ["ACTIONS", "KINDS", "ON_EVENT", "PASS_THROUGH", "PHASES", "SYNC_MODES", "Event", "InputEntry", "Place",
           "SpikeError", "SpikeOptions", "StepRecord", "Watch", "watch"]


class Watch(Installation, Hooks, StepEnd, Actions, Readings):
    """Hooks on a model (and optimizer) that check for NaN/inf at every step; see `watch`. The facade:
    the hooks' placing (install.py) and calls (hooks.py), the step boundary (step_end.py) with the
    step's read (step.py), the actions (actions.py), what it tells a logger (readings.py) are its parts.

    Args:
        model, optimizer, and the options by keyword: as `nanfast.watch`, which documents them.

    Raises:
        TypeError, ValueError: as `nanfast.watch`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        inputs: bool = True,
        activations: bool = True,
        grads: bool = True,
        params: bool = True,
        modules: bool = True,
        params_every: int = PARAMS_EVERY,
        loss: bool = True,
        action: Union[str, Callable[[Event], Any]] = "raise",
        every: int = 1,
        first_step: int = 0,
        sync: str = "eager",
        ignore: Union[str, Iterable[str]] = (),
        nan_only: bool = False,
        scaler: Optional[Any] = None,
        pass_through: tuple[type, ...] = PASS_THROUGH,
        process_group: Optional[Any] = None,
        on_event: Optional[str] = None,
        rerun: Optional[Callable[[], Any]] = None,
        profile: bool = False,
        fuse: Optional[bool] = None,
        headroom: Union[None, float, Iterable[float]] = DEFAULT_THRESHOLDS,
        rollback_every: Optional[int] = None,
        rollback_device: Optional[Union[str, torch.device]] = None,
        history: int = DEFAULT_HISTORY,
        log_to: Any = None,
        spikes: Union[bool, dict, SpikeOptions] = True,
    ):
        wrapper, optimizer = optimizer, stepped_optimizer(optimizer)
        self._skip_on_device = validate(model, optimizer, action, every, sync, scaler, on_event, rerun)
        checks(inputs=inputs, activations=activations, grads=grads, params=params, modules=modules, loss=loss)
        self.pass_through = typed_options(nan_only=nan_only, profile=profile, scaler=scaler,
                                          process_group=process_group, pass_through=pass_through)
        rollback = rollback_options(action, params, rollback_every, rollback_device)
        spiking = spike_options(spikes, action, sync)
        inner = uncompiled(model)  # hooks and names on the model a torch.compile wrapper runs
        if optimizer is None and (inner is not model or getattr(model, "_compiled_call_impl", None) is not None):
            # NOTE: [A compiled model watched for inference]
            # A compiled forward runs no hook (NOTE: [The watch and torch.compile]); without an optimizer
            # nothing else is read unless the loop calls w.step() (its pass over the parameters and their
            # gradients): a compiled model's NaN outputs under no_grad left no event and no warning (a
            # probe, session 46).
            warnings.warn(f"nanfast.watch: {type(inner).__name__} is compiled: its forwards run none of "
                          "the watch's hooks, so its inputs, activations and outputs are not checked, and without an "
                          "optimizer only what w.step() reads is (its parameters and their gradients). Check a "
                          "compiled model's outputs with nanfast.check_all, or watch the uncompiled model.",
                          UserWarning, stacklevel=user_stacklevel())
        model = inner
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.action = action
        self.every = every
        self.sync = sync
        self.nan_only = nan_only
        self.ignore = patterns(ignore)
        self.process_group = process_group
        self.on_event = on_event
        self.rerun = rerun
        self._step_state: Optional[Any] = None  # locate.StepState of the current step (on_event="locate")
        self._entered = False  # its `with` block is open
        self._idling = False  # the hooks stand down while the watch runs a re-run or a callable action (Actions._idle)
        self._check_inputs = inputs
        self._check_activations = activations
        self._check_grads = grads
        self._hook_modules = modules
        self._check_params = params
        self._params_every = steps_option("params_every", params_every)
        self._check_loss = loss
        levels = thresholds(headroom)
        self._headroom: Optional[Headroom] = Headroom(levels) if levels else None

        self.events: list[Event] = []
        self._absorbed: set = set()  # the places of -inf that did no harm, told once (NOTE: [-inf that did no harm])
        self.last: Optional[Event] = None
        self.skipped_steps = 0
        self.scaler_skipped_steps = 0
        self.rolled_back_steps = 0
        self.last_rollback: Optional[tuple[int, int]] = None  # (the step that rolled back, the step put back)
        # The number of the current step (steps ended so far, from first_step).
        self.step_count = steps_option("first_step", first_step, least=0)

        # The pass's parameters with their names and gradients (see NOTE: [The pass's parameters in C++]).
        self._params = _C.ParamGrads(parameter_names(model))
        # FSDP2 / tensor parallel: the fused pass reads the local shards (the op has no DTensor rule).
        self._sharded = distributed.has_dtensor(list(model.parameters()))
        self._device = results_device(model)
        self._root = self._site("", type(model).__name__)
        self._input = self._site("input", "")
        # The buffers a training forward may write, checked after it (NOTE: [Buffers a forward writes]).
        self._written = WrittenBuffers(model, functools.partial(ignored, self.ignore)) if params else None
        self._handles: list = []
        self._retire: Optional[weakref.finalize] = None  # set by _install
        self._hooked: weakref.WeakSet = weakref.WeakSet()  # the modules with hooks (NOTE: [A model changed after watch()])
        # The step's counts, in execution order; the Step says what each slot id stands for (see
        # NOTE: [The watch's recorder]).
        self.fuse = fused_records(fuse, self._device)
        self._recorder = _C.WatchRecorder(self._device, profile, FUSE_BYTES if self.fuse else 0)
        self._pass_op = self._recorder.stats_with_deferred if self.fuse else _C.stats_on
        # What the module hooks share within a forward (see NOTE: [Module hooks in C++]).
        self._hooks = _C.ModuleHooks(self._recorder, walked_tensors, recomputation,
                                     weakly_bound(self, "_outside_forward"), self._check_grads, profiled=profile)
        self._outside_evaluation: Optional[int] = None  # see NOTE: [Submodules called outside the model's forward]
        self._profile: Optional[Profile] = Profile() if profile else None
        self._steps = StepState(model)
        self._loss_sites: dict[str, Any] = {}
        self._scaler_shared: Optional[Any] = None
        self._installed = True
        self._stepped = False
        self._skip_now = False
        self._held_grads: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []  # None: given back as None
        # accelerate's AcceleratedOptimizer, told of the steps a skip left unapplied (see NOTE: [A skipped
        # step for accelerate's scheduler]); True while it holds the watch's word.
        self._accelerated = wrapper if wrapper is not optimizer and hasattr(wrapper, "_is_overflow") else None
        self._told_skipped = False
        self._found: Optional[torch.Tensor] = None
        self._saved_found_inf: Optional[torch.Tensor] = None
        # Buffers a bad step's forward wrote (BatchNorm statistics), put back by a skip or a raise before
        # the optimizer step (see NOTE: [What a step writes besides the update]), or a callable action's
        # raise; inference has no step.
        undoes = optimizer is not None and (action in SKIPPING or ((action == "raise" or callable(action))
                                                                   and sync == "eager"))
        self._undo: Optional[BufferUndo] = BufferUndo(model) if undoes else None
        if optimizer is not None and action in SKIPPING:
            warn_of_parameters_outside(model, optimizer)
        # NOTE: [Buffers of compiled forwards]
        # The undo's snapshot is taken by the model's forward pre-hook at a step's first forward. Inside a
        # torch.compile'd forward the hooks do nothing (NOTE: [The watch and torch.compile]), so a skip or
        # a raise put nothing back and a bad batch left NaN BatchNorm statistics. So a step whose forwards
        # took no snapshot takes the next step's at its end, after its verdict was acted on (the buffers
        # as the next step finds them, before any of its forwards), and the watch takes one at its start.
        # An eager forward takes it again at its step's start, as before. A lagged skip on the device
        # puts the buffers back in the optimizer's step post-hook, after the step's end: a snapshot taken
        # at the end was of the bad batch's values, which the skip then "put back" (a probe, session 48),
        # so for such a step it is taken after the skip (_end_step's defer_undo).
        self._undo_by_forward = False
        self._undo_due = False
        self._warned_late_loss = False  # see NOTE: [A loss passed after its step]
        self._loss_may_come_late = False
        self._inference_ended = False  # the step that ended last was an inference forward's
        if rollback is not None and self._sharded:
            raise ValueError("nanfast.watch: action='rollback' does not snapshot sharded (DTensor) parameters")
        if rollback is not None and self._undo.scripted:
            raise ValueError(f"nanfast.watch: action='rollback' does not snapshot the buffers of TorchScript submodules "
                             f"({self._undo.scripted[0][0]!r}, from torch.jit.script): watch the eager module you "
                             "scripted, or use action='skip'")
        self._rollback = Rollback(optimizer, self._undo, *rollback, any_rank=functools.partial(
            agree.any_rank, process_group=process_group)) if rollback is not None else None
        self._reset_step()
        self._pending: Optional[Read] = None
        self._summary_values: Optional[list[float]] = None
        self._summary_step = -1
        self._summary_tail: Optional[Tail] = None  # what the last summary's pass read (parameters, gradients)
        self._spikes = None if spiking is None else Spikes(spiking, ModuleGroups(model))
        self._timeline = Timeline(history, log_to, type(model).__name__,  # opens log_to files: last
                                  self._headroom.thresholds if self._headroom is not None else ())
        self._keeps_losses = self._timeline.wanted or (spiking is not None and spiking.loss)
        if self._undo is not None:
            self._undo.begin()  # see NOTE: [Buffers of compiled forwards]
        if on_event == "locate":
            self._capture_step_state()  # see NOTE: [A compiled step's RNG states]
        try:
            self._install()
        except BaseException:
            self.remove()  # the hooks installed before the failure: the model and optimizer as they were
            raise

    def remove(self) -> None:
        """Removes every hook and restores the optimizer and scaler exactly. Results of a lagged read
        still pending are dropped: call flush() first to act on them (the context manager does)."""
        if not self._installed:
            return
        self._installed = False
        self._active = False
        self._recorder.disable()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        unhook_modules(self._hooked, self._hooks)
        remove_inert_hooks(self.model)
        if self._retire is not None:
            self._retire.detach()  # its global hooks are removed (NOTE: [Global hooks of a watch never removed])
        if self._scaler_shared is not None:
            scaler_hook.detach(self.scaler, self._scaler_shared, self)
            self._scaler_shared = None
        self._untell_accelerate()
        self._reset_step()
        self._pending = None
        self._rollback = None  # its snapshots: up to two copies of the training state
        self._timeline.close()

    def __enter__(self) -> Watch:
        if not self._installed:
            raise RuntimeError("nanfast.watch: this watch was removed (its `with` block ended, or remove() was called) "
                               "and checks nothing: make a new one, nanfast.watch(...), for each `with`")
        if self._entered:  # the inner block's end would remove it, and the outer block check nothing
            raise RuntimeError("nanfast.watch: this watch's `with` block is already open; the end of a `with` block "
                               "removes the watch, so enter it once (the outer block)")
        self._entered = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.flush()
                self._end_unended()
            else:
                self._record_pending()
        finally:
            self.remove()

    def __repr__(self) -> str:
        state = "installed" if self._installed else "removed"
        return (f"Watch({type(self.model).__name__}, step={self.step_count}, events={len(self.events)}, "
                f"skipped_steps={self.skipped_steps}, {state})")


def watch(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, **options: Any) -> Watch:
    """Installs NaN/inf checks on `model` (and `optimizer`) and returns the `Watch` (also a context
    manager; `remove()` restores the model and optimizer exactly). See docs/watch.md.

    Checks (each a bool option, all on by default): ``inputs`` (tensors entering model.forward),
    ``activations`` (every submodule's outputs), ``grads`` (gradients flowing out of each module in
    backward, and every parameter's grad before the optimizer step), ``params`` (every parameter, as
    the previous optimizer step left it; read every ``params_every`` checked steps, default 100, on
    every step whose model output was not checked, in a lagged watch, and on a bad step to name them:
    a non-finite parameter shows in the next forward's output), ``loss`` (the model's outputs and the loss gradient at them,
    and the loss value given to ``w.loss(loss)``). ``modules`` (default True) hooks the submodules for
    ``activations`` and the gradients flowing out of each (``grads``); ``modules=False`` hooks the model
    alone: its input, its outputs and the loss gradient at them, the loss value, and the parameters and
    their gradients in the step's pass are checked, no Python runs per module call (the cheapest watch on a GPU
    step, whose host is what bounds it), and what it gives up is the module's name: a bad activation or
    module gradient is seen where it reaches the model's output, the loss gradient or a parameter's
    gradient (named), and ``on_event="locate"`` names the op that made it.

    Options: ``action`` ("raise", "warn", "skip", "rollback" or a callable taking the Event), ``every`` (check one
    step in N), ``first_step`` (the number of the first step, default 0: a resumed run's step count, so
    that events and the timeline number steps as the run does; the framework callbacks pass the
    trainer's), ``sync`` ("eager": one host read at each optimizer.step(); "lagged": read one step
    late from a non-blocking copy), ``ignore`` (fnmatch patterns of module/parameter names whose
    non-finite values are intended; "input" for the input, "<model>" for the model's own output;
    an input entry named as a mask needs none: NOTE: [Additive masks]), ``nan_only`` (infinities are not errors),
    ``scaler`` (a torch.amp.GradScaler: overflowing scaled gradients that it skips are not errors),
    ``pass_through`` (module types left unhooked because they cannot create non-finite values;
    default PASS_THROUGH), ``process_group`` (the ranks that must agree; by default the world when
    torch.distributed is initialised: the step's flag is all-reduced, so every rank takes the same
    action in the same step, and events name the ranks that saw the fault), ``on_event="locate"`` with
    ``rerun`` (a callable running the step's forward and backward again on the same batch: a bad step
    is re-run under nanfast.locate and the finding is attached as ``event.located``; sync="eager"),
    ``profile`` (time the watch's hooks and kernels, for ``w.costs()``; off by default, and then the
    watch reads no clock), ``fuse`` (check the forward's activations and the backward's gradients in the
    step's pass over parameters and gradients: two calls per step with the summary instead of two per
    module, for GPUs, where each is a launch; a value an in-place op later made finite is not seen;
    keeps checked tensors alive until their call, up to 64 MiB that nothing else would; default None: on when the model's
    parameters are on an accelerator, off on a CPU), ``headroom`` (thresholds, as fractions of the dtype's largest finite value,
    at which a float16, bfloat16 or float8 place's max |x| gives a warning event of kind "headroom", once
    per place and threshold; default DEFAULT_THRESHOLDS = (0.25, 0.5, 0.9); None or () turns it off).
    action="rollback" skips bad steps as "skip" does, and when a step finds the
    parameters themselves non-finite puts back, in place, the last snapshot of parameters, optimizer
    state and module buffers proven finite: ``rollback_every`` (a snapshot every N steps, default 100)
    and ``rollback_device`` (where snapshots are kept, default "cpu"; copied without blocking).
    ``history`` (checked steps' records kept in ``w.history``, default 10000;
    0 keeps none), ``log_to`` (a path streamed as JSON Lines, a SummaryWriter, a callable taking a dict
    of "nanfast/..." numbers such as wandb.log, or a list of these), ``spikes`` (True: SpikeOptions();
    False: off; a SpikeOptions or a dict of its fields: loss, gradient-norm and per-module spikes).

    Args:
        model: the nn.Module to watch (a torch.compile wrapper: the module it runs).
        optimizer: the optimizer whose step ends each step (None: call ``w.step()``, or inference); a
            wrapper without step hooks of its own holding it as ``.optimizer`` (accelerate's
            AcceleratedOptimizer) is taken for it.
        **options: the options above, by keyword.

    Returns:
        The installed `Watch`.

    Raises:
        TypeError: model is not an nn.Module, or optimizer not a torch.optim.Optimizer (accelerate's
            AcceleratedOptimizer stands for the one it holds as ``.optimizer``).
        TypeError: headroom is not None, a number or numbers; fuse is not None or a bool; inputs,
            activations, grads, params, modules or loss is not a bool.
        ValueError: an option out of its allowed values (a headroom threshold outside (0, 1]), every check
            off (inputs, activations, grads, params and loss all False), or a combination the watch cannot honour
            (action="skip" or "rollback" without an optimizer, with LBFGS, or lagged with a non-fused
            optimizer; "rollback" with params=False or sharded parameters, rollback options with another
            action; on_event="locate" without rerun or with sync="lagged"; scaler without an optimizer).
        TypeError: an option watch() does not have (naming the closest one)."""
    unknown_options(options, inspect.signature(Watch.__init__).parameters)
    return Watch(model, optimizer, **options)
