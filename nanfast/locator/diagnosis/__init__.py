"""The reason in words for a locate finding: recognizable patterns, keyed on the op, read from the op's
inputs as it read them ("row 5 of 32 is fully masked", "divides by exact zeros"). Runs only once a
finding is made, so it may look at every element."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch

from .arithmetic import (MATMUL_INPUTS, cast_overflow, division_by_zero, divisor_zero, domain, exp_overflow,
                         inf_arithmetic, matmul_overflow, overflow, pow_domain, reciprocal_of_zero, xlogy_at_zero)
from .reductions import (constant_rows_without_eps, fully_masked_keys, fully_masked_rows, impossible_alignments,
                         loss_over_nothing, mean_of_nothing, no_degrees_of_freedom, running_variance_overflow)
from .words import Args, count, elements_of, is_are, tensor_arg

__all__ = ["DIAGNOSES", "diagnose"]


def _first(*diagnoses: Callable) -> Callable:
    """The first of `diagnoses` that recognizes its pattern."""
    def diagnose_first(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        return next((text for d in diagnoses if (text := d(args, outputs)) is not None), None)

    return diagnose_first


# The table: ATen op (overload packet; an in-place one is looked up as its out-of-place form) -> diagnosis.
# Each returns a sentence, or None when the op's inputs do not show its pattern.
DIAGNOSES: dict[str, Callable[[Args, list[torch.Tensor]], Optional[str]]] = {
    "_softmax": fully_masked_rows, "_log_softmax": fully_masked_rows,
    "div": division_by_zero, "reciprocal": reciprocal_of_zero,
    "log": domain("log", lambda x: x <= 0, "<= 0"), "log2": domain("log2", lambda x: x <= 0, "<= 0"),
    "log10": domain("log10", lambda x: x <= 0, "<= 0"),
    "log1p": domain("log1p", lambda x: x <= -1, "<= -1"),
    "sqrt": domain("sqrt", lambda x: x < 0, "< 0"), "rsqrt": domain("rsqrt", lambda x: x <= 0, "<= 0"),
    "acos": domain("acos", lambda x: x.abs() > 1, "outside [-1, 1]"),
    "asin": domain("asin", lambda x: x.abs() > 1, "outside [-1, 1]"),
    "atanh": domain("atanh", lambda x: x.abs() >= 1, "outside (-1, 1)"),
    "pow": pow_domain,
    **{packet: _first(overflow(packet), inf_arithmetic(packet)) for packet in ("add", "sub", "mul")},
    "sum": overflow("sum"), "xlogy": xlogy_at_zero,
    "addcdiv": divisor_zero("tensor2"),
    "exp": exp_overflow(1.0), "expm1": exp_overflow(1.0),
    "exp2": exp_overflow(math.log(2.0)),
    "nll_loss_forward": loss_over_nothing, "nll_loss2d_forward": loss_over_nothing,
    "mean": mean_of_nothing,
    "_ctc_loss": impossible_alignments,
    "_to_copy": cast_overflow,
    "native_layer_norm": constant_rows_without_eps, "native_batch_norm": running_variance_overflow,
    "std": no_degrees_of_freedom, "var": no_degrees_of_freedom, "std_mean": no_degrees_of_freedom,
    "var_mean": no_degrees_of_freedom,
    "_native_multi_head_attention": fully_masked_keys, "_transformer_encoder_layer_fwd": fully_masked_keys,
    **{packet: (lambda args, outputs, packet=packet: matmul_overflow(args, outputs, packet))
       for packet in MATMUL_INPUTS},
}


def diagnose(op: str, args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    """The reason in words for a finding at `op` ("aten.div.Tensor"), from its arguments as it read them
    and its outputs; None when the op has no entry or its inputs do not show the pattern.

    Args:
        op: the op's full name, namespace.packet.overload.
        args: its arguments by schema name (tensors as the op read them: in-place ops' before the op).
        outputs: its checked outputs.

    Returns:
        A sentence, or None.
    """
    packet = op.split(".")[1] if op.count(".") >= 2 else op
    # An in-place op (log_, div_) is diagnosed as its out-of-place form: `args` hold what it read.
    entry = DIAGNOSES.get(packet) or DIAGNOSES.get(packet.removesuffix("_"))
    found = entry(args, outputs) if entry is not None else None
    return found if found is not None else _nan_of_infinities(packet, args, outputs)


def _nan_of_infinities(packet: str, args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    """Any op with no pattern of its own that made NaN where its tensor inputs hold infinities but no NaN:
    cos(inf), binary_cross_entropy_with_logits of a -inf logit (pytorch/pytorch#18287, #49844: said only
    "made NaN from inputs without NaN", a probe, session 51). Names the inputs holding them."""
    if not any(count(torch.isnan(o)) for o in outputs if o.layout == torch.strided and not o.is_meta):
        return None
    tensors = [(name, t) for name, value in args.items() for t in (tensor_arg(args, name),) if t is not None]
    if any(count(torch.isnan(t)) for _, t in tensors):
        return None
    held = [(name, t, count(torch.isinf(t))) for name, t in tensors]
    named = [f"{elements_of(n, t)} of `{name}` {is_are(n)} infinite" for name, t, n in held if n]
    return f"{packet} of infinite values: {'; '.join(named)}" if named else None
