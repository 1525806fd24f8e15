"""The floating-point module buffers a training forward may write (BatchNorm's running statistics, an
average kept in a buffer), checked after each training forward of the model (see NOTE: [Buffers a
forward writes])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from .. import _C

# NOTE: [Buffers a forward writes]
# BatchNorm's training forward updates running_mean and running_var in place while its output, made
# from the batch's own statistics, stays finite: a float16 batch whose variance passes 65504 left
# running_var +inf, the watch silent, and model.eval() then output the bias alone (pytorch/pytorch#115500;
# a probe, session 51). Those writes bump no version counter (pytorch/pytorch#13402), so which buffers
# a forward wrote is not known without reading them: after each training-mode forward of the model
# every floating-point buffer of its modules is read, in one record of phase "buffer" whose rows are
# named by the buffers (its slot's site is the tuple of their names, as the pass's parameter rows are
# named: "buffer 1.running_var after the forward"); a skip puts such buffers back as for any bad step
# (NOTE: [What a step writes besides the update]). One record, not one per buffer: on ResNet-18's 40
# buffers a record each cost ~380 us of host time per forward, one ~30 us. Buffers that already held
# NaN or inf when they were listed (a float causal mask's -inf, a quantization observer's +inf/-inf
# bounds before its first forward) are intended, not checked; so are those `ignore` names. An
# evaluation forward (eval mode) writes none. Listing reads the buffers once: at watch(), and at the
# first step after the model gained a module or buffer (NOTE: [A model changed after watch()]). The reads
# follow the `params` check (the model's state).


def _checked(t: Any) -> bool:
    """A plain dense floating-point (or complex) tensor: what the recorder reads."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and not t.is_meta
            and (t.is_floating_point() or t.is_complex()))


class WrittenBuffers:
    """The model's floating-point buffers as checked after its training forwards (see NOTE: [Buffers a
    forward writes]): their names, and the buffers read in one loop (`_C.BufferSlots`)."""

    def __init__(self, model: torch.nn.Module, ignored: Callable[[str], bool]):
        """Args:
            model: the watched model.
            ignored: whether `ignore` names a buffer (by its qualified name)."""
        self._model = model
        self._ignored = ignored
        self._names: tuple[str, ...] = ()
        self._slots: Optional[Any] = None

    def relist(self) -> None:
        """Lists the buffers as the model's modules hold them now, leaving out those that hold NaN or inf
        now (read once) and those `ignore` names. A lazy module's buffer, uninitialized until its first
        forward, is listed and read once it is a tensor."""
        listed = [(module, name, f"{prefix}.{name}" if prefix else name, buffer)
                  for prefix, module in self._model.named_modules() if not isinstance(module, torch.jit.ScriptModule)
                  for name, buffer in module._buffers.items()
                  if _checked(buffer) or isinstance(buffer, torch.nn.parameter.UninitializedBuffer)]
        kept = [i for i, (_, _, full, _) in enumerate(listed) if not self._ignored(full)]
        read = [i for i in kept if _checked(listed[i][3])]
        if read:
            buffers = [listed[i][3] for i in read]
            counts, _, _ = _C.stats_on(buffers, buffers[0].device)
            intended = {i for i, row in zip(read, counts.tolist()) if any(row)}
            kept = [i for i in kept if i not in intended]
        self._names = tuple(listed[i][2] for i in kept)
        self._slots = _C.BufferSlots([listed[i][0] for i in kept], [listed[i][1] for i in kept]) if kept else None

    def record(self, record: Callable[[str, Any, int, list], None]) -> None:
        """Records the listed buffers as the modules hold them now (one re-assigned to something the
        recorder does not read, or still uninitialized, left out), through the watch's `_record`."""
        if self._slots is None:
            return
        buffers = self._slots.state()[0]
        tensors = _C.plain_floating_tensors(buffers)  # all of them, as almost always: the names as listed
        if tensors is not None and len(tensors) == len(self._names):
            record("buffer", self._names, 1, tensors)
            return
        kept = [(name, buffer) for name, buffer in zip(self._names, buffers) if _checked(buffer)]
        if kept:
            record("buffer", tuple(name for name, _ in kept), 1, [buffer for _, buffer in kept])
