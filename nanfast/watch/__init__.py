"""`watch`: always-on NaN/inf checks for a training loop. Hooks enqueue fused checks whose counts stay
on the device; the host reads them once per step; a non-finite value gives an `Event` that names the
first place, in execution order, where it appeared."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Optional, Union

import torch

from .. import _C, distributed
from ..check import uncompiled
from ..clip import check_norm_type, scale_grads_, total_norm
from ..ops import combine_norms
from ..recompute import REENTRANT, UNPACK, recomputation
from ..report import NonFiniteError
from . import scaler_hook
from .forwards import StepState
from .restore import BufferUndo, lacks_state

# torch.ops.nanfast.stats over tensors on any devices, rows in input order, results on one device; called
# unboxed (see NOTE: [Unboxed entry points]). The hooks are idle under torch.compile, which could not
# trace it.
_stats_on = _C.stats_on

ACTIONS = ("raise", "warn", "skip")
ON_EVENT = (None, "locate")
SYNC_MODES = ("eager", "lagged")
# Phases in the order their values arise within a step.
PHASES = ("param", "input", "forward", "loss_value", "loss", "backward", "grad")
# Values that are scaled by a GradScaler's loss scale, so may overflow (see NOTE: [AMP and GradScaler]).
_SCALED_PHASES = frozenset(("loss", "backward", "grad"))
# Leading entries of the per-step summary tensor (the counts of every slot follow it in a lagged read).
_SUMMARY = ("flag", "nan", "posinf", "neginf", "grad_norm", "grad_max_abs", "param_norm", "scaler_found_inf")
_MAX_NAMED_IN_SUMMARY = 8

# NOTE: [Modules that cannot make non-finite values]
# These only select, zero, reorder or reshape their input, or (dropout) scale it by 1/(1-p): their
# outputs and input gradients are non-finite only where their inputs are (a dropout could overflow only
# values within 1/(1-p) of the dtype's maximum), so checking them would find propagation, never a
# producer. They get no hooks: in a ResNet every ReLU re-reads the BatchNorm output it modified in place,
# and in a transformer the dropouts are a third of all activation bytes. `pass_through=()` checks them too.
PASS_THROUGH = (
    torch.nn.ReLU, torch.nn.ReLU6, torch.nn.Identity, torch.nn.Flatten, torch.nn.Unflatten,
    torch.nn.MaxPool1d, torch.nn.MaxPool2d, torch.nn.MaxPool3d,
    torch.nn.AdaptiveMaxPool1d, torch.nn.AdaptiveMaxPool2d, torch.nn.AdaptiveMaxPool3d,
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
)


@dataclasses.dataclass(frozen=True)
class Place:
    """Where, within a step, non-finite values were seen.

    ``phase`` is one of PHASES. ``name`` is the module's qualified name ("" for the model itself) in
    phases forward, backward and loss; the parameter's name in phases param and grad; "input" in phase
    input; the name given to Watch.loss in phase loss_value. ``call`` tells the calls of a module called
    several times in one forward apart (1-based); ``microbatch`` is the index of the model's forward
    within the step (gradient accumulation)."""

    phase: str
    name: str
    module_class: str
    nan: int
    posinf: int
    neginf: int
    call: int = 1
    microbatch: int = 0

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    def where(self) -> str:
        module = f"{self.name or '<model>'} ({self.module_class})" + (f" call {self.call}" if self.call > 1 else "")
        return {
            "param": f"parameter {self.name}",
            "input": "the input batch",
            "forward": f"output of {module}",
            "loss_value": f"value of {self.name!r} passed to Watch.loss",
            "loss": f"gradient of the loss w.r.t. the output of {module}",
            "backward": f"gradient flowing out of {module} in backward",
            "grad": f"gradient of parameter {self.name}",
        }[self.phase] + (f" [microbatch {self.microbatch}]" if self.microbatch else "")

    def describe(self) -> str:
        return f"{self.where()} (nan={self.nan}, +inf={self.posinf}, -inf={self.neginf})"


@dataclasses.dataclass(frozen=True)
class Event:
    """What a watch found in one step: the first place in execution order where a non-finite value
    appeared (the producer) and the places hit after it (where it propagated)."""

    step: int
    first: Place
    later: tuple[Place, ...]
    # Distributed (see NOTE: [Agreeing across ranks]): the rank whose place is `first` (the earliest
    # over all ranks), and every rank that saw non-finite values with its places.
    rank: Optional[int] = None
    by_rank: tuple[tuple[int, tuple[Place, ...]], ...] = ()
    # on_event="locate": what the re-run of the step under nanfast.locate found (a LocateFinding), or
    # None when the re-run stayed finite or was not made.
    located: Optional[Any] = None

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that saw non-finite values in this step (empty in a single process)."""
        return tuple(rank for rank, _ in self.by_rank)

    @property
    def phase(self) -> str:
        return self.first.phase

    @property
    def name(self) -> str:
        return self.first.name

    @property
    def module_class(self) -> str:
        return self.first.module_class

    @property
    def nan(self) -> int:
        return self.first.nan

    @property
    def posinf(self) -> int:
        return self.first.posinf

    @property
    def neginf(self) -> int:
        return self.first.neginf

    @property
    def dirty_input(self) -> bool:
        """The batch itself held non-finite values: bad data, not a fault of the model."""
        return self.first.phase == "input"

    @property
    def places(self) -> tuple[Place, ...]:
        return (self.first, *self.later)

    def summary(self) -> str:
        on = f" on rank {self.rank}" if self.rank is not None else ""
        if self.dirty_input:
            head = f"step {self.step}: the input batch{on} is dirty: {self.first.describe()}; the model did not produce it"
        elif self.first.phase == "param":
            head = (f"step {self.step} began with non-finite values{on} in {self.first.describe()}: made by the previous "
                    "optimizer step (or whatever last wrote the parameters)")
        else:
            head = f"step {self.step}: non-finite values first appeared{on} in the {self.first.describe()}"
        if self.by_rank:
            head += f" (ranks that saw non-finite values: {list(self.ranks)})"
        if self.located is not None:
            head += f"; located: {self.located.summary()}"
        if not self.later:
            return f"nanfast.watch: {head}"
        named = "; ".join(p.where() for p in self.later[:_MAX_NAMED_IN_SUMMARY])
        more = f"; and {len(self.later) - _MAX_NAMED_IN_SUMMARY} more" if len(self.later) > _MAX_NAMED_IN_SUMMARY else ""
        return f"nanfast.watch: {head}; then propagated to {len(self.later)} places: {named}{more}"

    __str__ = summary


class _Site:
    """A place that records slots: a watched module (or the input / the model), with its call count in
    the current forward."""

    __slots__ = ("name", "module_class", "ignored", "calls", "forward_id")

    def __init__(self, name: str, module_class: str, ignored: bool):
        self.name = name
        self.module_class = module_class
        self.ignored = ignored
        self.calls = 0
        self.forward_id = -1


@dataclasses.dataclass
class _Read:
    """One step's checks, packed on the device, and where their host copy lands (lagged reads)."""

    step: int
    summary: torch.Tensor  # float64 [len(_SUMMARY)] on the device
    counts: torch.Tensor  # int64 [rows, 3] on the device
    slots: list  # (phase, label, call, microbatch, rows) in row order
    scaler_skipped: bool
    agreeing: Optional[Any] = None  # the Work of the flag's all-reduce across ranks, until waited on
    host: Optional[torch.Tensor] = None  # summary and counts, copied without blocking
    copied: Optional[Any] = None  # torch.cuda.Event recorded after the copy


class _Pass(NamedTuple):
    """The fused pass over every parameter and gradient (see NOTE: [Parameters and gradients in one pass])."""

    param_names: list
    grad_names: list
    grads: list
    counts: torch.Tensor  # int64 [params + grads, 3]
    norm: torch.Tensor
    absmax: torch.Tensor
    n_params: int


def _floating_tensors(obj: Any, out: list) -> list:
    """The floating and complex strided tensors in obj: nested tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        if (obj.is_floating_point() or obj.is_complex()) and obj.layout == torch.strided:
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _floating_tensors(item, out)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            _floating_tensors(item, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _floating_tensors(getattr(obj, field.name), out)
    return out


class Watch:
    """Hooks on a model (and optimizer) that check for NaN/inf at every step; see `watch`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        inputs: bool = True,
        activations: bool = True,
        grads: bool = True,
        params: bool = True,
        loss: bool = True,
        action: Union[str, Callable[[Event], Any]] = "raise",
        every: int = 1,
        sync: str = "eager",
        ignore: Union[str, Iterable[str]] = (),
        nan_only: bool = False,
        scaler: Optional[Any] = None,
        pass_through: tuple[type, ...] = PASS_THROUGH,
        process_group: Optional[Any] = None,
        on_event: Optional[str] = None,
        rerun: Optional[Callable[[], Any]] = None,
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"nanfast.watch: model must be an nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"nanfast.watch: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not callable(action) and action not in ACTIONS:
            raise ValueError(f"nanfast.watch: action must be one of {ACTIONS} or a callable, got {action!r}")
        if sync not in SYNC_MODES:
            raise ValueError(f"nanfast.watch: sync must be one of {SYNC_MODES}, got {sync!r}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"nanfast.watch: every must be an int >= 1, got {every!r}")
        if scaler is not None and optimizer is None:
            raise ValueError("nanfast.watch: scaler= needs the optimizer it steps")
        if on_event not in ON_EVENT:
            raise ValueError(f"nanfast.watch: on_event must be one of {ON_EVENT}, got {on_event!r}")
        if on_event == "locate":
            if not callable(rerun):
                raise ValueError("nanfast.watch: on_event='locate' needs rerun=, a callable that runs the step's forward "
                                 "and backward again on the same batch (no optimizer step)")
            if sync != "eager":
                raise ValueError("nanfast.watch: on_event='locate' needs sync='eager': the step is re-run before the "
                                 "optimizer applies it")
        # NOTE: [Skipping a step]
        # A skipped step must leave parameters and optimizer state exactly as they were. With the host's
        # verdict before the step (the eager read, made in the step pre-hook), the optimizer is given no
        # gradients for that step: every torch optimizer leaves a parameter without a .grad, and its
        # state, untouched (fused ones included: handed found_inf instead, a first step would still
        # create their state, fused SGD's momentum buffers with empty_like). A lagged watch knows only on
        # the device: optimizers that take a `found_inf` tensor (fused=True, the protocol GradScaler
        # uses) get the flag of this step's checks and skip there; a step they could not undo that way
        # (one that creates optimizer state) is read at once instead (see _end_step).
        self._skip_on_device = (action == "skip" and sync == "lagged"
                                and bool(getattr(optimizer, "_step_supports_amp_scaling", False)))
        if action == "skip":
            if optimizer is None:
                raise ValueError("nanfast.watch: action='skip' needs the optimizer whose step it skips")
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ValueError(
                    "nanfast.watch: action='skip' cannot skip LBFGS steps: LBFGS runs the forward and backward "
                    "inside optimizer.step(closure), after the point where the watch decides (the step pre-hook), "
                    "and updates the parameters between closure calls; use action='raise' (see docs/watch.md)")
            if sync == "lagged" and not self._skip_on_device:
                raise ValueError(
                    "nanfast.watch: action='skip' with sync='lagged' needs an optimizer that skips on the device "
                    f"(fused=True Adam, AdamW or SGD); {type(optimizer).__name__} needs the host's verdict before "
                    "its step: use sync='eager'")

        model = uncompiled(model)  # hooks and names on the model a torch.compile wrapper runs
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.action = action
        self.every = every
        self.sync = sync
        self.nan_only = nan_only
        self.pass_through = tuple(pass_through)
        self.ignore = (ignore,) if isinstance(ignore, str) else tuple(ignore)
        self.process_group = process_group
        self.on_event = on_event
        self.rerun = rerun
        self._step_state: Optional[Any] = None  # locate.StepState of the current step (on_event="locate")
        self._check_inputs = inputs
        self._check_activations = activations
        self._check_grads = grads
        self._check_params = params
        self._check_loss = loss

        self.events: list[Event] = []
        self.last: Optional[Event] = None
        self.skipped_steps = 0
        self.scaler_skipped_steps = 0
        self.step_count = 0  # steps ended so far (the number of the current step)

        self._param_names = {id(p): name for name, p in model.named_parameters()}
        # FSDP2 / tensor parallel: the fused pass reads the local shards (the op has no DTensor rule).
        self._sharded = distributed.has_dtensor(list(model.parameters()))
        first = next(model.parameters(), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self._root = _Site("", type(model).__name__, self._ignored(""))
        self._input = _Site("input", "", self._ignored("input"))
        self._handles: list = []
        # The step's counts, in execution order, and what each slot id stands for (see NOTE: [The watch's recorder]).
        self._recorder = _C.WatchRecorder(self._device)
        self._slot_info: list[tuple[str, _Site, int, int]] = []
        self._steps = StepState(model)
        self._loss_sites: dict[str, _Site] = {}
        self._scaler_shared: Optional[Any] = None
        self._installed = True
        self._forward_id = 0
        self._stepped = False
        self._skip_now = False
        self._held_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._found: Optional[torch.Tensor] = None
        self._saved_found_inf: Optional[torch.Tensor] = None
        # Buffers a bad step's forward wrote (BatchNorm statistics), put back by a skip or a raise before
        # the optimizer step (see NOTE: [What a step writes besides the update]); inference has no step.
        undoes = optimizer is not None and (action == "skip" or (action == "raise" and sync == "eager"))
        self._undo: Optional[BufferUndo] = BufferUndo(model) if undoes else None
        self._reset_step()
        self._pending: Optional[_Read] = None
        self._summary: Optional[torch.Tensor] = None
        self._summary_values: Optional[list[float]] = None
        self._summary_step = -1
        self._install()

    # ---- installing and removing ----

    def _ignored(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.ignore)

    def _install(self) -> None:
        model = self.model
        self._handles.append(model.register_forward_pre_hook(self._before_model, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._after_model))
        # Registered after _after_model, and also called when the forward raises.
        self._handles.append(model.register_forward_hook(self._after_model_raised, always_call=True))
        if self._check_activations or self._check_grads:
            for name, module in model.named_modules():
                if module is model or isinstance(module, self.pass_through):
                    continue
                site = _Site(name, type(module).__name__, self._ignored(name))
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._before_module, site)))
                if self._check_activations:
                    self._handles.append(module.register_forward_hook(functools.partial(self._after_module, site)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._before_optimizer_step))
            if self.action == "skip":
                self._handles.append(self.optimizer.register_step_post_hook(self._after_optimizer_step))
        if self.scaler is not None:
            # NOTE: [AMP and GradScaler]
            # A GradScaler multiplies the loss by its scale, so gradients (phases loss, backward, grad)
            # overflow now and then; it then skips the step and lowers the scale. In a step it skipped,
            # those phases are not reported; unscaled phases (param, input, forward) still are. For a
            # non-fused optimizer it skips by not calling optimizer.step(), so the step must end here;
            # a fused one gets `optimizer.found_inf`, which the read packs (see _pack).
            self._scaler_shared = scaler_hook.attach(self.scaler, self)

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
        if self._scaler_shared is not None:
            scaler_hook.detach(self.scaler, self._scaler_shared, self)
            self._scaler_shared = None
        self._reset_step()
        self._pending = None

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            self.remove()

    # ---- the hooks (hot path: one Python call and one fused op each) ----

    def _reset_step(self) -> None:
        if self._undo is not None:
            self._undo.close()
        self._active = self._installed and self.step_count % self.every == 0
        self._recorder.clear()
        self._slot_info = []
        self._forwards = 0
        self._microbatch = 0
        self._clipped: Optional[_Pass] = None
        self._steps.reset()
        self._forget_last()

    def _forget_last(self) -> None:
        # NOTE: [Checking each tensor once]
        # A container returns its last child's output and passes its input on to its first child: the
        # same tensor. The last output checked is remembered with its version counter, so the container
        # reuses the child's slot (which names the innermost module) unless something changed it in place
        # in between. Gradient hooks are keyed by (autograd node, output): a tensor taken by several
        # modules (a container and its first child, a block's main path and its downsample) is hooked
        # once, for the module that took it last. Both are dropped when the forward returns: no
        # activation outlives its use.
        self._last_output: Optional[torch.Tensor] = None
        self._last_output_version = -1
        self._recorder.forget()

    def _slot(self, phase: str, site: _Site, call: int, microbatch: int) -> int:
        self._slot_info.append((phase, site, call, microbatch))
        return len(self._slot_info) - 1

    def _record(self, phase: str, site: _Site, call: int, microbatch: int, tensors: list) -> None:
        self._recorder.record(tensors, self._slot(phase, site, call, microbatch))

    def _hook_grads(self, args: Any, phase: str, site: _Site, call: int) -> None:
        # NOTE: [Where a gradient is checked]
        # The gradient w.r.t. each input of a module is what the module's backward (and any other
        # consumer of the tensor) produced. It is caught by a pre-hook on the autograd node that made the
        # input (what a tensor hook does, for less), registered before the module runs: it sees the value
        # the module received even when the module modifies it in place (ReLU(inplace=True)). Full
        # backward hooks would wrap every module in an autograd Function and forbid in-place ops on module
        # outputs. Leaves have no node (their gradients are the parameters', phase grad); the hooks go
        # with the graph. The recorder places them (C++ pre-hooks, see NOTE: [The watch's recorder]).
        tensors = _floating_tensors(args, [])
        if tensors:
            self._recorder.hook_grads(tensors, self._slot(phase, site, call, self._microbatch))

    def _enter(self, site: _Site, args: Any, recomputed: bool = False) -> None:
        if not recomputed:
            if site.forward_id != self._forward_id:
                site.forward_id = self._forward_id
                site.calls = 0
            site.calls += 1
        if self._check_grads and not site.ignored and torch.is_grad_enabled():
            self._hook_grads(args, "backward", site, site.calls)

    def _check_output(self, phase: str, site: _Site, output: Any) -> None:
        tensors = _floating_tensors(output, [])
        if not tensors:
            return
        if len(tensors) == 1:
            t = tensors[0]
            if t is self._last_output and t._version == self._last_output_version:
                return
            self._last_output, self._last_output_version = t, t._version
        if not site.ignored:
            self._record(phase, site, site.calls, self._microbatch, tensors)

    # NOTE: [The watch and torch.compile]
    # Inside a region torch.compile traces, the hooks do nothing (is_compiling() is constant-folded
    # while tracing): reading a tensor's grad_fn and keeping Python state per call would break the
    # graph at every module. What runs compiled is therefore not checked module by module; the fused
    # pass over parameters and gradients at optimizer.step(), outside the compiled region, still sees
    # every non-finite value the step leaves in them, and anything run eagerly is hooked as usual.
    # Activation checkpointing re-runs modules inside backward (nanfast/recompute.py): that is neither
    # another call nor another forward, and its values were checked when the forward ran. Only with
    # use_reentrant=True does backward flow through the graph it rebuilds: its gradients are hooked there.

    def _before_module(self, site: _Site, module: torch.nn.Module, args: tuple) -> None:
        if self._active and not torch.compiler.is_compiling():
            recomputed = recomputation()
            if recomputed != UNPACK:
                self._enter(site, args, recomputed == REENTRANT)

    def _after_module(self, site: _Site, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._active and not torch.compiler.is_compiling() and recomputation() is None:
            self._check_output("forward", site, output)

    def _before_model(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling() or recomputation() is not None:
            return
        self._drop_failed_backward()
        grad, has_optimizer = torch.is_grad_enabled(), self.optimizer is not None
        if self._steps.unended(grad, has_optimizer):
            self._reset_step()  # see NOTE: [Steps that never end]
        self._steps.note_forward(grad, has_optimizer)
        if not self._active:
            return
        self._steps.begin_forward(len(self._slot_info), self._forwards)
        self._forward_id += 1
        self._microbatch = self._forwards
        self._forwards += 1
        if self._undo is not None and self._microbatch == 0:
            self._undo.begin()
        if self.on_event == "locate" and self._microbatch == 0:
            from ..locate import StepState

            self._step_state = StepState.capture(self.model)  # the RNG states: a few KB
        if self._check_inputs and not self._input.ignored:
            tensors = _floating_tensors(kwargs, _floating_tensors(args, []))
            if tensors:
                self._record("input", self._input, 1, self._microbatch, tensors)
        self._enter(self._root, args)

    def _after_model(self, model: torch.nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling() or recomputation() is not None:
            return
        self._steps.end_forward()
        if self._active:
            if self._check_loss:
                self._check_output("forward", self._root, output)
                if torch.is_grad_enabled() and not self._root.ignored:
                    self._hook_grads(output, "loss", self._root, self._root.calls)
            self._forget_last()
        if self.optimizer is None and not torch.is_grad_enabled() and not self._steps.training:
            # Inference: each forward is a step, of activations only; one inside a training step (an
            # eval pass before w.step()) belongs to that step.
            self._end_step(fused_pass=False)

    def _after_model_raised(self, model: torch.nn.Module, args: tuple, output: Any) -> None:
        forward = self._steps.end_forward()
        if forward is not None and not torch.compiler.is_compiling():
            self._drop_forward(forward)

    def _drop_failed_backward(self) -> None:
        # See NOTE: [A backward that raised]. Only outside any backward: a checkpointed model runs its
        # forward again inside one.
        if torch._C._current_graph_task_id() < 0 and self._recorder.backward_failed() and self._steps.last is not None:
            self._drop_forward(self._steps.last)

    def _drop_forward(self, forward: Any) -> None:
        # NOTE: [A forward that raised]
        # A forward that raised, or whose backward raised (an OOM caught by the loop, which goes on with
        # the next batch), is forgotten: its records and the gradient checks it placed (made inert) go,
        # with its references to activations, and the next forward takes its microbatch number. Earlier
        # forwards of the step are kept.
        self._recorder.discard(forward.first_slot)
        del self._slot_info[forward.first_slot:]
        self._forwards = forward.microbatch
        self._steps.training = forward.training
        self._steps.last = None
        self._forget_last()

    def loss(self, value: torch.Tensor, name: str = "loss") -> torch.Tensor:
        """Checks the loss value itself (phase loss_value), in the step's one read: a loss can be NaN
        with finite gradients (a mean over no elements: cross-entropy whose targets are all
        ignore_index), and no hook sees it, since the loss is not an output of the model. Pass the
        unscaled loss (before GradScaler.scale). Checks nothing in a watch made with loss=False.

        Args:
            value: the loss tensor (any floating tensor: each of its elements is checked).
            name: how events name it (several losses: "ce", "aux"; matched by ``ignore``).

        Returns:
            ``value`` itself, so that ``w.loss(criterion(out, y)).backward()`` reads naturally.

        Raises:
            TypeError: value is not a tensor."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Watch.loss: value must be a torch.Tensor, got {type(value).__name__}")
        if self._active and self._check_loss and not torch.compiler.is_compiling():
            site = self._loss_sites.get(name)
            if site is None:
                site = self._loss_sites[name] = _Site(name, "", self._ignored(name))
            tensors = _floating_tensors(value, [])
            if tensors and not site.ignored:
                self._record("loss_value", site, 1, self._microbatch, tensors)
        return value

    # ---- the step: one read ----

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        # args: the step's own arguments, the optimizer first
        if self.action == "skip" and (args[1] if len(args) > 1 else kwargs.get("closure")) is not None:
            raise ValueError("nanfast.watch: action='skip' cannot skip optimizer.step(closure): the closure runs the "
                             "step's forward and backward after the point where the watch decides; call backward "
                             "before optimizer.step()")
        self._stepped = True
        read = self._end_step(found_inf=getattr(optimizer, "found_inf", None), grad_scale=getattr(optimizer, "grad_scale", None))
        if self.action != "skip":
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
            self._held_grads = []
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._held_grads.append((p, p.grad))
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
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.masked_fill_(skip, 0)
            self._found = self._saved_found_inf = None
        elif self._held_grads:
            for p, grad in self._held_grads:
                p.grad = grad.zero_()
            self._held_grads = []

    def step(self) -> None:
        """Ends the step in a loop without an optimizer: checks parameters and gradients and reads the
        step's results. (With an optimizer, optimizer.step() does this.)"""
        self._steps.ended_by_user = True
        self._end_step()

    def _scaler_step_begins(self) -> None:
        self._stepped = False

    def _scaler_step_ended(self, optimizer: torch.optim.Optimizer) -> None:
        # The GradScaler skipped the step without calling optimizer.step() (see NOTE: [AMP and GradScaler]).
        if optimizer is self.optimizer and not self._stepped:
            self._end_step(scaler_skipped=True)

    def flush(self) -> None:
        """Reads the results still pending in a lagged watch now (one host sync) and acts on them."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._evaluate(pending)

    def _fused_pass(self) -> Optional[_Pass]:
        # NOTE: [Parameters and gradients in one pass]
        # At the read, before the optimizer step, one fused call covers every parameter (as the previous
        # step left it: an optimizer can make NaN out of finite grads; the check of step N's update is
        # read at step N+1, before anything else of that step) and every gradient. The same pass gives
        # w.stats() and w.clip_grad_norm_ their norms.
        if self.optimizer is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
        else:
            params = list(self.model.parameters())
        names = [self._param_names.get(id(p)) or f"param[{i}]" for i, p in enumerate(params)]
        with_grad = [(n, p.grad) for n, p in zip(names, params) if p.grad is not None]
        grads = [g for _, g in with_grad]
        if not params:
            return None
        if self._sharded:
            params, grads = ([distributed.local_tensor(t) for t in ts] for ts in (params, grads))
        grads = [_entries(g) for g in grads]
        counts, norm, absmax = _stats_on(params + grads, self._device)
        return _Pass(names, [n for n, _ in with_grad], grads, counts, norm, absmax, len(params))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the watched parameters' gradients to total norm `max_norm` (as
        torch.nn.utils.clip_grad_norm_) and returns the total norm before clipping, from the fused pass
        the step's check makes anyway: call it right before optimizer.step(). No host sync; norms are of
        the finite elements (finite gradients never become NaN); non-finite gradients are reported by
        the watch (phase grad)."""
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
            total = total_norm([fused.norm[n:]], [fused.absmax[n:]], norm_type)
            scale_grads_(fused.grads, total, max_norm)
        self._clipped = fused  # counts are unchanged by a finite scale <= 1; norms are those before clipping
        return total.to(fused.grads[0].dtype)

    def _end_step(self, found_inf: Optional[torch.Tensor] = None, grad_scale: Optional[torch.Tensor] = None,
                  scaler_skipped: bool = False, fused_pass: bool = True) -> Optional[_Read]:
        """The step boundary: packs this step's checks (with the fused pass over parameters and gradients
        unless fused_pass is False), reads them (eager) or starts their copy and reads the previous step's
        (lagged), and acts. Returns this step's packed read if the step was checked."""
        self._skip_now = False
        self._drop_failed_backward()
        read = self._pack(found_inf, grad_scale, scaler_skipped, fused_pass) if self._active else None
        self.step_count += 1
        self._reset_step()
        if self.sync == "lagged" and not (read is not None and self._needs_host_verdict()):
            if read is not None:
                _start_copy(read)
            pending, self._pending = self._pending, read
            if pending is not None:
                self._evaluate(pending)
        elif read is not None:
            self.flush()  # lagged: the previous step's read comes first
            self._evaluate(read)
        return read

    def _needs_host_verdict(self) -> bool:
        """A lagged skip on the device cannot undo this step: it creates optimizer state (fused SGD makes
        its momentum buffers before it looks at found_inf), or changed a buffer with no copy to restore it
        from, or re-assigned one to a tensor of another shape. Such a step is read at once (a first step,
        or a buffer seen changing for the first time)."""
        return self._skip_on_device and (lacks_state(self.optimizer) or bool(self._undo.missed or self._undo.host_only))

    def _pack(self, found_inf: Optional[torch.Tensor], grad_scale: Optional[torch.Tensor], scaler_skipped: bool,
              fused_pass: bool) -> _Read:
        """This step's counts, in execution order (parameters, then the hooks' slots, then gradients),
        and the summary: [flag, nan, +inf, -inf, grad norm, max |grad|, param norm, scaler's found_inf]."""
        device = self._device
        recorded, recorded_slots = self._recorder.take()
        counts = [recorded]
        slots = [(*self._slot_info[slot], rows) for slot, rows in recorded_slots]
        zero = torch.zeros((), dtype=torch.float64, device=device)
        grad_norm = grad_max = param_norm = zero
        with torch.no_grad():
            fused = None
            if fused_pass and (self._check_params or self._check_grads):
                fused = self._clipped or self._fused_pass()
            if fused is not None:
                n = fused.n_params
                if self._check_params:
                    self._add_named("param", fused.param_names, fused.counts[:n], counts, slots, front=True)
                if self._check_grads:
                    self._add_named("grad", fused.grad_names, fused.counts[n:], counts, slots, front=False)
                param_norm = combine_norms(fused.norm[:n])
                if fused.grads:
                    grad_norm = combine_norms(fused.norm[n:])
                    grad_max = fused.absmax[n:].max()
                    if isinstance(grad_scale, torch.Tensor):  # a fused optimizer under GradScaler: grads are scaled
                        inv = 1.0 / grad_scale.to(device=device, dtype=torch.float64)
                        grad_norm, grad_max = grad_norm * inv, grad_max * inv
            packed = torch.cat(counts) if len(counts) > 1 else recorded
            totals = packed.sum(0)
            flag = totals[:1] if self.nan_only else totals.sum(0, keepdim=True)
            found = zero if found_inf is None else found_inf.to(device=device, dtype=torch.float64)
            summary = torch.cat([torch.cat([flag, totals]).double(), torch.stack([grad_norm, grad_max, param_norm, found])])
        read = _Read(self.step_count, summary, packed, slots, scaler_skipped)
        group = distributed.default_group(self.process_group)
        if group is not None:
            # NOTE: [Agreeing across ranks]
            # The flag (summary[0]) becomes the MAX over the ranks, in place and asynchronously: every
            # rank reads the same verdict at its one read and takes the same action in the same step, so
            # no rank waits in a collective (DDP's next gradient reduction, this all-reduce) that another
            # rank left by raising. The Work is waited on right before the flag is used; only a bad step,
            # which all ranks know to be bad, gathers the ranks' places. Counts and norms stay local.
            read.agreeing = distributed.all_reduce_flag_async(summary[:1], group)
        return read

    def _add_named(self, phase: str, names: list[str], counts: torch.Tensor, all_counts: list, slots: list, front: bool) -> None:
        """Adds one row per named tensor (parameters or gradients), leaving out the ignored names."""
        keep = [i for i, name in enumerate(names) if not self._ignored(name)] if self.ignore else None
        if keep is not None and len(keep) < len(names):
            names = [names[i] for i in keep]
            counts = counts.index_select(0, torch.tensor(keep, device=counts.device))
        if not names:
            return
        slot = (phase, tuple(names), 1, 0, len(names))
        if front:
            all_counts.insert(0, counts)
            slots.insert(0, slot)
        else:
            all_counts.append(counts)
            slots.append(slot)

    # ---- reading and acting ----

    def _evaluate(self, read: _Read) -> None:
        _agree(read)
        if read.host is not None:  # lagged: the copy was enqueued a step ago
            if read.copied is not None:
                read.copied.synchronize()
            values = read.host.tolist()
            summary, flat = values[:len(_SUMMARY)], values[len(_SUMMARY):]
            bad = summary[0] > 0
            rows = [flat[i:i + 3] for i in range(0, len(flat), 3)] if bad else []
            self._summary, self._summary_values = None, summary
        else:
            # NOTE: [One read per step]
            # The one host sync of a checked step: a single .item() of the flag (the count of non-finite
            # values that matter). Everything else stays on the device unless the step is bad.
            bad = read.summary[0].item() > 0
            self._summary, self._summary_values = read.summary, None
            summary = read.summary.tolist() if bad else None
            rows = read.counts.tolist() if bad else []
        self._summary_step = read.step
        scaler_skipped = read.scaler_skipped or (bad and summary[7] > 0)
        if scaler_skipped:
            self.scaler_skipped_steps += 1
        if not bad:
            return
        places = self._places(rows, read.slots, scaler_skipped)
        group = distributed.default_group(self.process_group)
        if group is not None:
            event = _distributed_event(read.step, places, group)
        elif places:
            event = Event(read.step, places[0], tuple(places[1:]))
        else:
            event = None
        if event is None:
            return  # only values scaled by the GradScaler overflowed: it skipped the step and lowers its scale
        if self.on_event == "locate":
            event = dataclasses.replace(event, located=self._locate())
        self.events.append(event)
        self.last = event
        self._act(event, scaler_skipped, before_step=read.host is None)

    def _places(self, rows: list, slots: list, scaler_skipped: bool) -> list[Place]:
        places = []
        i = 0
        for phase, label, call, microbatch, n in slots:
            if scaler_skipped and phase in _SCALED_PHASES:
                pass
            elif isinstance(label, _Site):
                nan, posinf, neginf = (int(sum(r[k] for r in rows[i:i + n])) for k in range(3))
                if nan if self.nan_only else nan + posinf + neginf:
                    places.append(Place(phase, label.name, label.module_class, nan, posinf, neginf, call, microbatch))
            else:
                for name, (nan, posinf, neginf) in zip(label, rows[i:i + n]):
                    if nan if self.nan_only else nan + posinf + neginf:
                        places.append(Place(phase, name, "", int(nan), int(posinf), int(neginf)))
            i += n
        return places

    def _locate(self) -> Optional[Any]:
        """Re-runs the step (self.rerun) under nanfast.locate from the RNG states its first forward began
        with; the watch's hooks stay idle meanwhile (the re-run is not a step). Every rank re-runs (all
        see the same verdict), so the collectives of a DDP backward match."""
        if self._step_state is None:
            return None
        from ..locate import locate_step

        active, self._active = self._active, False
        try:
            return locate_step(self.rerun, self._step_state)
        finally:
            self._active = active
            self._steps.reset()  # the re-run's forwards are not the next step's

    def _act(self, event: Event, scaler_skipped: bool, before_step: bool) -> None:
        """Acts on a bad step's event; `before_step`: read before the optimizer applied the step (eager),
        so a skip or a raise can still leave the model as the step found it."""
        if callable(self.action):
            self.action(event)
        elif self.action == "warn":
            warnings.warn(event.summary(), RuntimeWarning, stacklevel=2)
        else:
            missed = self._undo.restore() if before_step and self._undo is not None else []
            # Buffers changed in place with no copy taken (a kind not copied, or not seen changing before).
            unrestored = (f": its forward changed the buffers {missed} in place, which could not be restored (no copy "
                          "was taken: not seen changing in an earlier step, or not a plain dense tensor)") if missed else ""
            if self.action == "raise":
                raise NonFiniteError(event, f"{event.summary()}{unrestored}" if missed else None)
            if event.phase == "param":
                raise NonFiniteError(event, f"{event.summary()}: a step cannot be skipped once the parameters are non-finite")
            if missed:
                raise NonFiniteError(event, f"{event.summary()}: the step cannot be skipped{unrestored}")
            # The GradScaler already skipped it, or (lagged) the optimizer skips it on the device (found_inf).
            self._skip_now = not scaler_skipped and before_step
            self.skipped_steps += 1
            warnings.warn(f"{event.summary()}: skipped the optimizer step (parameters, optimizer state and module "
                          "buffers unchanged, grads zeroed)", RuntimeWarning, stacklevel=2)

    # ---- numbers for a logger ----

    def stats(self) -> dict[str, float]:
        """The last checked step's numbers, from the same fused pass: total grad norm, param norm and max
        |grad| (of the finite elements), and the NaN/+inf/-inf counts over everything checked. Empty before
        the first checked step. In an eager watch the first call after a step reads them (one transfer)."""
        if self._summary_values is None:
            if self._summary is None:
                return {}
            self._summary_values = self._summary.tolist()
        values = dict(zip(_SUMMARY, self._summary_values))
        return {"step": float(self._summary_step), "grad_norm": values["grad_norm"], "param_norm": values["param_norm"],
                "grad_max_abs": values["grad_max_abs"], "nan": values["nan"], "posinf": values["posinf"],
                "neginf": values["neginf"]}

    def __repr__(self) -> str:
        state = "installed" if self._installed else "removed"
        return (f"Watch({type(self.model).__name__}, step={self.step_count}, events={len(self.events)}, "
                f"skipped_steps={self.skipped_steps}, {state})")


def _entries(grad: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse gradient (nn.Embedding(sparse=True)), which scaling them in place
    scales; a strided one as it is. Duplicates of a COO gradient stay uncoalesced (coalescing syncs
    the host on CUDA): every non-finite entry is counted, and the norm is that of the entries."""
    if grad.layout == torch.sparse_coo:
        return grad._values()
    if grad.layout != torch.strided:
        return grad.values()  # CSR, CSC, BSR, BSC
    return grad


def _agree(read: _Read) -> None:
    """Waits for the flag's all-reduce (on NCCL this orders the stream after it; the host waits at the
    read that follows, the one it makes anyway)."""
    if read.agreeing is not None:
        read.agreeing.wait()
        read.agreeing = None


def _phase_order(place: Place) -> tuple[int, int]:
    """Where a place comes in a step, comparable across ranks: parameters first, then each microbatch's
    forward and backward, the parameters' gradients last."""
    if place.phase == "param":
        return (-1, 0)
    if place.phase == "grad":
        return (1 << 30, 0)
    return (place.microbatch, PHASES.index(place.phase))


def _distributed_event(step: int, places: list, group: Any) -> Optional[Event]:
    """The event of a bad step, the same on every rank: each rank's places gathered, the first place the
    earliest over the ranks (ties: the lowest rank). None if no rank has a place to report."""
    import torch.distributed as dist

    gathered = distributed.gather_objects((dist.get_rank(), tuple(places)), group)
    by_rank = tuple((rank, p) for rank, p in gathered if p)
    if not by_rank:
        return None
    rank, first_places = min(by_rank, key=lambda item: (_phase_order(item[1][0]), item[0]))
    return Event(step, first_places[0], first_places[1:], rank=rank, by_rank=by_rank)


def _start_copy(read: _Read) -> None:
    """Starts copying the read to the host without blocking (lagged): pinned memory on CUDA."""
    _agree(read)
    flat = torch.cat([read.summary, read.counts.flatten().to(torch.float64)])
    if flat.device.type == "cuda":
        read.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        read.host.copy_(flat, non_blocking=True)
        read.copied = torch.cuda.Event()
        read.copied.record()
    else:
        read.host = flat


def watch(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, **options: Any) -> Watch:
    """Installs NaN/inf checks on `model` (and `optimizer`) and returns the `Watch` (also a context
    manager; `remove()` restores the model and optimizer exactly). See docs/watch.md.

    Checks (each a bool option, all on by default): ``inputs`` (tensors entering model.forward),
    ``activations`` (every submodule's outputs), ``grads`` (gradients flowing out of each module in
    backward, and every parameter's grad before the optimizer step), ``params`` (every parameter, as
    the previous optimizer step left it), ``loss`` (the model's outputs and the loss gradient at them,
    and the loss value given to ``w.loss(loss)``).

    Options: ``action`` ("raise", "warn", "skip" or a callable taking the Event), ``every`` (check one
    step in N), ``sync`` ("eager": one host read at each optimizer.step(); "lagged": read one step
    late from a non-blocking copy), ``ignore`` (fnmatch patterns of module/parameter names whose
    non-finite values are intended; "input" for the input), ``nan_only`` (infinities are not errors),
    ``scaler`` (a torch.amp.GradScaler: overflowing scaled gradients that it skips are not errors),
    ``pass_through`` (module types left unhooked because they cannot create non-finite values;
    default PASS_THROUGH), ``process_group`` (the ranks that must agree; by default the world when
    torch.distributed is initialised: the step's flag is all-reduced, so every rank takes the same
    action in the same step, and events name the ranks that saw the fault), ``on_event="locate"`` with
    ``rerun`` (a callable running the step's forward and backward again on the same batch: a bad step
    is re-run under nanfast.locate and the finding is attached as ``event.located``; sync="eager")."""
    return Watch(model, optimizer, **options)
