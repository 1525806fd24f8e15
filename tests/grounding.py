"""An independent tracer for the reproduced bug reports: a bare TorchDispatchMode, sharing no code with
nanfast, that records every ATen op whose floating output holds inf while all of its floating inputs
(tensors and numbers) were finite, or NaN while none held NaN (softmax of a row an -inf mask filled),
with its phase and autograd node. Backward nodes are judged as torch
users see them: the first such op in a node counts only when a gradient the node returns is non-finite
(torch masks 0/0 inside formulas before returning)."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode


class Made(NamedTuple):
    op: str
    phase: str  # "forward" | "backward"
    node: Optional[str]


def _bad(value) -> bool:
    if isinstance(value, torch.Tensor):
        return (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all())
    return isinstance(value, float) and not math.isfinite(value)


def _nan(value) -> bool:
    if isinstance(value, torch.Tensor):
        return (value.is_floating_point() or value.is_complex()) and bool(torch.isnan(value).any())
    return isinstance(value, float) and math.isnan(value)


def _made(out, inputs) -> bool:
    outs, ins = tree_leaves(out), tree_leaves(inputs)
    inf_from_finite = any(_bad(t) for t in outs) and not any(_bad(v) for v in ins)
    return inf_from_finite or (any(_nan(t) for t in outs) and not any(_nan(v) for v in ins))


class Tracer(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.made: list[Made] = []
        self._held: dict[int, Made] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or str(func.overloadpacket.__name__) in ("empty", "empty_like", "empty_strided"):
            return out
        if _made(out, (args, kwargs)):
            node = torch._C._current_autograd_node()
            if node is None:
                self.made.append(Made(str(func), "forward", None))
            elif id(node) not in self._held and type(node).__name__ != "AccumulateGrad":
                self._held[id(node)] = Made(str(func), "backward", type(node).__name__)
                handle = []

                def judge(grad_inputs, grad_outputs, key=id(node)):
                    handle[0].remove()
                    held = self._held.pop(key)
                    if any(_bad(g) for g in grad_inputs if g is not None):
                        self.made.append(held)

                handle.append(node.register_hook(judge))
        return out


def first_made(fn) -> Optional[Made]:
    """Runs fn under the tracer; the first op that made NaN/inf from finite values, or None."""
    with Tracer() as tracer:
        fn()
    return tracer.made[0] if tracer.made else None
