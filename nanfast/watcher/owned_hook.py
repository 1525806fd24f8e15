"""The form of every hook the watch puts on a module: it acts for that module only, and a copy of the
module gets an inert one (see NOTE: [Copies of a watched model]). The model's own hooks are OwnedHooks;
its submodules' are the extension's two functions, which look the module up in a table of their own
(NOTE: [Module hooks without a Python frame] in csrc/python/hooked_modules.cpp)."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import torch

from .. import _C

# NOTE: [Copies of a watched model]
# An EMA or teacher model is made with copy.deepcopy(model) (timm's ModelEmaV2, torch's AveragedModel),
# and whole models are saved with torch.save(model), often while a watch is on. Both copy the module's
# hook dicts. A bound method of the Watch would be deep-copied with the Watch itself (which holds C++
# state that cannot be copied: TypeError), and a plain function is kept by reference, so the copy's
# forwards would be recorded as the watched module's (a NaN in the teacher reported, even skipped, as
# the student's). So each hook is an OwnedHook: it calls its function only when the module calling it
# is the one it was installed on (a shallow copy, which shares the hook dicts, does nothing either), and
# it is copied and pickled as an inert hook that holds nothing. A submodule's hooks (the extension's
# functions) act for the modules in their table only: a copy, not in it, carries them inert. The copy
# is not watched: watch it with a watch of its own. A copy assigned into the watched model is hooked at
# the next step's start, as any module set after watch() (NOTE: [A model changed after watch()] in
# install.py); remove() takes the inert hooks of such copies out of the model with its own.


class OwnedHook:
    """A module hook that calls `fn(module, *args)` only for `owner`, returning what fn returns.

    Args:
        owner: the module it is registered on (None: an inert hook, what copies get).
        fn: what it calls."""

    __slots__ = ("owner", "fn")

    def __init__(self, owner: Optional[torch.nn.Module], fn: Optional[Callable[..., Any]]) -> None:
        self.owner = owner
        self.fn = fn

    def __call__(self, module: torch.nn.Module, *args: Any) -> Any:
        if module is self.owner:
            return self.fn(module, *args)
        return None

    def __deepcopy__(self, memo: dict) -> OwnedHook:
        return OwnedHook(None, None)

    def __reduce__(self) -> tuple:
        return OwnedHook, (None, None)


# The extension's hooks on each module a watch hooks, one pair whatever the number of watches on it.
_HANDLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pre_hook_traced(module: torch.nn.Module, args: Any) -> None:
    """What torch.compile traces for _C.module_pre_hook: nothing (NOTE: [The watch and torch.compile])."""
    return None


def _hook_traced(module: torch.nn.Module, args: Any, output: Any) -> None:
    """What torch.compile traces for _C.module_hook: nothing."""
    return None


@functools.cache
def _trace_stand_ins() -> None:
    """Has torch.compile trace the stand-ins for the extension's hooks. Once, at the first module hooked:
    it imports Dynamo (about 0.9 s), which an optimizer's construction, torchvision and transformers
    import anyway; registered later, a model compiled before its first eager forward would have traced
    the functions themselves (a graph break at every module)."""
    for original, stand_in in ((_C.module_pre_hook, _pre_hook_traced), (_C.module_hook, _hook_traced)):
        torch.compiler.substitute_in_graph(original)(stand_in)


def hook_module(module: torch.nn.Module, hooks: Any, site: Any, checks_output: bool) -> None:
    """Makes `module`'s calls run the watch's ModuleHooks `hooks` for `site`: its forward pre-hook, and
    with `checks_output` its forward hook too."""
    _trace_stand_ins()
    if not _C.module_hooked(module):
        # A copy of a watched module carries the functions, inert (it is in no table): taken off first, or
        # each of its calls would run its watches twice.
        _remove_inert(module)
        _HANDLES[module] = (module.register_forward_pre_hook(_C.module_pre_hook),
                            module.register_forward_hook(_C.module_hook))
    _C.hook_module(module, hooks, site, checks_output)


def unhook_modules(modules: Any, hooks: Any) -> None:
    """Takes the watch's ModuleHooks `hooks` off `modules`, and the extension's hooks off those no other
    watch hooks."""
    for module in list(modules):
        if _C.unhook_module(module, hooks):
            for handle in _HANDLES.pop(module, ()):
                handle.remove()


def _inert(module: torch.nn.Module, hook: Any) -> bool:
    if isinstance(hook, OwnedHook):
        return hook.owner is None
    return (hook is _C.module_pre_hook or hook is _C.module_hook) and not _C.module_hooked(module)


def _remove_inert(module: torch.nn.Module) -> None:
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, hook in hooks.items() if _inert(module, hook)]:
            del hooks[key]
            for extra in (module._forward_pre_hooks_with_kwargs, module._forward_hooks_with_kwargs,
                          module._forward_hooks_always_called):
                extra.pop(key, None)


def remove_inert_hooks(model: torch.nn.Module) -> None:
    """Takes out of `model`'s modules the inert hooks that copies of watched modules carry (a submodule
    deep-copied while watched and set back into the model kept them after remove(), and so did every
    copy of the model made after that: a probe, session 44)."""
    for module in model.modules():
        _remove_inert(module)
