"""Undoing a step: snapshots the module buffers a step's forward may write (BatchNorm's running
statistics and its batch count) and restores them when the watch skips the step or raises before it,
so that a bad batch leaves no trace in the model. See NOTE: [What a step writes besides the update]."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Optional

import torch

from .. import _C


class Twins:
    """Copies of a fixed list of tensors, packed in one flat tensor per (device, dtype) of the originals:
    saved and copied back with one `_C.copy_tensors` per group (NOTE: [Small copies without the
    dispatcher]), or copied back where a device-side flag is set. The copies lie next to the originals,
    or on `device` (a CUDA tensor's copy in host memory is pinned, so that both copies run without
    blocking the host, ordered on the stream)."""

    def __init__(self, tensors: Sequence[torch.Tensor], device: Optional[torch.device] = None):
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault((t.device, t.dtype), []).append(i)
        self.kinds = [(t.shape, t.device, t.dtype) for t in tensors]
        self.groups: list[tuple[list[int], torch.Tensor, list[torch.Tensor]]] = []
        for (source, dtype), indices in groups.items():
            target = source if device is None else device
            flat = torch.empty(sum(tensors[i].numel() for i in indices), device=target, dtype=dtype,
                               pin_memory=target.type == "cpu" and source.type == "cuda")
            views, offset = [], 0
            for i in indices:
                n = tensors[i].numel()
                views.append(flat[offset:offset + n].view(tensors[i].shape))
                offset += n
            self.groups.append((indices, flat, views))
        self.nbytes = sum(flat.numel() * flat.element_size() for _, flat, _ in self.groups)

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        return self.kinds == [(t.shape, t.device, t.dtype) for t in tensors]

    def copies(self) -> list[torch.Tensor]:
        """The saved copy of each tensor, in the order of the tensors given."""
        found: list[torch.Tensor] = [None] * len(self.kinds)  # type: ignore[list-item]
        for indices, _, views in self.groups:
            for i, view in zip(indices, views):
                found[i] = view
        return found

    def save(self, tensors: Sequence[torch.Tensor]) -> None:
        for indices, _, views in self.groups:
            _C.copy_tensors(views, [tensors[i] for i in indices], non_blocking=True)

    def restore(self, tensors: Sequence[torch.Tensor], where: Optional[torch.Tensor] = None) -> None:
        """Copies the saved values back; with `where` (a bool scalar on the device), only if it is set:
        no host read."""
        for indices, flat, views in self.groups:
            targets = [tensors[i] for i in indices]
            if where is not None:
                with torch.no_grad():  # the targets may be parameters
                    current = torch.cat([t.reshape(-1) for t in targets])
                    torch.where(where.to(flat.device), flat, current, out=flat)
            _C.copy_tensors(targets, views, non_blocking=True)


def _same_kind(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and _copyable(a) and _copyable(b))


def _copyable(t: Optional[torch.Tensor]) -> bool:
    """A plain dense tensor (a DTensor or other subclass would need its own twin: left out, so a change
    to it shows as `missed`) that can be written in place: one whose elements share memory (a buffer made
    by expand()) cannot, so no step changes it, and copying it back raised out of a skip (a probe,
    session 51)."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type != "meta" and not t.is_inference()
            and torch._debug_has_internal_overlap(t) != 1)


# NOTE: [What a step writes besides the update]
# A skipped step must leave the model as if its batch never came, but its forward has already run:
# BatchNorm's running statistics and batch count (and any buffer a module updates as it goes) hold the
# bad batch, and an Embedding or EmbeddingBag with max_norm has renormalised, in place, the rows of its
# weight the batch looked up (F.embedding's embedding_renorm_; the renormalised rows stayed, 1.0 where a
# run without the batch had 6.2: a probe, session 43). So each step's start (its first forward) notes
# the buffers and copies those that can change, and the weights that such an Embedding rewrites (all of
# each: the rows a batch will look up are not known before its forward); a skip, or a raise before
# the optimizer step, copies them back. Parameters written in a forward by any other module are not
# followed.
def rewritten_in_forward(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` whose forward writes their own weight in place: Embedding and EmbeddingBag
    with max_norm (see NOTE: [What a step writes besides the update]), their weight a plain dense
    parameter (a sharded one would need a twin of its own)."""
    return [m for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
            and m.max_norm is not None and type(m.weight) is torch.nn.Parameter and _copyable(m.weight.data)]


def buffer_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str]]:
    """Every buffer slot of `model`'s eager modules (a TorchScript submodule's buffers are no dict's
    entries) as (module, name in it, qualified name), an empty one (None) included."""
    return [(module, name, f"{prefix}.{name}" if prefix else name)
            for prefix, module in model.named_modules() if not isinstance(module, torch.jit.ScriptModule)
            for name in module._buffers]


# Buffers of at most this many bytes are copied at every step whatever their dtype (see BufferUndo).
_ALWAYS_COPIED_BYTES = 65536


class BufferUndo:
    """Remembers, at the start of each step, the module buffers of a model so that `restore()` can put
    them back as they were (see NOTE: [What a step writes besides the update]).

    Floating-point buffers, and any of at most _ALWAYS_COPIED_BYTES, are copied at every step: kernels
    write some without bumping their version counters (BatchNorm's running statistics,
    pytorch/pytorch#13402; QAT's fused_moving_avg_obs_fake_quant its int32 zero_point, left at the bad
    batch's value by a skip: a probe, session 44), so only their values could tell. Larger ones of other
    dtypes (masks, lookup tables) are copied once some step has changed them (version counter or
    re-assignment), all on the first step. A buffer a step resized in place (a per-channel observer's
    min_val, empty until its first forward) is resized back before its values are. Buffers are listed
    as (module, name) at construction and by `relist()` (the watch calls it at a step's start once the
    model gained a module or buffer: see NOTE: [A model changed after watch()]); a buffer re-assigned
    later is followed by name.

    NOTE: [Buffers swapped in for one forward]
    torch.func.functional_call(model, (params, buffers), x) installs the caller's buffers in the model
    for the forward and puts the model's own back after it: the watch's step start (the model's forward
    pre-hook) notes the caller's, and at the step's end every such slot looks re-assigned. Put "back", a
    skip made the caller's tensors the model's own buffers for the rest of the run (a probe, session 44).
    So a slot that at a step's end holds the tensor it held at the end of the step before is not taken
    as re-assigned by the step: the step's writes went to the tensor it noted, whose values a skip puts
    back, and the slot is left as it is."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self.relist()
        self._open = False
        self._closed_begun = False  # the step that closed last had begun (its slots' values are known)
        self._restorable = False
        self.missed: list[str] = []  # buffers the step changed in place with no copy to restore them from
        self.host_only = False  # the step re-assigned a buffer to a different kind of tensor (or None)

    def relist(self) -> None:
        """Lists the model's buffers as its modules hold them now, none of them known to change yet (so
        the next step copies them all). Between steps only."""
        # A TorchScript submodule's buffers are no dict's entries (watch() raised on such a model from
        # inside this walk: a probe, session 47): each step copies them all into twins (its batch norm
        # updates the running statistics without a version bump), as the renormalised weights are, and a
        # restore copies them back in place; one the forward re-assigned, or not a plain dense tensor, is
        # `missed`.
        self.scripted = [(f"{prefix}.{name}" if prefix else name, module, name)
                         for prefix, module in self._model.named_modules() if isinstance(module, torch.jit.ScriptModule)
                         for name in module._buffers.keys()]
        self._scripted_found: list[Optional[torch.Tensor]] = []  # each as the step found it
        self._scripted_twins: Optional[Twins] = None
        self._slots = buffer_slots(self._model)
        # The walks over them at each step's start and end, in C++ (see NOTE: [Buffers read in one loop]).
        self._buffers = _C.BufferSlots([module for module, _, _ in self._slots], [name for _, name, _ in self._slots])
        self._copied: Optional[set[int]] = None  # slots seen changing; None: all (until the first step ends)
        self._tensors: list[Optional[torch.Tensor]] = []  # each slot's tensor at the step start
        # Each slot's tensor at the end of the last step that closed, and of the one before the step now
        # open (see NOTE: [Buffers swapped in for one forward]).
        self._ends: list[Optional[torch.Tensor]] = self._buffers.state()[0]
        self._prior = self._ends
        self._saved_shapes: dict[int, torch.Size] = {}  # each copied slot's shape when its twin was made
        self._versions: list[int] = []  # and its version counter (-1: None or an inference tensor: not tracked)
        self._saved: list[int] = []  # the slots copied into the twins
        self._twins: Optional[Twins] = None
        self._replan = True  # the set of copied slots changed since the twins were made
        self._renorming = rewritten_in_forward(self._model)  # whose weights each step copies
        self._weights: list[torch.Tensor] = []  # their weights at the step's start
        self._weight_twins: Optional[Twins] = None

    @property
    def bytes_per_step(self) -> int:
        """What each step copies."""
        return sum(twins.nbytes for twins in (self._twins, self._weight_twins) if twins is not None)

    def begin(self) -> None:
        """Step start (the step's first forward): notes every buffer with its version counter (free, no
        sync) and copies the floating-point ones and those seen changing, and the weights of the
        modules that rewrite them in their forward."""
        self.missed = []
        if self._renorming:
            self._weights = [m.weight for m in self._renorming]
            if self._weight_twins is None or not self._weight_twins.fits(self._weights):
                self._weight_twins = Twins(self._weights)
            self._weight_twins.save(self._weights)
            self._open = self._restorable = True
        if self.scripted:
            self._scripted_found = [getattr(module, name) for _, module, name in self.scripted]
            kept = [b for b in self._scripted_found if _copyable(b)]
            if self._scripted_twins is None or not self._scripted_twins.fits(kept):
                self._scripted_twins = Twins(kept)
            self._scripted_twins.save(kept)
            self._open = self._restorable = True
        if not self._slots:
            return
        tensors, versions = self._buffers.state()
        if self._replan or not all(map(operator.is_, tensors, self._tensors)):
            self._plan(tensors)
        self._tensors, self._versions = tensors, versions
        self._prior = self._ends
        if self._twins is not None:
            self._twins.save([tensors[i] for i in self._saved])
        self._open = self._restorable = True
        self.host_only = False

    def _plan(self, tensors: list[Optional[torch.Tensor]]) -> None:
        """Which slots to copy, and the twins to copy them into (when the buffers or that choice change)."""
        self._replan = False
        copied = self._copied
        self._saved = [i for i, t in enumerate(tensors) if _copyable(t) and (
            copied is None or i in copied or t.is_floating_point() or t.is_complex()
            or t.numel() * t.element_size() <= _ALWAYS_COPIED_BYTES)]
        saved = [tensors[i] for i in self._saved]
        self._saved_shapes = {i: t.shape for i, t in zip(self._saved, saved)}
        if not saved:
            self._twins = None
        elif self._twins is None or not self._twins.fits(saved):
            self._twins = Twins(saved)

    def close(self) -> None:
        """Step end, before its verdict is acted on: learns which buffers the step changed (copied from
        the next step on), and which of them it changed in place with no copy taken (`missed`: a
        non-floating buffer that no earlier step had changed)."""
        self._closed_begun = self._open
        if not self._open:
            return
        self._open = False
        scripted = [full for (full, module, name), was in zip(self.scripted, self._scripted_found)
                    if getattr(module, name) is not was or (was is not None and not _copyable(was))]
        reassigned, in_place = self._buffers.changed(self._tensors, self._versions)
        shapes = self._saved_shapes
        self.missed = [self._slots[i][2] for i in in_place if i not in shapes] + scripted
        # Every copied slot, not those whose version changed: the fused QAT kernel resizes min_val and
        # scale without a bump.
        resized = [i for i, shape in shapes.items() if self._tensors[i].shape != shape]
        self._ends = list(self._tensors) if reassigned else self._tensors
        for i in reassigned:
            self._ends[i] = self._slots[i][0]._buffers.get(self._slots[i][1])
        self.host_only = bool(resized) or any(not _same_kind(self._tensors[i], self._ends[i])
                                              for i in self._stepped(reassigned))
        changed = set(in_place).union(reassigned)
        if resized:
            self._replan = True
        if self._copied is None or not changed <= self._copied:
            self._copied = changed if self._copied is None else self._copied | changed
            self._replan = True

    def restore(self, where: Optional[torch.Tensor] = None) -> list[str]:
        """Puts the buffers back as the step found them: copied ones get their saved values, re-assigned
        ones their earlier tensor. With `where` (a bool scalar on the device), only if it is set, without a
        host read (a re-assigned buffer becomes the selection of the two; not for `host_only`). Does
        nothing outside a step that began and closed, nor twice.

        Returns:
            The names of the buffers the step changed in place that could not be restored (`missed`)."""
        if not self._restorable:
            return []
        self._restorable = False
        if self._weight_twins is not None:
            self._weight_twins.restore(self._weights, where)
        if self._scripted_twins is not None:
            self._scripted_twins.restore([b for b in self._scripted_found if _copyable(b)], where)
        resized = [i for i, shape in self._saved_shapes.items() if self._tensors[i].shape != shape]
        if resized and where is not None:
            if not bool(where):  # a read on the host, as for a step `host_only` (a rare first step)
                return self.missed
            where = None
        with torch.no_grad():
            for i in resized:
                self._tensors[i].resize_(self._saved_shapes[i])
        if self._twins is not None:
            self._twins.restore([self._tensors[i] for i in self._saved], where)
        now = [module._buffers.get(name) for module, name, _ in self._slots]
        for i in self._stepped([i for i, (a, b) in enumerate(zip(now, self._tensors)) if a is not b]):
            module, name, _ = self._slots[i]
            module._buffers[name] = self._tensors[i] if where is None else torch.where(where, self._tensors[i], now[i])
            if self._ends is not self._tensors:
                self._ends[i] = module._buffers[name]
        return self.missed

    def _stepped(self, reassigned: list[int]) -> list[int]:
        """The slots among `reassigned` (holding another tensor than at the step's start) that the step
        re-assigned: not those holding again the tensor they held before it, which a caller swapped out
        for its forward (see NOTE: [Buffers swapped in for one forward])."""
        return [i for i in reassigned if self._slots[i][0]._buffers.get(self._slots[i][1]) is not self._prior[i]]

    def as_found(self) -> Optional[list[tuple[torch.nn.Module, str, torch.Tensor]]]:
        """The plain dense buffers with their values as the step that closed last found them, for a
        snapshot of the model as that step began: (module, name, a tensor holding the value: the copy
        taken at the step's start, or the buffer the step found when no copy was taken, as it did not
        change it in place). Valid until the next step begins.

        Returns:
            The triples in the model's order; None when the values cannot be told (the step began no
            forward, changed a buffer in place with no copy taken: `missed`, or resized one). A slot a
            caller swapped a tensor into for the step's forward gives the model's own buffer, which the
            step did not write (see NOTE: [Buffers swapped in for one forward])."""
        if not self._slots:
            return []
        if (not self._closed_begun or self.missed
                or any(self._tensors[i].shape != shape for i, shape in self._saved_shapes.items())):
            return None
        copies = dict(zip(self._saved, self._twins.copies())) if self._twins is not None else {}
        found = []
        for i, ((module, name, _), t, end) in enumerate(zip(self._slots, self._tensors, self._ends)):
            if end is not t and end is self._prior[i]:
                found.append((module, name, end))
            elif _copyable(t):
                found.append((module, name, copies.get(i, t)))
        return [(module, name, t) for module, name, t in found if _copyable(t)]
