"""The form of every hook the watch puts on a module: it acts for that module only, and a copy of the
module gets an inert one (see NOTE: [Copies of a watched model])."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# NOTE: [Copies of a watched model]
# An EMA or teacher model is made with copy.deepcopy(model) (timm's ModelEmaV2, torch's AveragedModel),
# and whole models are saved with torch.save(model), often while a watch is on. Both copy the module's
# hook dicts. A bound method of the Watch would be deep-copied with the Watch itself (which holds C++
# state that cannot be copied: TypeError), and a plain function is kept by reference, so the copy's
# forwards would be recorded as the watched module's (a NaN in the teacher reported, even skipped, as
# the student's). So each hook is an OwnedHook: it calls its function only when the module calling it
# is the one it was installed on (a shallow copy, which shares the hook dicts, does nothing either), and
# it is copied and pickled as an inert hook that holds nothing. The copy is not watched: watch it with a
# watch of its own. A copy assigned into the watched model is hooked at the next step's start, as any
# module set after watch() (NOTE: [A model changed after watch()] in install.py); remove() takes the inert
# hooks of such copies out of the model with its own.


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


def remove_inert_hooks(model: torch.nn.Module) -> None:
    """Takes out of `model`'s modules the inert hooks that copies of watched modules carry (a submodule
    deep-copied while watched and set back into the model kept them after remove(), and so did every
    copy of the model made after that: a probe, session 44)."""
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, hook in hooks.items() if isinstance(hook, OwnedHook) and hook.owner is None]:
                del hooks[key]
                for extra in (module._forward_pre_hooks_with_kwargs, module._forward_hooks_with_kwargs,
                              module._forward_hooks_always_called):
                    extra.pop(key, None)
