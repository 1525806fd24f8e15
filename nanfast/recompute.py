"""Whether the op or module running now is activation checkpointing (torch.utils.checkpoint) running a
forward again inside backward, to rebuild the activations it did not keep, or running it the first time
under no_grad (use_reentrant=True)."""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
import torch.utils.checkpoint

from ._stack import ENGINE_RUN, frames_up

__all__ = ["REENTRANT", "UNPACK", "in_reentrant_first_forward", "recomputation", "recomputation_in"]

# The two ways torch.utils.checkpoint recomputes.
# use_reentrant=True: in CheckpointFunction's backward; backward then flows through the graph it builds.
REENTRANT = "reentrant"
# use_reentrant=False: in a saved-tensor unpack hook; only the tensors it makes are used.
UNPACK = "unpack"

# NOTE: [recognizing a recomputation]
# Backward ops run with grad mode off (unless backward(create_graph=True)); a recomputation turns it on.
# With use_reentrant=False the recomputation runs inside a saved-tensor unpack hook of
# torch.utils.checkpoint, which pushes its own saved-tensor hooks (and a checkpoint nested in the
# recomputed region pushes its forward ones): the innermost hooks are that module's. With
# use_reentrant=True it runs in the backward of CheckpointFunction. Neither is a public API: on a torch
# that changes them, a recomputation is taken for backward (locate) or a second call (watch).
# Those hooks are innermost too while a backward with create_graph=True runs inside the checkpointed
# forward (a gradient penalty in a checkpointed block), in the forward and again in its recomputation:
# its ops were taken for a recomputation, judged op by op, and a healthy step raised (a probe, session
# 44). So an op is a recomputation only when, going up the stack, an unpack hook of torch.utils.checkpoint
# (which the recomputation runs in) comes before a run of the autograd engine (which a backward inside
# it runs in).
_CHECKPOINT_MODULE = "torch.utils.checkpoint"
_REENTRANT_NODE = "CheckpointFunctionBackward"
_REENTRANT_FORWARD = getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "forward", None)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def recomputation_in(node: Any) -> Optional[str]:
    """For an op that runs for autograd node `node` (torch._C._current_autograd_node(), not None):
    REENTRANT or UNPACK when it is part of a checkpointed forward being recomputed, else None."""
    if not torch.is_grad_enabled():
        return None
    if type(node).__name__ == _REENTRANT_NODE:
        return REENTRANT
    hooks = _top_hooks(False) if _top_hooks is not None else None
    if hooks is None or getattr(hooks[1], "__module__", None) != _CHECKPOINT_MODULE:
        return None
    checkpoint_file = hooks[1].__code__.co_filename
    for frame in frames_up(sys._getframe(1)):
        if frame.f_code is ENGINE_RUN:
            break
        if frame.f_code.co_name == "unpack_hook" and frame.f_code.co_filename == checkpoint_file:
            return UNPACK
    return None


def recomputation() -> Optional[str]:
    """REENTRANT or UNPACK when the calling code runs inside activation checkpointing's recomputation,
    else None (one C call when not in backward)."""
    node = torch._C._current_autograd_node()
    return None if node is None else recomputation_in(node)


def in_reentrant_first_forward() -> bool:
    """Whether the caller runs inside activation checkpointing's first forward with use_reentrant=True
    (CheckpointFunction.forward, which runs the block under no_grad). Walks the stack: for rare calls."""
    code = getattr(_REENTRANT_FORWARD, "__code__", None)
    return code is not None and any(frame.f_code is code for frame in frames_up(sys._getframe(1)))
