"""What the diagnoses say of tensors: counts and the words around them."""

from __future__ import annotations

from typing import Any, Optional

import torch


Args = dict[str, Any]  # the op's arguments by schema name, tensors as the op read them


def tensor_arg(args: Args, name: str) -> Optional[torch.Tensor]:
    t = args.get(name)
    usable = isinstance(t, torch.Tensor) and t.layout == torch.strided and not (t.is_meta or t.is_nested)
    return t if usable else None


def count(mask: torch.Tensor) -> int:
    return int(mask.sum().item())


def elements_of(n: int, t: torch.Tensor) -> str:
    return f"{n} of {t.numel()} element{'s' if t.numel() != 1 else ''}"


def is_are(n: int) -> str:
    return "is" if n == 1 else "are"


def exact(value: float, t: torch.Tensor) -> str:
    """`value` with the digits that tell apart neighbouring values of `t`'s dtype (1.0000001 is not 1)."""
    return f"{value:.{17 if t.element_size() > 4 else 9}g}"
