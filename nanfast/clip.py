"""`clip_grad_norm_` on the fused pass: the total norm and the non-finite counts of all gradients come
from one read of the gradients (torch.nn.utils.clip_grad_norm_ reads them for the norm too, and turns
every gradient into NaN when one element is non-finite)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from typing import Optional, Union

import torch

from ._tree import group_by_device
from .check import check_all, naming_entries
from .ops import combine_norms, stats
from .report import NonFiniteError

Parameters = Union[torch.Tensor, Iterable[torch.Tensor], Iterable[tuple[str, torch.Tensor]]]

# As torch.nn.utils.clip_grad_norm_'s, in the same coefficient max_norm / (norm + eps) (ours from the
# float64 norm; low-precision gradients may land one rounding away from torch's).
_EPS = 1e-6


def _named_grads(parameters: Parameters) -> list[tuple[str, torch.Tensor]]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    named = []
    for i, item in enumerate(parameters):
        name, p = item if isinstance(item, tuple) else (str(i), item)
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"nanfast.clip_grad_norm_: entry {name!r} is of type {type(p).__name__}, not a Tensor")
        if p.grad is None:
            continue
        if p.grad.layout != torch.strided:
            raise ValueError(f"nanfast.clip_grad_norm_: the grad of {name!r} has layout {p.grad.layout}; "
                             "only strided grads are supported")
        named.append((name, p.grad))
    return named


def total_norm(norms: list[torch.Tensor], absmaxes: list[torch.Tensor], norm_type: float,
               grads: list[torch.Tensor]) -> torch.Tensor:
    """float64 0-dim on the device of norms[0]: the 2-norm (from per-tensor 2-norms) or the inf-norm
    (from per-tensor max |x|) of the finite elements of all tensors (`grads`, those the norms are of).
    No host sync."""
    device = norms[0].device
    if norm_type == 2.0:  # one device's norms are taken as they are (a cat of one tensor is a copy)
        parts = norms[0] if len(norms) == 1 else torch.cat([n.to(device, non_blocking=True) for n in norms])
        # combine_norms scales the parts so that their squares cannot overflow float64 (NOTE: [Combining
        # norms]): seven ops, each a launch on a GPU, where torch's clip makes two. Only a float64
        # tensor's norm can pass 1e154; a float32 one's is below 3.5e38 * sqrt(numel), whose square and a
        # sum of millions of them are far inside float64's range, so one vector norm is exact enough.
        if norm_dtype(grads).itemsize <= 4:
            return torch.linalg.vector_norm(parts)
        return combine_norms(parts)
    total = torch.stack([a.max().to(device, non_blocking=True) if a.numel() else torch.zeros((), dtype=torch.float64, device=device)
                         for a in absmaxes]).max()
    # The kernels' max |x| of a complex tensor is of its real and imaginary parts, and torch's inf-norm is
    # of |z| (3+4j: 4, not 5, and a gradient left above max_norm: a probe, session 44): one more pass for
    # those, never below the parts' maximum.
    moduli = [torch.where(g.isfinite(), g.abs(), 0).amax().to(device, torch.float64, non_blocking=True)
              for g in grads if g.is_complex() and g.numel()]
    return torch.stack([total, *moduli]).max() if moduli else total


def scale_grads_(grads: list[torch.Tensor], total: torch.Tensor, max_norm: Union[float, torch.Tensor]) -> None:
    """Multiplies `grads` by min(1, max_norm / (total + eps)), as torch does, without a host sync.

    The coefficient stays in float32 at least: rounded to float16 first, a coefficient below float16's
    smallest normal (6.1e-5: a total norm above ~1e4 clipped to 1) kept a few bits, and float16 gradients
    beside float32 ones came out 0.5-3% off where torch's are one rounding off (a probe, session 51). A
    one-element tensor max_norm is taken as its value, as torch's float(max_norm) does, without the sync.
    """
    if isinstance(max_norm, torch.Tensor):
        max_norm = max_norm.reshape(())
    coef = torch.clamp(max_norm / (total + _EPS), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), group in groups.items():
        at_least_float32 = torch.promote_types(_REAL.get(dtype, dtype), torch.float32)
        torch._foreach_mul_(group, coef.to(device=device, dtype=at_least_float32, non_blocking=True))


_REAL = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def norm_dtype(grads: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype of a total norm over `grads`, as torch.nn.utils.clip_grad_norm_ returns it: their
    promoted dtype (a float16 gradient first does not make a float32 one's norm overflow), real for
    complex gradients."""
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
    return _REAL.get(dtype, dtype)


def check_norm_type(norm_type: float, api: str) -> float:
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"{api}: norm_type must be 2 or inf (the fused pass computes 2-norms and max |x|), "
                         f"got {norm_type}")
    return norm_type


@torch.no_grad()
def clip_grad_norm_(parameters: Parameters, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = True, foreach: Optional[bool] = None) -> torch.Tensor:
    """Clips the gradients of `parameters` to total norm `max_norm`, as torch.nn.utils.clip_grad_norm_,
    from one fused pass over the gradients. The norm is that of the finite elements, so finite gradients
    never become NaN.

    Args:
        parameters: Tensors or (name, Tensor) pairs (e.g. model.named_parameters()); those without a
            gradient are left out.
        max_norm: the largest total norm kept.
        norm_type: 2 or inf (the max norm).
        error_if_nonfinite: (the default here, unlike torch) one host read checks the counts and a
            non-finite gradient raises NonFiniteError naming it; False: no host sync, and non-finite
            elements are left as they are (a `nanfast.watch` reports them).
        foreach: taken for torch's signature (a drop-in replacement passes it) and left unused: the
            fused pass is one call per device either way.

    Returns:
        The total norm before clipping (0-dim, on the first gradient's device, in `norm_dtype` of the
        gradients, as torch's: float16 gradients whose norm is above 65504 get inf, although they are
        finite and were clipped by their float64 norm, where torch's own norm overflows and raises).

    Raises:
        NonFiniteError: a gradient holds NaN/inf and error_if_nonfinite.
        ValueError: norm_type is not 2 or inf (the fused pass computes 2-norms and max |x|)."""
    norm_type = check_norm_type(norm_type, "nanfast.clip_grad_norm_")
    named = _named_grads(parameters)
    if not named:
        return torch.zeros(())
    grads = [g for _, g in named]
    results = [naming_entries(stats, [named[i][0] for i in indices], [grads[i] for i in indices],
                              "nanfast.clip_grad_norm_") for indices in group_by_device(grads).values()]
    total = total_norm([s.norm for s in results], [s.absmax for s in results], norm_type, grads)
    if error_if_nonfinite and sum(int(s.counts.sum().item()) for s in results):
        # Names every non-finite gradient; a gradient is never an intended infinity (a parameter named
        # attn_mask or best_loss: its inf gradient was clipped around, unreported, before session 44).
        raise NonFiniteError(dataclasses.replace(check_all(named, raise_on_nonfinite=False), intended=False))
    scale_grads_(grads, total, max_norm)
    return total.to(norm_dtype(grads))
