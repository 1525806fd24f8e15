""".safetensors files, read one tensor at a time (safetensors' own reader: no pickle in them)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from . import NotRead, Unreadable, first_sentence


def safetensors_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A .safetensors file's (name, tensor) pairs, read one at a time."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise Unreadable("reading .safetensors needs the safetensors package "
                         "(pip install 'nanfast[safetensors]')") from None
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            try:
                tensor = f.get_tensor(name)
            except Exception as e:  # noqa: BLE001  (one entry of a dtype torch lacks: the others are still read)
                yield name, NotRead(f"it could not be read ({type(e).__name__}: {first_sentence(e)})")
                continue
            yield name, tensor
