"""One step of a watch: what its slots stand for and its forwards so far (a `Step`, made new at each
step), and its read: the step's counts packed on the device with a summary (`Step.pack`), read by the
host once (`verdict`) and turned into places."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import torch

from .. import _C
from .events import InputEntry, Place
from .fused_pass import Pass
from .history import Tail
from .inputs import Layout, entry_names, output_names
from .host_copy import HostCopy
from .options import ignored

# Leading entries of the per-step summary tensor; its Tail follows (losses, scale, module norms).
SUMMARY = ("flag", "nan", "posinf", "neginf", "grad_norm", "grad_max_abs", "param_norm", "scaler_found_inf")
GRAD_NORM = SUMMARY.index("grad_norm")
# Values that are scaled by a GradScaler's loss scale, so may overflow (see NOTE: [AMP and GradScaler]).
_SCALED_PHASES = frozenset(("loss", "backward", "grad"))


@dataclasses.dataclass
class Read:
    """One step's checks, packed on the device, and where their host copy lands (lagged reads)."""

    step: int
    summary: torch.Tensor  # float64 [len(SUMMARY) + the tail's length] on the device
    recorded_counts: list  # int64 [rows, 3] tensors: the records' counts, in execution order (WatchRecorder.take)
    # Which of their cells count (int64 0/1 [rows, 3]; None: all), NOTE: [Cells a record does not count]
    recorded_counted: Optional[torch.Tensor]
    labels: list  # what each of the step's slot ids stands for: (phase, site, call, microbatch)
    recorded: list  # (slot id, rows) of each record, in row order
    # The rows of the step's pass: (its counts, how many are parameters', the parameters' names, the
    # gradients' names), or None; not the Pass itself, which holds the gradients (a lagged read outlives them).
    pass_rows: Optional[tuple]
    reported: tuple  # which of the pass's rows the step reports: (ignore patterns, params checked, grads checked)
    scaler_skipped: bool
    agreeing: Optional[Any] = None  # the Work of the flag's all-reduce across ranks, until waited on
    host: Optional[HostCopy] = None  # the summary, copied without blocking (lagged)
    tail: Tail = Tail()
    headroom: Optional[Any] = None  # headroom.Pending: max |x| of the low-precision places, on its way to the host
    params_unread: bool = False  # the pass left the parameters out: a bad verdict reads them (Actions._evaluate)
    # An evaluation forward's own read (see NOTE: [Evaluation forwards between optimizer steps]): not a
    # training step, so no timeline record, spike or headroom sample, and nothing to skip.
    evaluation: bool = False
    # A batch the loop abandoned after its backward (see NOTE: [A batch the loop abandons]): read as an
    # evaluation is, but its event is no evaluation's and a bad one reads the parameters.
    abandoned: bool = False
    # A loss passed to Watch.loss before any forward of its step (after optimizer.step(): NOTE: [A loss
    # passed after its step]): read as an evaluation is, numbered as the step it came after.
    late_loss: bool = False
    # Forwards no step end read, read when the watch's `with` block ended (NOTE: [Forwards the loop never
    # ended]): read as an evaluation is.
    unended: bool = False
    # A late loss of a step an inference forward ended (no optimizer): that forward's loss, not a late one.
    after_inference: bool = False
    # An evaluation inside a training step (see NOTE: [An evaluation inside a training step]): the buffers
    # a skip would put back are the training step's, not the evaluation's.
    within_step: bool = False
    inputs: dict = dataclasses.field(default_factory=dict)  # Step.inputs: each forward's input layout
    outputs: dict = dataclasses.field(default_factory=dict)  # Step.outputs: output layouts by slot id
    eval_mode_with_grad: set = dataclasses.field(default_factory=set)  # Step.eval_mode_with_grad (a new Step makes a new one)
    # Skipped at once on this rank, before its lagged read (NOTE: [A lagged step one rank must read at
    # once]): the buffers its forward changed that could not be put back.
    unrestored: tuple = ()
    step_state: Optional[Any] = None  # on_event="locate": the locate.StepState the step began with
    forward_unchecked: bool = False  # no forward of the model ran where the hooks saw it (Event.forward_unchecked)
    params_rewritten: bool = False  # the loop wrote the parameters between the step's forwards (Event.params_rewritten)
    loss_checked: bool = False  # Watch.loss gave the step a loss, and the watch checks losses
    _layout: Optional[tuple] = None  # (parts, front, back), made when first asked for

    def layout(self) -> tuple[list, list, list]:
        """Where the counts' rows come from, in row order ((int64 [*, 3] tensor, start, stop, kept rows or
        None) each), the parameters' slot (phase, names, call, microbatch, rows) before the records' rows
        and the gradients' slot after them: made when read (a bad step), since a good step never reads
        them."""
        if self._layout is None:
            front: list = []
            back: list = []
            parts: list = [(counts, 0, counts.shape[0], None) for counts in self.recorded_counts]
            if self.recorded_counted is not None:  # a bad step's: joined and weighed once
                parts = [(_rows_of(parts) * self.recorded_counted, 0, self.recorded_counted.shape[0], None)]
            if self.pass_rows is not None:
                counts, n, param_names, grad_names = self.pass_rows
                ignore, params, grads = self.reported
                _kept("param", param_names, ignore, params, (counts, 0, n), parts, front)
                _kept("grad", grad_names, ignore, grads, (counts, n, counts.shape[0]), parts, back)
            self._layout = (parts, front, back)
        return self._layout

    def slots(self) -> list:
        """(phase, label, call, microbatch, rows, slot id or None for the pass's) in row order: made when
        read (a bad step), since a good eager step never reads them."""
        _, front, back = self.layout()
        return [*((*kept, None) for kept in front), *((*self.labels[slot], rows, slot) for slot, rows in self.recorded),
                *((*kept, None) for kept in back)]

    def all_counts(self) -> torch.Tensor:
        """Every row's counts, int64 [rows, 3] on the device, in slot order: put together when they are
        read (a bad step), since a good step never reads them."""
        return _rows_of(self.layout()[0])


class Step:
    """The Python side of one step's records: what each slot id stands for (see NOTE: [The watch's
    recorder]; `ModuleHooks.slot` appends to `slots`, NOTE: [Module hooks in C++]) and the forwards so
    far. A new step is a new Step."""

    __slots__ = ("slots", "forwards", "clipped", "clipped_versions", "losses", "output_checked", "params_unread",
                 "inputs", "outputs", "eval_mode_with_grad", "gradless", "given_loss")

    def __init__(self) -> None:
        self.slots: list[tuple[str, Any, int, int]] = []  # (phase, site, call, microbatch) by slot id
        self.forwards = 0
        self.clipped: Optional[Pass] = None  # the fused pass Watch.clip_grad_norm_ made
        self.clipped_versions: tuple[int, ...] = ()  # its gradients' versions once clipped
        self.losses: dict[str, list[torch.Tensor]] = {}  # Watch.loss: name -> each call's mean (float64, device)
        self.output_checked = False  # a forward's output was checked (see NOTE: [Parameters read when they add information])
        self.params_unread = False  # the step's pass left the parameters out (same NOTE)
        self.inputs: dict[int, Layout] = {}  # microbatch -> its input's layout (NOTE: [Naming the input's entries])
        self.outputs: dict[int, Layout] = {}  # slot id -> its output's layout (NOTE: [Naming the output's fields])
        self.eval_mode_with_grad: set[int] = set()  # microbatches whose forward ran in eval mode with gradients
        # A skipping watch's: the optimizer's parameters with no .grad at the step's first forward (ids);
        # None where no forward began the step, or none had one (NOTE: [Gradients a skipped step gives back]).
        self.gradless: Optional[frozenset[int]] = None
        self.given_loss = False  # Watch.loss was given one after a forward (NOTE: [A loss passed after its step])

    def truncate(self, first_slot: int) -> None:
        """Forgets the slots from `first_slot` on (a forward dropped, an evaluation taken out), with their
        outputs' layouts: a later record reusing a slot id must not take another's names."""
        del self.slots[first_slot:]
        for slot in [slot for slot in self.outputs if slot >= first_slot]:
            del self.outputs[slot]

    def pack(self, recorded: list, counted: Optional[torch.Tensor], recorded_slots: list, fused: Optional[Pass], *,
             params: bool, grads: bool, ignore: tuple[str, ...], nan_only: bool, found_inf: Optional[torch.Tensor],
             grad_scale: Optional[torch.Tensor], device: torch.device, step: int, scaler_skipped: bool,
             scale: Optional[torch.Tensor] = None, groups: Optional[Any] = None) -> Read:
        """This step's read: the summary, [flag, nan, +inf, -inf, grad norm, max |grad|, param norm,
        scaler's found_inf] and its Tail (the losses' means, the GradScaler's `scale`, with `groups`
        (spikes.ModuleGroups) each module's gradient norm), made in one call (see NOTE: [The step's
        summary in one call]); and where its counts come from, in execution order (parameters, then the
        hooks' slots, then gradients), put together only when they are read (Read.layout). `recorded`,
        `counted`: WatchRecorder.take()'s records' counts and which of their cells count."""
        pass_args: tuple = (None, None, None, 0, None)
        index, modules = None, ()
        if fused is not None:
            pass_args = (fused.counts, fused.norm, fused.absmax, fused.n_params, _counted(fused, ignore, params, grads))
            if groups is not None and fused.grads:
                modules, index = groups.index(fused.grad_names, device)
        scale = Tail.scale_kept(scale, device)
        losses = [mean if mean.device == device else mean.to(device) for means in self.losses.values() for mean in means]
        if found_inf is not None or grad_scale is not None:
            found_inf, grad_scale = (t.to(device) if isinstance(t, torch.Tensor) else None for t in (found_inf, grad_scale))
        summary = _C.step_summary(
            recorded, counted, *pass_args, nan_only, found_inf, grad_scale, losses,
            [len(means) for means in self.losses.values()], scale, index, len(modules))
        tail = Tail(tuple(self.losses), scale is not None, modules, grads=fused is not None and bool(fused.grads),
                    params=fused is not None and fused.n_params > 0)
        pass_rows = None if fused is None else (fused.counts, fused.n_params, fused.param_names, fused.grad_names)
        return Read(step, summary, recorded, counted, self.slots, recorded_slots, pass_rows, (ignore, params, grads),
                    scaler_skipped, tail=tail, inputs=self.inputs, outputs=self.outputs,
                    eval_mode_with_grad=self.eval_mode_with_grad)


def _counted(fused: Pass, ignore: tuple[str, ...], params: bool, grads: bool) -> Optional[torch.Tensor]:
    """Which of the pass's rows the summary counts (int64 0/1 per row on the pass's device), or None when
    it counts all of them: the ones ignored or of a check turned off are left out."""
    if params and grads and not ignore:
        return None
    return _counted_mask(fused.param_names, fused.grad_names, ignore, params, grads, fused.counts.device)


# The same parameters and gradients give the same mask step after step: made once, not copied to the
# device at every step (a host-to-device copy on a GPU, where the step's host time is its cost). The
# summary op only reads it.
@functools.lru_cache(maxsize=8)
def _counted_mask(param_names: tuple, grad_names: tuple, ignore: tuple[str, ...], params: bool, grads: bool,
                  device: torch.device) -> Optional[torch.Tensor]:
    n, rows = len(param_names), len(param_names) + len(grad_names)
    kept_params = _kept_indices(param_names, ignore, params)
    kept_grads = _kept_indices(grad_names, ignore, grads)
    if kept_params is None and kept_grads is None:
        return None
    mask = [0] * rows
    for i in range(n) if kept_params is None else kept_params:
        mask[i] = 1
    for i in range(rows - n) if kept_grads is None else kept_grads:
        mask[n + i] = 1
    return torch.tensor(mask, dtype=torch.int64, device=device)


def _rows_of(parts: list) -> torch.Tensor:
    """The rows `parts` name ((counts, start, stop, kept rows or None) each), in order, as one tensor."""
    rows = []
    for counts, start, stop, kept in parts:
        part = counts[start:stop]
        if kept is not None:
            part = part.index_select(0, torch.tensor(kept, dtype=torch.long, device=part.device))
        rows.append(part)
    return torch.cat(rows) if len(rows) > 1 else rows[0]


def _kept_indices(names, ignore: tuple[str, ...], wanted: bool) -> Optional[list[int]]:
    """The indices of the names a step reports (none if the check is off, the ignored ones left out), or
    None when it reports all of them."""
    if not wanted:
        return []
    if not ignore:
        return None
    keep = [i for i, name in enumerate(names) if not ignored(ignore, name)]
    return None if len(keep) == len(names) else keep


def _kept(phase: str, names: list[str], ignore: tuple[str, ...], wanted: bool, rows: tuple, parts: list,
          slots: list) -> None:
    """Adds the rows of the parameters or gradients a step reports (one per name, the ignored ones left
    out; none if the check is off) to `parts` and their slot to `slots` (the read's front or back):
    the parameters' in front, the gradients' at the end."""
    keep = _kept_indices(names, ignore, wanted)
    kept = names if keep is None else [names[i] for i in keep]
    if kept:
        part, slot = (*rows, keep), (phase, tuple(kept), 1, 0, len(kept))
        if phase == "param":
            parts.insert(0, part)
        else:
            parts.append(part)
        slots.append(slot)


def with_params(read: Read, rows: list, summary: list, fused: Pass, ignore: tuple[str, ...]) -> list:
    """A bad step's rows with its parameters' rows in front, from a pass made now (see NOTE: [Parameters
    read when they add information]); the read's slots and the summary's counts take them in too.

    Args:
        read: the bad step's read (eager, so the parameters are still as the step found them).
        rows, summary: what verdict() gave for it.
        fused: the pass over the parameters made now.
        ignore: the watch's ignore patterns.

    Returns:
        The rows, the parameters' first."""
    parts: list = []
    slots: list = []
    _kept("param", fused.param_names, ignore, True, (fused.counts, 0, fused.n_params), parts, slots)
    if not parts:
        return rows
    found = _rows_of(parts).tolist()
    _, front, _ = read.layout()
    front[:0] = slots
    for k in range(3):
        summary[1 + k] += sum(row[k] for row in found)
    return found + rows


def start_copy(read: Read) -> None:
    """Starts copying the read's summary to the host without blocking (lagged): pinned memory on CUDA.
    Its rows of counts stay on the device: only a bad step reads them (one wait, on that step alone)."""
    read.host = HostCopy(read.summary)


def verdict(read: Read) -> tuple[bool, list[float], list]:
    """Reads a step on the host: whether it is bad, the summary's values (with its tail) and, for a bad
    step, the rows of counts."""
    if read.host is not None:  # lagged: the copy was enqueued a step ago
        summary = read.host.tolist()
        bad = summary[0] > 0
        return bad, summary, read.all_counts().tolist() if bad else []
    # NOTE: [One read per step]
    # The one host sync of a checked step: the summary (a few dozen numbers: flag, counts, norms, the
    # losses, the module norms) is copied to pinned memory without blocking, then the .item() of the
    # flag waits for the stream, which has done that copy before it (stream order); both in one call,
    # _C.read_summary. The counts of each place stay on the device unless the step is bad.
    bad, summary = _C.read_summary(read.summary)
    return bad, summary, read.all_counts().tolist() if bad else []


def places(rows: list, read: Read, scaler_skipped: bool, nan_only: bool, forward: Callable) -> list[Place]:
    """The places of a bad step's rows, in execution order; with `scaler_skipped`, not the scaled
    phases (see NOTE: [AMP and GradScaler]); a dirty input's entries named from `forward`'s signature
    (see NOTE: [Naming the input's entries])."""
    found = []
    i = 0
    for phase, label, call, microbatch, n, slot in read.slots():
        if scaler_skipped and phase in _SCALED_PHASES:
            pass
        elif isinstance(label, tuple):  # one row per named parameter, gradient or buffer
            for name, (nan, posinf, neginf) in zip(label, rows[i:i + n]):
                if _reported(nan, posinf, neginf, nan_only):
                    found.append(Place(phase, name, "", int(nan), int(posinf), int(neginf), call, microbatch))
        else:  # a record's rows summed (most hold one: a step with -inf masked at every step walks them all)
            nan, posinf, neginf = rows[i] if n == 1 else [sum(column) for column in zip(*rows[i:i + n])] or (0, 0, 0)
            if _reported(nan, posinf, neginf, nan_only):
                entries = ()
                if phase == "input":
                    entries = _dirty_entries(entry_names(read.inputs.get(microbatch), n, forward), rows[i:i + n], nan_only)
                elif phase in ("forward", "loss"):  # a field of an output, or the gradient w.r.t. it
                    entries = _dirty_entries(output_names(read.outputs.get(slot), n), rows[i:i + n], nan_only)
                found.append(Place(phase, label.name, label.module_class, nan, posinf, neginf, call, microbatch,
                                   entries))
        i += n
    return found


def _dirty_entries(names: Optional[list[str]], rows: list, nan_only: bool) -> tuple:
    """The named entries of a dirty input or module output that hold non-finite values; () when `names`
    (one per row) is None."""
    if names is None:
        return ()
    return tuple(InputEntry(name, int(nan), int(posinf), int(neginf)) for name, (nan, posinf, neginf) in zip(names, rows)
                 if _reported(nan, posinf, neginf, nan_only))


def _reported(nan: int, posinf: int, neginf: int, nan_only: bool) -> bool:
    """Whether counts are reported: any non-finite value, or with nan_only (infinities are not errors) a NaN."""
    return bool(nan if nan_only else nan + posinf + neginf)
