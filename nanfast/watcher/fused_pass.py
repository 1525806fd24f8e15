"""The fused pass over every parameter and gradient at the step's end (see NOTE: [Parameters and
gradients in one pass]): their NaN/+inf/-inf counts and norms, from one call."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch

from .. import _C, distributed
from .profile import Profile

# torch.ops.nanfast.stats over tensors on any devices, rows in input order, results on one device; called
# unboxed (see NOTE: [Unboxed entry points]). The hooks are idle under torch.compile, which could not
# trace it.
_stats_on = _C.stats_on


class Pass(NamedTuple):
    """The pass's results: counts, norms and max |x| of the parameters, then of the gradients."""

    param_names: tuple
    grad_names: tuple
    grads: list  # the stored values of the gradients that are set
    counts: torch.Tensor  # int64 [params + grads, 3]
    norm: torch.Tensor
    absmax: torch.Tensor
    n_params: int
    limits: list  # per row, the dtype's largest finite value for headroom (0: not watched); [] if not asked or none is


def parameter_names(model: torch.nn.Module) -> Callable[[], dict]:
    """What _C.ParamGrads asks for its parameters' names whenever its list of parameters changes: id ->
    the model's name for it now. Holds the model weakly (the watch's hooks on it lead back here)."""
    model_ref = weakref.ref(model)

    def names() -> dict:
        model = model_ref()
        return {} if model is None else {id(p): name for name, p in model.named_parameters()}

    return names


def run(gathered: tuple, sharded: bool, device: torch.device, profile: Optional[Profile] = None,
        headroom: bool = False, read_params: bool = True, op: Callable = _stats_on) -> Optional[Pass]:
    """One fused call over the parameters and their gradients; None without parameters.

    Args:
        gathered: ``_C.ParamGrads.gather``'s (parameters in the optimizer's order (or the model's),
            their names, the stored values of the gradients that are set (a sparse one's values, as
            that binding says), those gradients' parameter names).
        sharded: the parameters are DTensors: their local shards are read.
        device: where the results land.
        profile: a profiled watch's totals, which the pass adds to (see NOTE: [Profiling the watch]).
        headroom: give each row's largest finite value, for the overflow headroom (watcher/headroom.py).
        read_params: read the parameters too; False: only their gradients (see NOTE: [Parameters read
            when they add information]); the pass then has no parameter rows (n_params 0).
        op: the call that reads them, as _C.stats_on (a fused watch's recorder.stats_with_deferred
            checks its deferred records in the same call: NOTE: [Fused records])."""
    # NOTE: [Parameters and gradients in one pass]
    # At the read, before the optimizer step, one fused call covers every parameter (as the previous
    # step left it: an optimizer can make NaN out of finite grads; the check of step N's update is
    # read at step N+1, before anything else of that step) and every gradient. The same pass gives
    # w.stats() and w.clip_grad_norm_ their norms.
    params, names, grads, grad_names = gathered
    if not params:
        return None
    if not read_params:
        if not grads:
            return None
        params, names = [], ()
    if sharded:
        params, grads = ([distributed.local_tensor(t) for t in ts] for ts in (params, grads))
    tensors = params + grads
    stats_on = op if profile is None else profile.counted_pass(op)
    counts, norm, absmax = stats_on(tensors, device)  # no graph: the call turns grad mode off itself
    limits = _C.limits_of(tensors) if headroom else []
    return Pass(names, grad_names, grads, counts, norm, absmax, len(params), limits)


def reads_params(checked: int, every: int, *, as_found: bool, forward_checked: bool, snapshot_due: bool,
                 records_finite: Optional[bool] = None) -> bool:
    """Whether this step's pass reads the parameters, or only their gradients.

    Args:
        checked: the number of checked steps before this one.
        every: ``params_every``.
        as_found: a bad verdict of this step is read while the parameters are still as the step found
            them: an eager watch (its read comes before the optimizer step), or a lagged one whose
            optimizer skips a bad step on the device (the next step's read comes before its update).
        forward_checked: a forward of the model ran this step with its output checked.
        snapshot_due: action="rollback" takes a snapshot at this step's end (it must be proven finite).
        records_finite: every record of this step so far counts nothing (known on the host: a CPU
            watch's records, ``WatchRecorder.finite``), or None where that is not known without a read
            from the device.

    Returns:
        True to read them."""
    # NOTE: [Parameters read when they add information]
    # A non-finite parameter shows in the next forward's output: a NaN or inf weight makes NaN or inf
    # in every matmul, convolution, normalisation or sum it enters (0 * inf is NaN). So in an eager
    # watch whose forward output was checked, reading every parameter at every step (half the pass's
    # bytes, more than every activation of a small model) adds nothing but a name, and the name is
    # needed only on a bad step: there the parameters, still as the step found them (the read comes
    # before the optimizer step), are read once more and their rows come first (Actions._evaluate).
    # What a parameter that no checked value depends on would hide (an embedding row not looked up,
    # an unused or masked branch) is found by the full read every `params_every` checked steps, which
    # also gives the timeline its parameter norm. Every step reads them when the forward's output was
    # not checked (activations or loss off, ignored, no forward or a compiled one this step), and when
    # a rollback snapshot is due (it must be proven finite).
    # A lagged watch reads its verdict a step late. Where its optimizer skips a bad step on the device
    # (action="skip" with a found_inf optimizer), the parameters are still as the bad step found them
    # when that verdict is read (the next step's read comes before the next update), so they are read
    # again then, as in an eager watch. Otherwise the optimizer has moved them by then: such a watch
    # reads them with the step unless its records are known on the host to be finite (a CPU watch: its
    # records are numbers there, no read from a device). Finite records with the output among them say
    # the parameters are finite as well (the argument above), except for one that reaches the loss
    # outside the forward (an L2 term the loop adds, over an embedding row no batch looked up): its
    # gradient is then non-finite, which the pass's counts show on the host too, and the parameters are
    # read at once, still as the step found them (StepEnd._fused_pass). On an accelerator the records
    # are on the device: that watch reads the parameters every step (a gate read by the pass's kernel
    # itself would lift it: not built).
    return (checked % every == 0 or not forward_checked or snapshot_due
            or not (as_found or records_finite is True))
