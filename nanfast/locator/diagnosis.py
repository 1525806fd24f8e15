"""The reason in words for a locate finding: recognizable patterns, keyed on the op, read from the op's
inputs as it read them ("row 5 of 32 is fully masked", "divides by exact zeros"). Runs only once a
finding is made, so it may look at every element."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch

from .values import finite_absmax, finite_min_max

__all__ = ["DIAGNOSES", "diagnose"]

Args = dict[str, Any]  # the op's arguments by schema name, tensors as the op read them


def _tensor(args: Args, name: str) -> Optional[torch.Tensor]:
    t = args.get(name)
    usable = isinstance(t, torch.Tensor) and t.layout == torch.strided and not (t.is_meta or t.is_nested)
    return t if usable else None


def _count(mask: torch.Tensor) -> int:
    return int(mask.sum().item())


def _of(n: int, t: torch.Tensor) -> str:
    return f"{n} of {t.numel()} element{'s' if t.numel() != 1 else ''}"


def _are(n: int) -> str:
    return "is" if n == 1 else "are"


def _exact(value: float, t: torch.Tensor) -> str:
    """`value` with the digits that tell apart neighbouring values of `t`'s dtype (1.0000001 is not 1)."""
    return f"{value:.{17 if t.element_size() > 4 else 9}g}"


def _fully_masked_rows(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x, dim = _tensor(args, "self"), args.get("dim")
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
    n = _count(full)
    if n == 0:
        return None
    return int(full.nonzero()[0, 0].item()), f" ({n} rows in all)" if n > 1 else ""


def _divisor_zero(divisor: str) -> Callable:
    """Division by exact zeros in an op whose divisor is `divisor` (addcdiv: Adam's update divides by
    sqrt(v) + eps, and an eps of 1e-8 rounds to 0 in float16; afiaka87/glide-finetune#5)."""
    def diagnose_divisor(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        t = _tensor(args, divisor)
        if t is None or t.is_complex():
            return None
        n = _count(t == 0)
        return f"divides by exact zeros: {_of(n, t)} of the divisor `{divisor}` {_are(n)} 0" if n else None

    return diagnose_divisor


def _division_by_zero(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    divisor = args.get("other")
    if isinstance(divisor, (int, float)):
        return "divides by the number 0" if divisor == 0 else _quotient_overflow("div", _dividing(args), outputs)
    text = _divisor_zero("other")(args, outputs)
    if text is None:
        return _quotient_overflow("div", _dividing(args), outputs)
    zeros = divisor == 0
    numerator = _tensor(args, "self")
    if numerator is not None and not numerator.is_complex():
        numerator_zero, divisor_zero = torch.broadcast_tensors(numerator == 0, zeros)
        both = _count(numerator_zero & divisor_zero)
        if both:  # counted over the quotient's elements, which broadcasting may make more than the divisor's
            text += f" (0/0 at {both} of the quotient's {divisor_zero.numel()} elements)"
    return text


def _dividing(args: Args) -> list[tuple[str, Any]]:
    return [("self", args.get("self")), ("other", args.get("other"))]


def _reciprocal_of_zero(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x = _tensor(args, "self")
    if x is None or x.is_complex():
        return None
    n = _count(x == 0)
    return f"1/x of exact zeros: {_of(n, x)} of `self` {_are(n)} 0" if n else _quotient_overflow("1/x", [("self", x)], outputs)


def _smallest_magnitude(t: torch.Tensor) -> Optional[float]:
    """The smallest non-zero |x| of the finite values of a real tensor; None for none."""
    magnitudes = t.abs()
    magnitudes = magnitudes[(magnitudes > 0) & torch.isfinite(magnitudes)]
    return float(magnitudes.min()) if magnitudes.numel() else None


def _past_the_limit(operands: str, out: torch.Tensor, name: str) -> Optional[str]:
    """The overflow sentence: `operands` give a result past the most `out`'s dtype holds; None without inf."""
    inf = _count(torch.isinf(out))
    return (f"{out.dtype} overflow in {name}: {operands} give a result past {torch.finfo(out.dtype).max:.6g}, "
            f"the most {out.dtype} holds ({_of(inf, out)} are ±inf)") if inf else None


def _quotient_overflow(name: str, operands: list[tuple[str, Any]], outputs: list[torch.Tensor]) -> Optional[str]:
    """A finite quotient past the dtype's largest value: a divisor tiny but not zero (scores over a small
    temperature in float16, 1/x of a subnormal). `operands`: (name, value) of the numerator, if any, then
    of the divisor, whose smallest magnitude is what overflows."""
    if not outputs or not outputs[0].is_floating_point():
        return None
    parts = []
    for i, (key, value) in enumerate(operands):
        smallest = i == len(operands) - 1
        if isinstance(value, torch.Tensor):
            if value.is_complex() or value.numel() == 0 or not bool(torch.isfinite(value).all()):
                return None  # an infinity it was given: no overflow
            magnitude = _smallest_magnitude(value) if smallest else finite_absmax(value)
            if magnitude is None:
                return None
            parts.append(f"`{key}` {'min' if smallest else 'max'} |x| {magnitude:.6g}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"`{key}` {value:.6g}")
    return _past_the_limit(", ".join(parts), outputs[0], name)


def _domain(name: str, below: Callable[[torch.Tensor], torch.Tensor], edge: str) -> Callable:
    """A diagnosis for an op defined on part of the real line: names how many inputs lie outside."""

    def diagnose_domain(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        x = _tensor(args, "self")
        if x is None or x.is_complex():
            return None
        outside = below(x)
        n = _count(outside)
        if n == 0:
            return None
        values = x[outside]
        return (f"{name} at the edge of its domain: {_of(n, x)} of `self` {_are(n)} {edge} "
                f"(min {_exact(values.min().item(), x)}, max {_exact(values.max().item(), x)})")

    return diagnose_domain


def _pow_domain(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    base, exponent = _tensor(args, "self"), args.get("exponent")
    if isinstance(exponent, torch.Tensor):
        return _pow_tensor_domain(base, _tensor(args, "exponent"), args, outputs)
    if base is None or base.is_complex() or not isinstance(exponent, (int, float)) or not math.isfinite(exponent):
        return None  # a NaN or inf exponent is the finding itself (kind "scalar")
    # Shown to 12 digits: pow's backward raises to `exponent - 1`, which for 2.2 is 1.2000000000000002.
    if exponent < 0 and _count(base == 0):
        zeros = _count(base == 0)
        return f"pow of 0 to the negative exponent {exponent:.12g}: {_of(zeros, base)} of `self` {_are(zeros)} 0"
    if exponent != int(exponent) and _count(base < 0):
        n = _count(base < 0)
        return (f"pow of negative values to the fractional exponent {exponent:.12g}: {_of(n, base)} of `self` "
                "are < 0")
    if exponent < 0 and outputs and outputs[0].is_floating_point() and bool(torch.isfinite(base).all()):
        smallest = _smallest_magnitude(base)  # a negative exponent overflows from the smallest base
        return None if smallest is None else _past_the_limit(
            f"`self` min |x| {smallest:.6g}, `exponent` {exponent:.12g}", outputs[0], "pow")
    return _overflow("pow")(args, outputs)


def _pow_tensor_domain(base: Optional[torch.Tensor], exponent: Optional[torch.Tensor], args: Args,
                       outputs: list[torch.Tensor]) -> Optional[str]:
    """pow with a tensor exponent: 0 to a negative exponent, a negative base to a fractional one, counted
    over the result's elements (the two broadcast)."""
    if base is None or exponent is None or base.is_complex() or exponent.is_complex():
        return None
    if not bool(torch.isfinite(exponent).all()):
        return None
    base, exponent = torch.broadcast_tensors(base, exponent)
    n = _count((base == 0) & (exponent < 0))
    if n:
        return f"pow of 0 to negative exponents: at {_of(n, base)} of the result `self` is 0 and `exponent` < 0"
    if exponent.is_floating_point():
        n = _count((base < 0) & (exponent != exponent.round()))
        if n:
            return (f"pow of negative values to fractional exponents: at {_of(n, base)} of the result `self` is "
                    "< 0 and `exponent` is not a whole number")
    return None if bool((exponent < 0).any()) else _overflow("pow")(args, outputs)


def _overflow(name: str) -> Callable:
    """Finite operands whose sum, difference, product or power passes the largest finite value of the
    result's dtype (a float16 residual stream, ConvNeXt's `(x - u).pow(2)` in float16)."""
    def diagnose_overflow(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        if not outputs or not outputs[0].is_floating_point():
            return None
        out = outputs[0]
        operands = []
        for key in ("self", "other", "exponent"):
            value = args.get(key)
            t = _tensor(args, key)
            if t is not None and not t.is_complex() and t.numel():
                if not bool(torch.isfinite(t).all()):
                    return None  # an infinity it was given: no overflow (0 * inf, inf - inf: _inf_arithmetic)
                largest = finite_absmax(t)
                if largest is not None:
                    operands.append(f"`{key}` max |x| {largest:.6g}")
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                operands.append(f"`{key}` {value:.6g}")
        return _past_the_limit(", ".join(operands), out, name) if operands else None

    return diagnose_overflow


def _inf_arithmetic(name: str) -> Callable:
    """NaN from infinities an op was given (a mask's -inf, an input's; allowed where they were made): 0 * inf
    in mul, inf - inf in add and sub (logsumexp's backward over a row all -inf, pytorch/pytorch#31829)."""
    def diagnose_inf_arithmetic(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        a, b = args.get("self"), args.get("other")
        if not (isinstance(a, torch.Tensor) and a.is_floating_point()) or not isinstance(b, (torch.Tensor, int, float)):
            return None
        b = torch.as_tensor(b, dtype=a.dtype) * args.get("alpha", 1)
        a, b = torch.broadcast_tensors(a, b)
        if name == "mul":
            bad, what = (a.isinf() & (b == 0)) | ((a == 0) & b.isinf()), "0 * inf"
        else:
            same = a.sign() == b.sign()
            bad, what = a.isinf() & b.isinf() & (same if name == "sub" else ~same), "inf - inf"
        n = _count(bad)
        return f"{what} at {_of(n, a)}: infinities it was given (a mask's, an input's) meet" if n else None

    return diagnose_inf_arithmetic


def _first(*diagnoses: Callable) -> Callable:
    """The first of `diagnoses` that recognizes its pattern."""
    def diagnose_first(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        return next((text for d in diagnoses if (text := d(args, outputs)) is not None), None)

    return diagnose_first


def _xlogy_at_zero(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    """xlogy(x, y) is -inf where y is 0 and x is not (torch.distributions' Beta.log_prob at 0,
    pytorch/pytorch#92260)."""
    x, y = args.get("self"), args.get("other")
    if not isinstance(y, torch.Tensor) or y.is_complex():
        return None
    x, y = torch.broadcast_tensors(torch.as_tensor(x, dtype=y.dtype), y)
    n = _count((y == 0) & (x != 0))
    return f"x * log(y) at y = 0 with x != 0: log(0) is -inf at {_of(n, y)}" if n else None


def _exp_overflow(log_of_base: float) -> Callable:
    def diagnose_exp(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        x = _tensor(args, "self")
        if x is None or not x.is_floating_point() or not outputs:
            return None
        limit = math.log(torch.finfo(outputs[0].dtype).max) / log_of_base
        largest = finite_min_max(x)[1]
        if largest is None or largest <= limit:
            return None
        return (f"exp overflow: the largest input {largest:.6g} exceeds "
                f"{limit:.6g}, the largest whose exp {outputs[0].dtype} holds")

    return diagnose_exp


def _loss_over_nothing(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    target, ignore = _tensor(args, "target"), args.get("ignore_index")
    if target is None or not isinstance(ignore, int) or args.get("reduction") != 1:  # 1: Reduction::Mean
        return None
    if target.numel() == 0:
        return "a mean loss over zero elements (the batch is empty)"
    if bool((target == ignore).all().item()):
        return f"a mean loss over zero elements: every one of the {target.numel()} targets is ignore_index ({ignore})"
    return None


def _mean_of_nothing(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x = _tensor(args, "self")
    return "a mean over zero elements (the tensor is empty)" if x is not None and x.numel() == 0 else None


def _impossible_alignments(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    targets, log_probs = args.get("targets"), _tensor(args, "log_probs")
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


def _running_variance_overflow(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    """A training batch norm whose running_var (its last checked output, written in place: NOTE: [writes
    an op does not return]) became +inf from a batch variance past its dtype's largest value."""
    x, running_var = _tensor(args, "input"), outputs[-1] if len(outputs) == 5 else None
    if x is None or running_var is None or x.is_complex() or not x.dtype.is_floating_point:
        return None
    n = _count(running_var == math.inf)
    if not n:
        return None
    dims = [d for d in range(x.dim()) if d != 1]
    variance = x.double().var(dim=dims).max().item()
    dtype = str(running_var.dtype).removeprefix("torch.")
    return (f"the batch's variance (largest {variance:.4g}) passes {dtype}'s largest finite value "
            f"{torch.finfo(running_var.dtype).max:.6g}: {_of(n, running_var)} of `running_var` {_are(n)} +inf")


def _constant_rows_without_eps(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x, shape, eps = _tensor(args, "input"), args.get("normalized_shape"), args.get("eps")
    if x is None or eps != 0 or not isinstance(shape, (list, tuple)) or not shape or x.is_complex():
        return None
    rows = x.reshape(-1, math.prod(int(d) for d in shape))
    constant = (rows == rows[:, :1]).all(dim=-1)
    n = _count(constant)
    if n == 0:
        return None
    return (f"layer norm with eps=0 over constant rows: {n} of {rows.shape[0]} row{'s' if rows.shape[0] != 1 else ''} "
            f"{_are(n)} constant (variance 0), so (x - mean) / sqrt(0 + eps) is 0/0")


def _no_degrees_of_freedom(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x = _tensor(args, "self")
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


def _fully_masked_keys(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    mask = _tensor(args, "mask")
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


# (matmul, linear and einsum reach ATen as these)
_MATMUL_INPUTS = {"mm": ("self", "mat2"), "bmm": ("self", "mat2"), "addmm": ("mat1", "mat2"),
                  "baddbmm": ("batch1", "batch2")}


def _matmul_overflow(args: Args, outputs: list[torch.Tensor], packet: str) -> Optional[str]:
    if not outputs or not outputs[0].is_floating_point():
        return None
    a, b = (_tensor(args, n) for n in _MATMUL_INPUTS[packet])
    if a is None or b is None or not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return None  # a non-finite input (inf * 0) is no overflow: the finding names that input
    limit = torch.finfo(outputs[0].dtype).max
    a_max, b_max = a.abs().max().item(), b.abs().max().item()
    return (f"{outputs[0].dtype} overflow in a matmul: the inputs' max |x| are {a_max:.6g} and {b_max:.6g} "
            f"over {a.shape[-1]} terms, while {outputs[0].dtype} holds at most {limit:.6g}")


def _cast_overflow(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x = _tensor(args, "self")
    if x is None or not outputs or not outputs[0].is_floating_point() or not x.is_floating_point():
        return None
    limit = torch.finfo(outputs[0].dtype).max
    largest = x.abs().max().item()
    if largest <= limit:
        return None
    return f"cast overflow: the largest |x| {largest:.6g} exceeds {limit:.6g}, the most {outputs[0].dtype} holds"


# The table: ATen op (overload packet; an in-place one is looked up as its out-of-place form) -> diagnosis.
# Each returns a sentence, or None when the op's inputs do not show its pattern.
DIAGNOSES: dict[str, Callable[[Args, list[torch.Tensor]], Optional[str]]] = {
    "_softmax": _fully_masked_rows, "_log_softmax": _fully_masked_rows,
    "div": _division_by_zero, "reciprocal": _reciprocal_of_zero,
    "log": _domain("log", lambda x: x <= 0, "<= 0"), "log2": _domain("log2", lambda x: x <= 0, "<= 0"),
    "log10": _domain("log10", lambda x: x <= 0, "<= 0"),
    "log1p": _domain("log1p", lambda x: x <= -1, "<= -1"),
    "sqrt": _domain("sqrt", lambda x: x < 0, "< 0"), "rsqrt": _domain("rsqrt", lambda x: x <= 0, "<= 0"),
    "acos": _domain("acos", lambda x: x.abs() > 1, "outside [-1, 1]"),
    "asin": _domain("asin", lambda x: x.abs() > 1, "outside [-1, 1]"),
    "atanh": _domain("atanh", lambda x: x.abs() >= 1, "outside (-1, 1)"),
    "pow": _pow_domain,
    **{packet: _first(_overflow(packet), _inf_arithmetic(packet)) for packet in ("add", "sub", "mul")},
    "sum": _overflow("sum"), "xlogy": _xlogy_at_zero,
    "addcdiv": _divisor_zero("tensor2"),
    "exp": _exp_overflow(1.0), "expm1": _exp_overflow(1.0),
    "exp2": _exp_overflow(math.log(2.0)),
    "nll_loss_forward": _loss_over_nothing, "nll_loss2d_forward": _loss_over_nothing,
    "mean": _mean_of_nothing,
    "_ctc_loss": _impossible_alignments,
    "_to_copy": _cast_overflow,
    "native_layer_norm": _constant_rows_without_eps, "native_batch_norm": _running_variance_overflow,
    "std": _no_degrees_of_freedom, "var": _no_degrees_of_freedom, "std_mean": _no_degrees_of_freedom,
    "var_mean": _no_degrees_of_freedom,
    "_native_multi_head_attention": _fully_masked_keys, "_transformer_encoder_layer_fwd": _fully_masked_keys,
    **{packet: (lambda args, outputs, packet=packet: _matmul_overflow(args, outputs, packet))
       for packet in _MATMUL_INPUTS},
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
    if not any(_count(torch.isnan(o)) for o in outputs if o.layout == torch.strided and not o.is_meta):
        return None
    tensors = [(name, t) for name, value in args.items() for t in (_tensor(args, name),) if t is not None]
    if any(_count(torch.isnan(t)) for _, t in tensors):
        return None
    held = [(name, t, _count(torch.isinf(t))) for name, t in tensors]
    named = [f"{_of(n, t)} of `{name}` {_are(n)} infinite" for name, t, n in held if n]
    return f"{packet} of infinite values: {'; '.join(named)}" if named else None
