"""The TorchDispatchMode under `locate`: checks each op's outputs, records who wrote them, and hands
an op whose outputs hold NaN/inf to `examine`."""

from __future__ import annotations

import itertools
import sys
import threading
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._stack import ENGINE_RUN, frames_up
from ..recompute import recomputation_in
from .examine import examine, root_finding
from .findings import LocateFinding, Producer
from .node_verdict import NodeVerdicts
from .off_path import OffPath, OffPathFindings
from .provenance import Provenance
from .schema import _named_args, _op_info, _OpInfo
from .source import backward_lines, forward_source, user_frame
from .values import _any_nonfinite, _any_nonfinite_values, _tensors_in, _values

if TYPE_CHECKING:
    from .region import Locate

try:
    from torch.nested._internal.nested_tensor import NestedTensor as _JAGGED
except ImportError:  # an older torch: no jagged layout
    _JAGGED = ()

try:
    from torch._subclasses.fake_tensor import FakeTensor as _FAKE
except ImportError:
    _FAKE = ()

_READ_TO_HOST = torch.ops.aten._local_scalar_dense.default
_ONES_LIKE = torch.ops.aten.ones_like.default
_FUNCTORCH_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)
_MAKE_GRADS = getattr(getattr(torch.autograd, "_make_grads", None), "__code__", None)

# NOTE: [what locate reports]
# Every ATen op that runs under locate (forward ops after autograd's composite decompositions, and the
# ops the autograd engine runs for backward nodes) is checked with one fused any_nonfinite over its
# floating outputs (a nested tensor's values); views, in-place view ops and uninitialized outputs
# (empty) are skipped, since their values are checked where they were made. Only when an output holds
# NaN/inf are the inputs counted, and the first rule that fits says what the op is:
#   - producer: an output holds inf and every input (tensors and numbers) is finite, or an output holds
#     NaN and no input holds NaN (inf - inf, 0 * inf, softmax of a fully masked row).
#   - scalar: a number argument made it: a NaN number and an output NaN where no tensor input held
#     NaN (x * nan, full(..., nan)); or an infinite one, outside the masking ops (NOTE: [masking ops]),
#     and an output inf where no tensor input held inf, or NaN where none held NaN (x + inf, x * inf).
#   - input: an op consumes NaN that came from outside locate: dirty data, a NaN parameter. Infinities
#     from outside are not reported: additive -inf attention masks are built before training.
#   - otherwise the op propagates values already reported (or allowed), and says nothing; so does any op
#     whose non-finite inputs descend from a finding (NOTE: [producer or propagation]).
# In backward, a producer or scalar finding waits for its node's verdict (NOTE: [masked inside a node]).
# The inputs of an in-place op are its arguments before the op: those it reads and writes are cloned
# before it runs (out= arguments and self of copy_/fill_ are written only, and are outputs).
# Provenance: each checked op's outputs' storages record the op and its user line, so an input is
# traced to the op that last wrote its storage (see NOTE: [provenance on storages]).

# NOTE: [producer or propagation]
# A record carries `tainted`: the storage's non-finite values descend from a finding (this op was one,
# or it read tainted non-finite values; NaN reported as `input` taints too). inf * 0 or inf - inf on a
# tainted inf is the same fault again, not a new producer, in action="record" as in "raise". Allowed
# infinities (masking ops, tensors from outside) are not tainted: the NaN they make is still a finding.


class _LocateMode(TorchDispatchMode):
    def __init__(self, owner: Locate):
        super().__init__()
        self.owner = owner
        self.provenance = Provenance()
        self.nodes = NodeVerdicts(_any_nonfinite_values, self._node_returned_nonfinite,
                                  lambda item: owner.masked.append(item[0]))
        self.off_path = OffPathFindings(lambda item: owner._report(*item), lambda item: owner.masked.append(item[0]))
        # Backward findings held until their backward pass ends (NOTE: [a backward finding masked downstream]).
        self._held_in_backward: list[OffPath] = []
        self._backward_lock = threading.Lock()
        self._unexplained_root: Optional[LocateFinding] = None  # see NOTE: [a non-finite value backward is called on]
        self._root_waits = False  # an unexplained root whose backward has not begun

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _FAKE and any(issubclass(t, _FAKE) for t in types):
            # Fake tensors hold no values, and hand the op back to the modes: returned NotImplemented, shape
            # inference under FakeTensorMode raised inside a region (a probe, session 44). Run, unchecked.
            return func(*args, **kwargs)
        if _subclass_first(types):
            return NotImplemented
        info = _op_info(func)
        if info.skip:
            return func(*args, **kwargs)
        # Pre-op copies of the arguments the op reads and overwrites.
        before: dict[int, torch.Tensor] = {}
        if info.read_write_args:
            for name, value in _named_args(info, args, kwargs):
                if name in info.read_write_args:
                    for t in _tensors_in(value):
                        if _values(t) is not None:
                            before[id(t)] = t.clone()
        out = func(*args, **kwargs)
        if func is _ONES_LIKE and _implicit_gradient():
            self._backward_root(args[0])

        raw, outputs = _outputs(info, out, args, kwargs)
        unreturned = _unreturned_writes(info, args, kwargs, raw)
        if not self.off_path.graph_seen:
            self.off_path.saw(_on_path(args, kwargs))
        if not outputs:
            if func is _READ_TO_HOST:  # a held finding's value read to the host (NOTE: [off the gradient path])
                self._matters([self.provenance.tainted(t) for t in _tensors_in(args)])
            return out
        node = torch._C._current_autograd_node()
        if self._root_waits and node is not None:  # the backward of an unexplained root has begun
            self._root_waits = False
            self._queue_backward_end()
        if node is None:
            producer = Producer(info.name, "forward", None, user_frame())
        elif recomputation_in(node) is not None:  # checkpointing re-runs a forward op: its line is the user's
            producer = Producer(info.name, "recompute", None, user_frame())
        else:  # a backward op's line is its node's forward line; the frame walk waits for a finding
            producer = Producer(info.name, "backward", type(node).__name__, forward_source(node))
        judged_raw, judged = _judged(info, out, raw, outputs)
        # What it wrote without returning it is judged as its output (NOTE: [writes an op does not return]).
        judged_raw, judged = judged_raw + [t for _, t, _ in unreturned], judged + [v for _, _, v in unreturned]
        nonfinite = _any_nonfinite(judged)
        tainted = False
        if nonfinite:
            on_path = _on_path(args, kwargs)
            code, source = backward_lines() if producer.phase == "backward" else (None, producer.source)
            finding, tainted = examine(self.provenance, self.owner._dump_path_for_next() is not None, info,
                                       _named_args(info, args, kwargs), before, judged_raw, judged, producer, source,
                                       code, tuple(name for name, _, _ in unreturned))
            if finding is None:
                if isinstance(tainted, OffPath) and on_path:
                    self._matters([tainted])  # it enters the gradient path
                    tainted = True
            elif self.off_path.holds(finding[0].kind, producer.phase, on_path):
                tainted = self.off_path.hold(finding)
            # A backward node's inner producer is judged by the gradients the node returns.
            elif not (producer.phase == "backward" and finding[0].kind != "input"
                      and self.nodes.defer(node, finding)):
                self.owner._report(*finding)
            if isinstance(tainted, OffPath):
                tainted.follow(outputs)
        if info.read_write_args or info.out_args:
            for t in outputs:
                self.provenance.record_write(t, producer, nonfinite, tainted)
            for _, _, values in unreturned:  # a sparse tensor's storage is its values'
                self.provenance.record_write(values, producer, _any_nonfinite([values]), tainted)
        else:
            self.provenance.record_outputs(outputs, producer, tainted)
        return out

    # NOTE: [a backward finding masked downstream]
    # A node that returns a non-finite gradient confirms its finding, but a later node may still mask it:
    # acos(clamp(cos, -1, 1)) with a cosine rounded past 1 (pytorch/pytorch#8069) returns -inf from
    # AcosBackward0, and ClampBackward0 zeroes the gradient where the clamp was active: every parameter's
    # gradient is finite, and locate stopped a healthy step (as in ArcFace's sqrt(1 - cos^2) at cos = 1; a
    # probe, session 45). So a confirmed finding is held as a forward one off the gradient path is: the
    # gradients it returned are tainted with it, the ops that carry them on follow it, and when the
    # backward pass ends (a callback queued on the engine) it is reported if a value it tainted is still
    # alive (a parameter's .grad, autograd.grad's result, a retained grad) and noted as masked otherwise.
    # A nested backward (a reentrant checkpoint's) leaves its findings to the outermost one's end (a review,
    # session 45: its own end came before the outer clamp masked them), a backward that raised to the next.
    # A value it tainted read to the host, or by an op on a gradient path (create_graph), reports it at once;
    # so does a gradient of torch.func's transforms (vmap, grad), a wrapper with no storage to follow.
    def _node_returned_nonfinite(self, item: tuple, gradients: list[torch.Tensor]) -> None:
        if any(_FUNCTORCH_WRAPPED(g) for g in gradients):  # torch.func's: no storage of their own to follow
            self.owner._report(*item)
            return
        held = self.off_path.hold(item)
        held.follow(gradients)
        for g in gradients:
            self.provenance.retaint(g, held)
        with self._backward_lock:
            self._held_in_backward.append(held)
        self._queue_backward_end()

    def _queue_backward_end(self) -> None:
        """Queues _backward_ended on the running backward pass. On the outermost one only: a nested one (a
        reentrant checkpoint's, a custom backward's autograd.grad) ends while what it returns is still
        alive, before the outer nodes mask it; its findings wait for the next outermost end, or the
        region's. Once per finding: a backward that raised never runs its callbacks, and a later one must
        still queue its own."""
        if sum(frame.f_code is ENGINE_RUN for frame in frames_up(sys._getframe(1))) <= 1:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        """A backward pass ended: its held findings are reported or noted, and, with no finding in the
        region, an unexplained root is reported now, before an optimizer step, not at the region's end."""
        with self._backward_lock:
            held, self._held_in_backward = self._held_in_backward, []
        for h in held:
            self.off_path.settle(h, report=h.alive())
        self.settle_root()

    def settle_root(self) -> None:
        """Reports the unexplained root, if one is kept and the region has no finding; lets go of it."""
        root, self._unexplained_root = self._unexplained_root, None
        if root is not None and not self.owner.findings:
            self.owner._report(root, None)

    def _backward_root(self, root: torch.Tensor) -> None:
        """backward() was called on `root` (its implicit gradient is being made): the first non-finite root
        that no finding explains is kept, reported when its backward pass ends (or the region does)
        without a finding (NOTE: [a non-finite value backward is called on])."""
        values = _values(root)
        if values is None or root._base is not None or not _any_nonfinite([values]):
            return  # a view's element is no loss (autograd.functional.jacobian takes each row's)
        taint = self.provenance.tainted(root)
        if isinstance(taint, OffPath):
            self._matters([taint])
        elif not taint and self._unexplained_root is None:
            self._unexplained_root = root_finding(self.provenance, root)
            self._root_waits = True  # settled when its backward ends (or the region, if it never runs)

    def _matters(self, taints: list) -> None:
        for taint in taints:
            if isinstance(taint, OffPath):
                self.off_path.matters(taint)


def _implicit_gradient() -> bool:
    """Whether the ones_like running now is autograd's implicit gradient of a scalar backward() was called
    on (torch.autograd._make_grads, a few frames up)."""
    return _MAKE_GRADS is not None and any(frame.f_code is _MAKE_GRADS
                                           for frame in itertools.islice(frames_up(sys._getframe(1)), 8))


def _on_path(args: tuple, kwargs: dict) -> bool:
    """Whether an op is on the gradient path: grad mode on and a tensor argument requires grad (below
    autograd its outputs do not yet: NOTE: [off the gradient path])."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in _tensors_in((args, kwargs)))


def _subclass_first(types: tuple) -> bool:
    """Whether an op is handed to a tensor subclass among its arguments first (the mode returns
    NotImplemented): a DTensor, a wrapper or a MaskedTensor runs it as ops on the plain tensors it holds,
    which come back through the mode and are checked there (read as the subclass, its results were of
    its class, which the kernels refused: a healthy MaskedTensor op raised under locate). Jagged nested
    tensors are read here, through their values (_values)."""
    return any(t is not torch.Tensor and t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
               and not issubclass(t, _JAGGED) for t in types)


# NOTE: [writes an op does not return]
# A training batch norm writes its running statistics in place without returning them. Left
# unrecorded, the NaN a dirty batch put into them was taken for data from outside where backward's
# native_batch_norm_backward read them, a false `input` finding per BatchNorm (nine on a ResNet-18 with
# one NaN weight); left unjudged, a float16 batch whose variance passed 65504 made running_var +inf
# with every output finite, and locate found nothing (pytorch/pytorch#115500; a probe, session 51). So
# they are the op's outputs too, named by their arguments.
def _unreturned_writes(info: _OpInfo, args: tuple, kwargs: dict,
                       raw: list) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The arguments an op writes without returning them, as (argument name, tensor, its values)."""
    if not info.read_write_args or not raw:
        return []
    returned = {id(t) for t in raw}
    return [(name, t, values) for name, value in _named_args(info, args, kwargs) if name in info.read_write_args
            for t in _tensors_in(value) if id(t) not in returned for values in (_values(t),) if values is not None]


def _judged(info: _OpInfo, out: Any, raw: list, outputs: list) -> tuple[list, list[torch.Tensor]]:
    """The outputs an op is judged by: all of them but its workspace (NOTE: [workspace outputs])."""
    if not info.workspace or not isinstance(out, tuple):
        return raw, outputs
    workspace = {id(t) for k, t in enumerate(out) if k in info.workspace}
    kept = [k for k, t in enumerate(raw) if id(t) not in workspace]
    return [raw[k] for k in kept], [outputs[k] for k in kept]


def _outputs(info: _OpInfo, out: Any, args: tuple, kwargs: dict) -> tuple[list, list[torch.Tensor]]:
    """The op's outputs that locate checks: as returned (nested tensors whole), and their values."""
    if isinstance(out, torch.Tensor):
        values = _values(out)
        return ([out], [values]) if values is not None else ([], [])
    pairs = [(t, v) for t in _tensors_in(out) for v in (_values(t),) if v is not None]
    if not pairs and (info.read_write_args or info.out_args):
        # In-place ops that return nothing (_foreach_*_) changed their written arguments.
        pairs = [(t, v) for name, value in _named_args(info, args, kwargs)
                 if name in info.read_write_args or name in info.out_args
                 for t in _tensors_in(value) for v in (_values(t),) if v is not None]
    return [t for t, _ in pairs], [v for _, v in pairs]

