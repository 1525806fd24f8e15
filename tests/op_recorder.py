"""OpRecorder: a dispatch mode that counts the ATen ops a piece of code runs, host syncs among them.
A module of its own so that tests and the processes they spawn can import it."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpRecorder(TorchDispatchMode):
    """Counts the ops that reach the dispatcher's Python key, by name ("aten._local_scalar_dense.default",
    "nanfast.stats.default", ...). `.item()`, `bool()`, `int()`, `float()` of a tensor all go through
    aten._local_scalar_dense, the host sync this project must not do inside its ops."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.devices: dict[str, list[set[str]]] = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.counts[name] += 1
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        self.devices[name].append({str(t.device) for t in tensors})
        return func(*args, **(kwargs or {}))

    @property
    def host_syncs(self) -> int:
        return self.counts["aten._local_scalar_dense.default"]
