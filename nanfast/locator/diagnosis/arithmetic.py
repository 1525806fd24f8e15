"""Diagnoses of elementwise arithmetic, matmuls and casts: division by zero, values outside a function's
domain, overflow past the dtype's largest value, infinities that meet (0 * inf, inf - inf)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch

from ..values import finite_absmax, finite_min_max
from .words import Args, count, elements_of, exact, is_are, tensor_arg


def divisor_zero(divisor: str) -> Callable:
    """Division by exact zeros in an op whose divisor is `divisor` (addcdiv: Adam's update divides by
    sqrt(v) + eps, and an eps of 1e-8 rounds to 0 in float16; afiaka87/glide-finetune#5)."""
    def diagnose_divisor(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        t = tensor_arg(args, divisor)
        if t is None or t.is_complex():
            return None
        n = count(t == 0)
        return f"divides by exact zeros: {elements_of(n, t)} of the divisor `{divisor}` {is_are(n)} 0" if n else None

    return diagnose_divisor


def division_by_zero(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    divisor = args.get("other")
    if isinstance(divisor, (int, float)):
        return "divides by the number 0" if divisor == 0 else _QUOTIENT_OVERFLOW(args, outputs)
    text = divisor_zero("other")(args, outputs)
    if text is None:
        return _QUOTIENT_OVERFLOW(args, outputs)
    zeros = divisor == 0
    numerator = tensor_arg(args, "self")
    if numerator is not None and not numerator.is_complex():
        numerator_zeros, divisor_zeros = torch.broadcast_tensors(numerator == 0, zeros)
        both = count(numerator_zeros & divisor_zeros)
        if both:  # counted over the quotient's elements, which broadcasting may make more than the divisor's
            text += f" (0/0 at {both} of the quotient's {divisor_zeros.numel()} elements)"
    return text


def reciprocal_of_zero(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x = tensor_arg(args, "self")
    if x is None or x.is_complex():
        return None
    n = count(x == 0)
    if n:
        return f"1/x of exact zeros: {elements_of(n, x)} of `self` {is_are(n)} 0"
    return _RECIPROCAL_OVERFLOW(args, outputs)


def _smallest_magnitude(t: torch.Tensor) -> Optional[float]:
    """The smallest non-zero |x| of the finite values of a real tensor; None for none."""
    magnitudes = t.abs()
    magnitudes = magnitudes[(magnitudes > 0) & torch.isfinite(magnitudes)]
    return float(magnitudes.min()) if magnitudes.numel() else None


def domain(name: str, below: Callable[[torch.Tensor], torch.Tensor], edge: str) -> Callable:
    """A diagnosis for an op defined on part of the real line: names how many inputs lie outside."""

    def diagnose_domain(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        x = tensor_arg(args, "self")
        if x is None or x.is_complex():
            return None
        outside = below(x)
        n = count(outside)
        if n == 0:
            return None
        values = x[outside]
        return (f"{name} at the edge of its domain: {elements_of(n, x)} of `self` {is_are(n)} {edge} "
                f"(min {exact(values.min().item(), x)}, max {exact(values.max().item(), x)})")

    return diagnose_domain


def pow_domain(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    base, exponent = tensor_arg(args, "self"), args.get("exponent")
    if isinstance(exponent, torch.Tensor):
        return _pow_tensor_domain(base, tensor_arg(args, "exponent"), args, outputs)
    if base is None or base.is_complex() or not isinstance(exponent, (int, float)) or not math.isfinite(exponent):
        return None  # a NaN or inf exponent is the finding itself (kind "scalar")
    # Shown to 12 digits: pow's backward raises to `exponent - 1`, which for 2.2 is 1.2000000000000002.
    if exponent < 0 and count(base == 0):
        zeros = count(base == 0)
        return (f"pow of 0 to the negative exponent {exponent:.12g}: {elements_of(zeros, base)} of `self` "
                f"{is_are(zeros)} 0")
    if exponent != int(exponent) and count(base < 0):
        n = count(base < 0)
        return (f"pow of negative values to the fractional exponent {exponent:.12g}: {elements_of(n, base)} of `self` "
                "are < 0")
    if exponent < 0:  # a negative exponent overflows from the smallest base
        return overflow("pow", smallest=("self",))(args, outputs)
    return overflow("pow")(args, outputs)


def _pow_tensor_domain(base: Optional[torch.Tensor], exponent: Optional[torch.Tensor], args: Args,
                       outputs: list[torch.Tensor]) -> Optional[str]:
    """pow with a tensor exponent: 0 to a negative exponent, a negative base to a fractional one, counted
    over the result's elements (the two broadcast)."""
    if base is None or exponent is None or base.is_complex() or exponent.is_complex():
        return None
    if not bool(torch.isfinite(exponent).all()):
        return None
    base, exponent = torch.broadcast_tensors(base, exponent)
    n = count((base == 0) & (exponent < 0))
    if n:
        return f"pow of 0 to negative exponents: at {elements_of(n, base)} of the result `self` is 0 and `exponent` < 0"
    if exponent.is_floating_point():
        n = count((base < 0) & (exponent != exponent.round()))
        if n:
            return (f"pow of negative values to fractional exponents: at {elements_of(n, base)} of the result "
                    "`self` is < 0 and `exponent` is not a whole number")
    return None if bool((exponent < 0).any()) else overflow("pow")(args, outputs)


def overflow(name: str, smallest: tuple[str, ...] = ()) -> Callable:
    """Finite operands whose sum, difference, product, power or quotient passes the largest finite value of
    the result's dtype (a float16 residual stream, ConvNeXt's `(x - u).pow(2)` in float16, scores over a
    temperature of 0.05). Each tensor operand is said by its largest |x|, but those named in `smallest`,
    which overflow the result where they are small (a divisor, a base to a negative exponent), by their
    smallest non-zero |x|."""
    def diagnose_overflow(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        if not outputs or not outputs[0].is_floating_point():
            return None
        out = outputs[0]
        operands = []
        for key in ("self", "other", "exponent"):
            value = args.get(key)
            t = tensor_arg(args, key)
            if t is not None and not t.is_complex() and t.numel():
                if not bool(torch.isfinite(t).all()):
                    return None  # an infinity it was given: no overflow (0 * inf, inf - inf: inf_arithmetic)
                magnitude = _smallest_magnitude(t) if key in smallest else finite_absmax(t)
                if magnitude is not None:
                    operands.append(f"`{key}` {'min' if key in smallest else 'max'} |x| {magnitude:.6g}")
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                operands.append(f"`{key}` {value:.6g}")
        inf = count(torch.isinf(out))
        if not inf or not operands:
            return None
        return (f"{out.dtype} overflow in {name}: {', '.join(operands)} give a result past "
                f"{torch.finfo(out.dtype).max:.6g}, the most {out.dtype} holds ({elements_of(inf, out)} are ±inf)")

    return diagnose_overflow


_QUOTIENT_OVERFLOW = overflow("div", smallest=("other",))  # a divisor tiny but not zero
_RECIPROCAL_OVERFLOW = overflow("1/x", smallest=("self",))  # 1/x of a subnormal


def inf_arithmetic(name: str) -> Callable:
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
        n = count(bad)
        return f"{what} at {elements_of(n, a)}: infinities it was given (a mask's, an input's) meet" if n else None

    return diagnose_inf_arithmetic


def xlogy_at_zero(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    """xlogy(x, y) is -inf where y is 0 and x is not (torch.distributions' Beta.log_prob at 0,
    pytorch/pytorch#92260)."""
    x, y = args.get("self"), args.get("other")
    if not isinstance(y, torch.Tensor) or y.is_complex():
        return None
    x, y = torch.broadcast_tensors(torch.as_tensor(x, dtype=y.dtype), y)
    n = count((y == 0) & (x != 0))
    return f"x * log(y) at y = 0 with x != 0: log(0) is -inf at {elements_of(n, y)}" if n else None


def exp_overflow(log_of_base: float) -> Callable:
    def diagnose_exp(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
        x = tensor_arg(args, "self")
        if x is None or not x.is_floating_point() or not outputs:
            return None
        limit = math.log(torch.finfo(outputs[0].dtype).max) / log_of_base
        largest = finite_min_max(x)[1]
        if largest is None or largest <= limit:
            return None
        return (f"exp overflow: the largest input {largest:.6g} exceeds "
                f"{limit:.6g}, the largest whose exp {outputs[0].dtype} holds")

    return diagnose_exp


# (matmul, linear and einsum reach ATen as these)
MATMUL_INPUTS = {"mm": ("self", "mat2"), "bmm": ("self", "mat2"), "addmm": ("mat1", "mat2"),
                  "baddbmm": ("batch1", "batch2")}


def matmul_overflow(args: Args, outputs: list[torch.Tensor], packet: str) -> Optional[str]:
    if not outputs or not outputs[0].is_floating_point():
        return None
    a, b = (tensor_arg(args, n) for n in MATMUL_INPUTS[packet])
    if a is None or b is None or not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return None  # a non-finite input (inf * 0) is no overflow: the finding names that input
    limit = torch.finfo(outputs[0].dtype).max
    a_max, b_max = a.abs().max().item(), b.abs().max().item()
    return (f"{outputs[0].dtype} overflow in a matmul: the inputs' max |x| are {a_max:.6g} and {b_max:.6g} "
            f"over {a.shape[-1]} terms, while {outputs[0].dtype} holds at most {limit:.6g}")


def cast_overflow(args: Args, outputs: list[torch.Tensor]) -> Optional[str]:
    x = tensor_arg(args, "self")
    if x is None or not outputs or not outputs[0].is_floating_point() or not x.is_floating_point():
        return None
    limit = torch.finfo(outputs[0].dtype).max
    largest = x.abs().max().item()
    if largest <= limit:
        return None
    return f"cast overflow: the largest |x| {largest:.6g} exceeds {limit:.6g}, the most {outputs[0].dtype} holds"
