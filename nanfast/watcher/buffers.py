"""The floating-point module buffers a training forward may write (BatchNorm's running statistics, an
average kept in a buffer), checked after each training forward of the model (see NOTE: [Buffers a
forward writes])."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Optional

import torch

from .. import _C
from ..intended import is_mask_name
from .restore import buffer_slots

# NOTE: [Buffers a forward writes]
# BatchNorm's training forward updates running_mean and running_var in place while its output, made
# from the batch's own statistics, stays finite: a float16 batch whose variance passes 65504 left
# running_var +inf, the watch silent, and model.eval() then output the bias alone (pytorch/pytorch#115500;
# a probe, session 51). Those writes bump no version counter (pytorch/pytorch#13402), so which buffers
# a forward wrote is not known without reading them: after each forward in which a module holding
# buffers is in training mode (the model, or a BatchNorm adapted under an eval-mode model), every
# floating-point buffer of the model's modules is read, in one record of phase "buffer" whose rows are
# named by the buffers (its slot's site is the tuple of their names, as the pass's parameter rows are
# named: "buffer 1.running_var after the forward"); a skip puts such buffers back as for any bad step
# (NOTE: [What a step writes besides the update]). A compiled forward runs no hook: its buffers are
# read at the step's end. One record, not one per buffer: on ResNet-18's 40 buffers a record each cost
# ~380 us of host time per forward, one ~30 us.
# Intended infinities: a buffer that held NaN or inf when first listed (a float causal mask's -inf, a
# quantization observer's +inf/-inf bounds before its first forward) is not checked, judged once per
# name (a buffer a bad step made +inf stays checked when the model gains a module and the buffers are
# listed again); a buffer named as a mask (NOTE: [Additive masks]) may hold -inf whenever, as a mask
# cached in a buffer by the first forward (an empty placeholder before it) does; `ignore` names others.
# The slots are listed at watch() and at the first step after the model gained a module or buffer
# (NOTE: [A model changed after watch()]), a slot empty then (None, a lazy module's uninitialized
# buffer) included: it is read once it holds a tensor. The reads follow the `params` check.


def _checked(t: Any) -> bool:
    """A plain dense floating-point (or complex) tensor: what the recorder reads."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and not t.is_meta
            and (t.is_floating_point() or t.is_complex()))


class WrittenBuffers:
    """The model's floating-point buffers as checked after its training forwards (see NOTE: [Buffers a
    forward writes]): their slots, read in one loop (`_C.BufferSlots`), and the names of the rows the
    last record made."""

    def __init__(self, model: torch.nn.Module, ignored: Callable[[str], bool]):
        """Args:
            model: the watched model.
            ignored: whether `ignore` names a buffer (by its qualified name)."""
        self._model = model
        self._ignored = ignored
        self._intended: dict[str, bool] = {}  # name -> held NaN/inf when first listed (judged once)
        self._names: tuple[str, ...] = ()  # each slot's
        self._owners: tuple[torch.nn.Module, ...] = ()  # the modules holding the slots, each once
        self._slots: Optional[Any] = None
        self._seen: list = []  # each slot's tensor at the last record
        self._rows: tuple = ((), (), ())  # that record's row names, mask rows, slot of each row

    def relist(self) -> None:
        """Lists the model's buffer slots as its modules hold them now, but those `ignore` names and those
        holding NaN or inf when first listed (read once)."""
        listed = [(module, name, full, module._buffers[name]) for module, name, full in buffer_slots(self._model)]
        kept = [entry for entry in listed if not self._ignored(entry[2])]
        new = [entry for entry in kept if entry[2] not in self._intended and _checked(entry[3])]
        if new:
            counts, _, _ = _C.stats_on([entry[3] for entry in new], new[0][3].device)
            self._intended.update((entry[2], any(row)) for entry, row in zip(new, counts.tolist()))
        kept = [entry for entry in kept if not self._intended.get(entry[2], False)]
        self._names = tuple(entry[2] for entry in kept)
        self._owners = tuple({id(entry[0]): entry[0] for entry in kept}.values())
        self._slots = _C.BufferSlots([entry[0] for entry in kept], [entry[1] for entry in kept]) if kept else None
        self._seen = []

    def record(self, record: Callable[..., None]) -> None:
        """Records the slots' buffers as the modules hold them now (those empty, or holding what the
        recorder does not read, left out) through the watch's `_record`, if a module holding them is in
        training mode."""
        if self._slots is None or not (self._model.training or any(m.training for m in self._owners)):
            return
        buffers = self._slots.state()[0]
        if len(buffers) != len(self._seen) or not all(map(operator.is_, buffers, self._seen)):
            self._seen = buffers  # a slot re-assigned since the last record (or none yet): its rows again
            slots = [i for i, buffer in enumerate(buffers) if _checked(buffer)]
            names = tuple(self._names[i] for i in slots)
            self._rows = (names, tuple(row for row, name in enumerate(names) if is_mask_name(name)), slots)
        names, masks, slots = self._rows
        if names:
            record("buffer", names, 1, buffers if len(slots) == len(buffers) else [buffers[i] for i in slots], masks)
