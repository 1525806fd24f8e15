"""The Python call stack, walked from a frame outwards: how the watch finds the call of a model that runs
now, and how checkpointing's recomputation is recognized."""

from __future__ import annotations

from collections.abc import Iterator
from types import FrameType
from typing import Optional

__all__ = ["frames_up"]


def frames_up(frame: Optional[FrameType]) -> Iterator[FrameType]:
    """`frame`, then each frame that called it, out to the outermost."""
    while frame is not None:
        yield frame
        frame = frame.f_back
