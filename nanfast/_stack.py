"""The Python call stack, walked from a frame outwards: how the watch finds the call of a model that runs
now, and how checkpointing's recomputation is recognized."""

from __future__ import annotations

from collections.abc import Iterator
from types import FrameType
from typing import Optional

import torch

__all__ = ["ENGINE_RUN", "frames_up"]

# The code of torch.autograd's Python entry into the engine (backward() and grad() both call it): Python
# code running further in on the stack, in backward, was called by the engine (a hook, a custom backward,
# checkpointing's recomputation). None on a torch without it.
ENGINE_RUN = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__", None)


def frames_up(frame: Optional[FrameType]) -> Iterator[FrameType]:
    """`frame`, then each frame that called it, out to the outermost."""
    while frame is not None:
        yield frame
        frame = frame.f_back
