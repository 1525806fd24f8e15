"""Placing the watch's hooks: on the model, its submodules and the optimizer at install, and on the
modules a model gains later (NOTE: [A model changed after watch()]). What each hook does per call is
hooks.py's."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch

from .. import _C
from . import scaler_hook
from .closure import run_closure_first, runs_closure_first
from .events import MODEL
from .options import KEEPS_NONFINITE_IN_PLACE, SKIPPING, ignored
from .owned_hook import OwnedHook, hook_module


def hooked_modules(model: torch.nn.Module, pass_through: tuple[type, ...]) -> Iterator[tuple[str, torch.nn.Module]]:
    """The submodules of `model` that get module hooks, with their names: all but the model itself, the
    types in `pass_through` (NOTE: [Modules that cannot make non-finite values]) and plain nn.Sequential
    containers (NOTE: [Containers that compute nothing]), and TorchScript submodules (torch.jit.script),
    which run no Python hooks: their outputs are checked where they reach a hooked module or the model's
    output (register_forward_pre_hook raised on them inside watch(): a probe, session 47)."""
    for name, module in model.named_modules():
        if (module is not model and not isinstance(module, pass_through) and type(module) is not torch.nn.Sequential
                and not isinstance(module, torch.jit.ScriptModule)):
            yield name, module


def weakly_bound(obj: Any, method: str) -> Any:
    """obj.method, called through a weak reference to obj: a no-op once obj is gone (until the hook is
    retired: see _RETIRED)."""
    ref = weakref.ref(obj)

    def call(*args: Any) -> None:
        alive = ref()
        if alive is not None:
            getattr(alive, method)(*args)

    return call


# NOTE: [Global hooks of a watch never removed]
# The watch's two global registration hooks (module and buffer) run on every module attribute set and
# buffer registered in the process. A watch dropped without remove() (a sweep, a notebook cell run
# again) left them for good: 600 such watches made building a 61-module model 6x slower (a probe,
# session 43). Removing them from inside a hook, or from a finalizer that garbage collection may run
# inside torch's loop over them, would mutate the dict that loop iterates; so a watch's finalizer only
# retires its handles here, and the next watch installed removes them.
_RETIRED: list = []

# The watches ever installed on each model (weakly: a dropped model or watch leaves), to tell a second
# watch on the same model (see Installation._install).
_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# NOTE: [Containers that compute nothing]
# A plain nn.Sequential (the class itself: a subclass may override forward) only passes its input
# to its first child and returns its last child's output. Its output check would find the last
# child's output (checked already, or left unchecked on purpose: ignored, or a module that cannot
# make non-finite values), and the check of the gradient w.r.t. its input is taken over by its first
# child's (NOTE: [Checking each tensor once]); where that child is left unhooked (it cannot make
# non-finite values), the gradient it passes on is non-finite only where the one it received is,
# which the next child checks, and where it is ignored, what it passes on is what `ignore` names. So
# its two hooks found nothing, and cost a hooked module call each time (two Python hooks and torch's
# slower call path): seven of them per step in ResNet-18, one in the watch suite's MLP.


class Installation:
    """How `Watch` places its hooks (a part of it: the state they use is the Watch's)."""

    def _site(self, name: str, module_class: str, module: Optional[torch.nn.Module] = None) -> Any:
        """A place that records slots (a module, the input, the model, a loss), with its call count. The
        model itself ("") is ignored under the name events give it too ("<model>"). `module`: the module
        itself, if the place is one (one of torch's in-place activations keeps its input's non-finite
        values: NOTE: [Non-finite values an in-place activation keeps] in csrc/python/deferred_records.h)."""
        model = name == "" and bool(module_class)
        keeps = type(module) in KEEPS_NONFINITE_IN_PLACE and getattr(module, "inplace", False) is True
        skipped = ignored(self.ignore, name) or (model and ignored(self.ignore, MODEL))
        return _C.WatchSite(name, module_class, skipped, keeps)

    def _hook(self, fn: Any) -> Any:
        """What is registered for `fn`: itself, or timed in a profiled watch (see NOTE: [Profiling the watch])."""
        return fn if self._profile is None else self._profile.timed(fn)

    def _install(self) -> None:
        model, hook = self.model, self._hook
        # Two watches on one model (a Trainer callback and a watch of one's own, a watch never removed)
        # both check everything, at twice the cost, and the first to act on a bad step is the one that
        # reports it: almost always a mistake, so said at once.
        watching = [w for w in _WATCHES.get(model, ()) if w._installed]
        if watching:
            more = f" and {len(watching) - 1} other watch(es)" if len(watching) > 1 else ""
            warnings.warn(f"nanfast.watch: {type(model).__name__} is already watched by {watching[0]!r}{more}: all "
                          "check every step, each at the full cost, and only the first to act on a bad step reports "
                          "it. A watch dropped without remove() keeps checking, for the model's hooks hold it (a "
                          "notebook cell run again adds one each time): call remove() on the other (or leave its "
                          "`with` block) first", UserWarning, stacklevel=4)
        _WATCHES.setdefault(model, weakref.WeakSet()).add(self)
        # Each module hook acts for its own module only (NOTE: [Copies of a watched model]).
        self._handles.append(model.register_forward_pre_hook(OwnedHook(model, hook(self._before_model)),
                                                             with_kwargs=True))
        self._handles.append(model.register_forward_hook(OwnedHook(model, hook(self._after_model))))
        # Registered after _after_model, and also called when the forward raises.
        self._handles.append(model.register_forward_hook(OwnedHook(model, hook(self._after_model_raised)),
                                                         always_call=True))
        self._follow_model()
        # Global hooks: they hold the watch weakly, or a watch never removed would keep its model alive.
        while _RETIRED:  # see NOTE: [Global hooks of a watch never removed]
            _RETIRED.pop().remove()
        registered = weakly_bound(self, "_registered")
        global_hooks = [register(registered) for register in (
            torch.nn.modules.module.register_module_module_registration_hook,
            torch.nn.modules.module.register_module_buffer_registration_hook)]
        self._handles += global_hooks
        self._retire = weakref.finalize(self, _RETIRED.extend, global_hooks)
        if self.optimizer is not None:
            if runs_closure_first(self.optimizer):  # see NOTE: [Lightning's closure]
                self._handles.append(self.optimizer.register_step_pre_hook(run_closure_first))
            self._handles.append(self.optimizer.register_step_pre_hook(hook(self._before_optimizer_step)))
            if self.action in SKIPPING:
                self._handles.append(self.optimizer.register_step_post_hook(hook(self._after_optimizer_step)))
        if self.scaler is not None:
            # NOTE: [AMP and GradScaler]
            # A GradScaler multiplies the loss by its scale, so gradients (phases loss, backward, grad)
            # overflow now and then; it then skips the step and lowers the scale. In a step it skipped,
            # those phases are not reported; unscaled phases (param, input, forward) still are. For a
            # non-fused optimizer it skips by not calling optimizer.step(), so the step must end here;
            # a fused one gets `optimizer.found_inf`, which the read packs (see Step.pack).
            self._scaler_shared = scaler_hook.attach(self.scaler, self)

    # NOTE: [A model changed after watch()]
    # Fine-tuning swaps a head in (model.fc = ...) or unfreezes a block, sometimes after the watch began.
    # torch's global registration hooks (installed with the watch's other hooks, removed by remove())
    # tell when a module is set on one of the model's modules or a buffer of a new name is registered on
    # one; modules built elsewhere (a loss made at every step) and a forward re-assigning a buffer it has
    # (self.ema = ...) do not count. The next step's start then hooks the modules not hooked yet and lists
    # the buffers again (a skip puts the new module's BatchNorm statistics back too); a step after no
    # such change pays nothing. Parameters are named from the model whenever the optimizer's list
    # changes (NOTE: [The pass's parameters in C++]) and after such a change.

    def _registered(self, module: torch.nn.Module, name: str, value: Any) -> None:
        """torch's global module and buffer registration hooks (see the NOTE). Returns None: the
        registration is left as it is."""
        if id(module) in self._members and (isinstance(value, torch.nn.Module) or name not in module._buffers):
            self._model_changed = True

    def _follow_model(self) -> None:
        """Hooks the modules not hooked yet and notes the model's modules (see the NOTE); at install, and
        at a step's start after the model changed (the buffers listed again then too)."""
        self._model_changed = False
        self._members = {id(module) for module in self.model.modules()}  # alive: the model holds them
        self._params.forget()  # names as the model has them now (a parametrization renames a parameter)
        if self._written is not None:
            self._written.relist()
        if not (self._hook_modules and (self._check_activations or self._check_grads)):
            return
        for name, module in hooked_modules(self.model, self.pass_through):
            if module in self._hooked:
                continue
            self._hooked.add(module)
            hook_module(module, self._hooks, self._site(name, type(module).__name__, module), self._check_activations)
