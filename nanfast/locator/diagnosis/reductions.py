"""Diagnoses of reductions, losses and normalizations: a row masked whole, a mean over nothing, impossible
alignments, no degrees of freedom, a constant row without eps, a running variance past the dtype's max."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .words import Args, count, elements_of, is_are, tensor_arg


def fully_masked_rows(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x, dim = tensor_arg(args, "self"), args.get("dim")
    if x is None or not isinstance(dim, int) or x.dim() == 0:
        return None
    dim %= x.dim()
    rows = x.movedim(dim, -1).reshape(-1, x.shape[dim])
    found = _first_full_row(rows == -math.inf)
    if found is None:
        return None
    first, more = found
    return (f"row {first} of {rows.shape[0]} along dim {dim} is fully masked (every entry -inf){more}: "
            f"softmax of it is 0/0")


def _first_full_row(masked: torch.Tensor) -> Optional[tuple[int, str]]:
    """The first row of `masked` (bool [rows, n]) that is True throughout, and " (N rows in all)" when
    there are several; None when there is none."""
    full = masked.all(dim=-1)
    n = count(full)
    if n == 0:
        return None
    return int(full.nonzero()[0, 0].item()), f" ({n} rows in all)" if n > 1 else ""


def loss_over_nothing(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    target, ignore = tensor_arg(args, "target"), args.get("ignore_index")
    if target is None or not isinstance(ignore, int) or args.get("reduction") != 1:  # 1: Reduction::Mean
        return None
    if target.numel() == 0:
        return "a mean loss over zero elements (the batch is empty)"
    if bool((target == ignore).all().item()):
        return f"a mean loss over zero elements: every one of the {target.numel()} targets is ignore_index ({ignore})"
    return None


def mean_of_nothing(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x = tensor_arg(args, "self")
    return "a mean over zero elements (the tensor is empty)" if x is not None and x.numel() == 0 else None


def impossible_alignments(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    targets, log_probs = args.get("targets"), tensor_arg(args, "log_probs")
    input_lengths, target_lengths = args.get("input_lengths"), args.get("target_lengths")
    if not isinstance(targets, torch.Tensor) or log_probs is None:
        return None
    input_lengths = torch.as_tensor(input_lengths).tolist()
    target_lengths = torch.as_tensor(target_lengths).tolist()
    batched = log_probs.dim() == 3
    impossible = []
    offset = 0
    for b, (t_in, t_len) in enumerate(zip(input_lengths, target_lengths)):
        if targets.dim() == 2:
            labels = targets[b, :t_len]
        else:  # concatenated targets
            labels = targets[offset:offset + t_len]
            offset += t_len
        repeats = int((labels[1:] == labels[:-1]).sum().item()) if t_len > 1 else 0
        if t_len + repeats > t_in:
            impossible.append((b, t_len, repeats, t_in))
    if not impossible:
        return None
    b, t_len, repeats, t_in = impossible[0]
    sample = f"sample {b}" if batched else "the sample"
    more = f" ({len(impossible)} samples in all)" if len(impossible) > 1 else ""
    return (f"CTC with impossible alignments: {sample} needs at least {t_len + repeats} frames ({t_len} labels, "
            f"{repeats} repeated) but its input length is {t_in}{more}")


def running_variance_overflow(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    """A training batch norm whose running_var (its last checked output, written in place: NOTE: [writes
    an op does not return]) became +inf from a batch variance past its dtype's largest value."""
    x, running_var = tensor_arg(args, "input"), outputs[-1] if len(outputs) == 5 else None
    if x is None or running_var is None or x.is_complex() or not x.dtype.is_floating_point:
        return None
    n = count(running_var == math.inf)
    if not n:
        return None
    dims = [d for d in range(x.dim()) if d != 1]
    variance = x.double().var(dim=dims).max().item()
    dtype = str(running_var.dtype).removeprefix("torch.")
    return (f"the batch's variance (largest {variance:.4g}) passes {dtype}'s largest finite value "
            f"{torch.finfo(running_var.dtype).max:.6g}: {elements_of(n, running_var)} of `running_var` "
            f"{is_are(n)} +inf")


def constant_rows_without_eps(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x, shape, eps = tensor_arg(args, "input"), args.get("normalized_shape"), args.get("eps")
    if x is None or eps != 0 or not isinstance(shape, (list, tuple)) or not shape or x.is_complex():
        return None
    rows = x.reshape(-1, math.prod(int(d) for d in shape))
    constant = (rows == rows[:, :1]).all(dim=-1)
    n = count(constant)
    if n == 0:
        return None
    return (f"layer norm with eps=0 over constant rows: {n} of {rows.shape[0]} row{'s' if rows.shape[0] != 1 else ''} "
            f"{is_are(n)} constant (variance 0), so (x - mean) / sqrt(0 + eps) is 0/0")


def no_degrees_of_freedom(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x = tensor_arg(args, "self")
    if x is None:
        return None
    correction = args.get("correction")
    if correction is None:  # the .dim and default overloads: unbiased (Bessel's correction) by default
        correction = 1 if args.get("unbiased", True) else 0
    dim = args.get("dim")
    dims = range(x.dim()) if dim is None or (isinstance(dim, (list, tuple)) and not dim) else \
        ([dim] if isinstance(dim, int) else list(dim))
    n = math.prod(int(x.shape[d]) for d in dims) if x.dim() else 1
    if n - float(correction) > 0:
        return None
    return (f"a variance over {n} element{'s' if n != 1 else ''} with correction {correction}: "
            f"{n} - {correction} = {n - float(correction):g} degrees of freedom (one sample with Bessel's correction)")


def fully_masked_keys(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    mask = tensor_arg(args, "mask")
    if mask is None or mask.dim() < 1 or mask.is_complex():
        return None
    # True masks a key out in a boolean mask; -inf in an additive one (what MultiheadAttention passes)
    out = mask if mask.dtype == torch.bool else mask == -math.inf
    found = _first_full_row(out.reshape(-1, mask.shape[-1]))
    if found is None:
        return None
    first, more = found
    return (f"row {first} of the attention mask masks every one of its {mask.shape[-1]} keys{more}: the fused "
            f"attention's softmax of it is 0/0 (a padding mask with a sequence of padding alone)")
