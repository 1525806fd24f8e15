"""A device tensor's values on their way to the host without blocking: the lagged read of a step and
the headroom's max |x| (NOTE: [Headroom without a host read]) are copied now and read later."""

from __future__ import annotations

from typing import Any, Optional

import torch


class HostCopy:
    """A copy of `values` on the host, enqueued without blocking: on CUDA into pinned memory with an
    event recorded after the copy; a tensor on another device is kept as it is (its read copies it).

    Args:
        values: the tensor to bring to the host."""

    __slots__ = ("_host", "_copied")

    def __init__(self, values: torch.Tensor):
        self._copied: Optional[Any] = None
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
            values = host
        self._host = values

    def tolist(self) -> list:
        """Returns:
            The values as Python numbers, once the copy is done (waits for its event, if any)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()
