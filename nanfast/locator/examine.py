"""Judging one op whose outputs hold NaN/inf (NOTE: [what locate reports]): producer, scalar, input, or
propagation, and the finding that describes it."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._tree import named_leaves
from .diagnosis import diagnose
from .findings import LocateFinding, Producer, TensorInfo
from .off_path import OffPath
from .provenance import _OUTSIDE, Provenance
from .replay import _repro
from .schema import _OpInfo
from .source import SourceLine
from .values import (_at_dtype_limit, _counts, _dense, _scalar_nonfinite, _scalar_text, _values, finite_min_max,
                     values_label)


def examine(provenance: Provenance, dump_wanted: bool, info: _OpInfo, named: list[tuple[str, Any]],
            before: dict[int, torch.Tensor], raw: list[torch.Tensor], outputs: list[torch.Tensor],
            producer: Producer, source: Optional[SourceLine], backward_source: Optional[SourceLine] = None,
            unreturned: tuple[str, ...] = ()) -> tuple[Optional[tuple[LocateFinding, Optional[dict]]], bool]:
    """Judges an op whose outputs hold NaN/inf.

    Args:
        provenance: the region's records (read for inputs; dirty inputs are marked reported).
        dump_wanted: whether the finding's arguments are to be copied for a dump.
        info: the op's schema facts.
        named: the op's arguments as (name, value).
        before: pre-op copies of the arguments it reads and overwrites, by id.
        raw: its checked outputs as returned, then the arguments it wrote without returning them;
            outputs: their values.
        producer: the op as a Producer; source: the user's line it ran at (in backward: the line that
            called backward); backward_source: in backward, the Python code autograd called that ran it.
        unreturned: the names of those written arguments (a training batch norm's "running_var"), which
            name them in the finding.
    Returns:
        (its finding with the arguments to dump, or None for propagation; whether its outputs'
        non-finite values descend from a finding, this one's or an input's: True, or the OffPath of a
        held input's (NOTE: [off the gradient path]), or False).
    """
    if info.masked_when is not None and any(n == info.masked_when and v is True for n, v in named):
        return None, False  # the composite calling it zeroes its inf (NOTE: [masked by the composite])
    # (name, values as read or None, live values or None, the tensor as passed)
    inputs: list[tuple[str, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]] = []
    scalars: list[str] = []
    numbers: list[tuple[str, str, bool, bool]] = []  # the non-finite ones: (name, text, nan, inf)
    for name, value in named:
        if name in info.out_args:
            continue
        # Named by position in their list ("indices[1]"), Nones in a Tensor?[] counted.
        tensors = [(label, t) for label, t in named_leaves(value, name, brackets=True)
                   if isinstance(t, torch.Tensor)]
        if tensors:
            for label, t in tensors:
                inputs.append((values_label(label, t), _values(before.get(id(t), t)), _values(t), t))
            continue
        text = _scalar_text(value)
        if text is not None:
            scalars.append(f"{name}={text}")
        nan, inf = _scalar_nonfinite(value)
        if nan or inf:
            numbers.append((name, text, nan, inf))

    checked = [i for i, (_, t, _, _) in enumerate(inputs) if t is not None]
    in_counts = dict(zip(checked, _counts([inputs[i][1] for i in checked]))) if checked else {}
    out_counts = _counts(outputs)
    out_nan = any(c[0] for c in out_counts)
    out_inf = any(c[1] or c[2] for c in out_counts)
    tensor_nan = any(c[0] for c in in_counts.values())
    tensor_inf = any(c[1] or c[2] for c in in_counts.values())
    blamed = [n for n in numbers
              if n[2] and out_nan and not tensor_nan
              or n[3] and not info.masking and (out_inf and not tensor_inf or out_nan and not tensor_nan)]
    # True (from a reported finding) before an OffPath (a held one: NOTE: [off the gradient path]).
    taints = [taint for i, c in in_counts.items() if any(c) and (taint := provenance.tainted(inputs[i][2]))]
    tainted = True if True in taints else (taints[0] if taints else False)

    def held_reach_outputs(but: Any = None) -> None:
        # NOTE: [A held finding beside another]
        # Outputs carry one taint, but a held finding's values (NOTE: [off the gradient path], NOTE: [a
        # backward finding masked downstream]) may reach them beside another's: eigh's NaN gradient at
        # equal eigenvalues (pytorch/pytorch#47599) accumulated into a .grad that already held NaN (a
        # parameter left out of the optimizer, never zeroed) was tainted as that input's, and eigh's
        # finding, its gradient freed, was noted as masked (a probe, session 48). Such a finding follows
        # the outputs too, and is reported if they are alive when it is judged.
        for taint in taints:
            if isinstance(taint, OffPath) and taint is not but:
                taint.follow(outputs)
    dirty = [i for i, c in in_counts.items() if c[0] and provenance.from_outside(inputs[i][2])]

    if (out_inf and not (out_nan or tensor_nan or tensor_inf or numbers)
            and _at_dtype_limit([inputs[i][1] for i in checked], [v for _, v in named], outputs, info.pointwise)):
        # NOTE: [a mask at the dtype's limit]
        # Code that masks with torch.finfo(dtype).min rather than -inf (transformers' attention masks)
        # overflows to -inf where a masked score is negative in float16, and clamps it back right after
        # (huggingface/transformers#17437): an infinite mask's inf, intended. Its output is recorded as
        # such a mask's: a later op that makes NaN of it (a row masked whole) is the producer.
        return None, False
    if out_inf and not (out_nan or tensor_nan or tensor_inf or numbers) and _logs_a_mask(info.name, inputs, provenance):
        return None, False  # see NOTE: [the log of a 0/1 mask]
    if out_inf and not (tensor_nan or tensor_inf or numbers):
        kind, reason = "producer", "made non-finite values from finite inputs"
    elif tainted and not dirty:
        held_reach_outputs(but=tainted)
        return None, tainted  # propagates (inf * 0, inf - inf) what a finding made
    elif blamed and not tainted:
        kind = "scalar"
        reason = "; ".join(f"its scalar argument `{name}` is {text}" for name, text, _, _ in blamed)
    elif out_nan and not tensor_nan and not tainted:  # (a NaN number with NaN out is blamed above)
        kind, reason = "producer", "made NaN from inputs without NaN"
    else:
        if not dirty:
            return None, False  # propagates values that were allowed (infinite masks, data)
        kind = "input"
        names = ", ".join(inputs[i][0] for i in dirty)
        reason = f"first op to consume NaN that no op under locate produced (input {names})"
        if producer.node is not None and "CompiledFunction" in producer.node:
            # NOTE: [A compiled region's kernels]
            # The backward of a torch.compile'd forward runs inductor's fused kernels, which no dispatch
            # mode sees: a NaN made there (sqrt's backward at 0) reached the first op locate saw as if it
            # came from data or a parameter (a probe, session 46). Said so, not blamed on the input.
            reason += (": it runs in the backward of a torch.compile'd region, whose fused kernels locate does "
                       "not see, so the NaN may have been made there; run the step uncompiled to name its op")

    def info_of(name: str, t: torch.Tensor, counts: tuple[int, int, int], record: Optional[tuple]) -> TensorInfo:
        lo, hi = finite_min_max(t)
        prod = record[1] if record is not None and record[1] is not _OUTSIDE else None
        return TensorInfo(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), *counts,
                          lo, hi, prod, record is not None and record[2])

    input_infos = []
    for i, (name, t, live, passed) in enumerate(inputs):
        dense = t if t is not None else _dense(passed)
        record = provenance.record(live) if live is not None else None
        input_infos.append(info_of(name, dense, in_counts.get(i, (0, 0, 0)), record))
    if kind == "input":
        for i in dirty:  # report a dirty tensor once, at its first consumer
            provenance.set_producer(inputs[i][2], _OUTSIDE)
    returned = len(outputs) - len(unreturned)
    names = ["out"] if returned == 1 else [f"out[{k}]" for k in range(returned)]
    names += unreturned
    output_infos = [info_of(values_label(n, r), t, c, None) for n, r, t, c in zip(names, raw, outputs, out_counts)]
    repro = (_repro(info.name, named, before, info.out_args)
             if dump_wanted else None)
    diagnosis = None
    if kind != "input":
        as_read = {name: before.get(id(value), value) if isinstance(value, torch.Tensor) else value
                   for name, value in named if name not in info.out_args}
        # A sparse or nested operand alone is diagnosed by the values it holds, so named (a sparse log1p's
        # -inf had no reason in words; a probe, session 50). Beside another tensor operand its values would
        # not line up with that one's elements, so such an op gets none.
        label, held, _, _ = inputs[0] if len(inputs) == 1 else ("", None, None, None)
        arg = label.removesuffix(".values()")
        by_values = held is not None and arg != label and arg in as_read
        if by_values:
            as_read[arg] = held
        diagnosis = diagnose(info.name, as_read, outputs)
        if diagnosis and by_values:
            diagnosis = diagnosis.replace(f"`{arg}`", f"`{label}`")
    finding = LocateFinding(
        kind, info.name, producer.phase, producer.node, source,
        producer.source if producer.phase == "backward" else None, reason,
        tuple(output_infos), tuple(input_infos), tuple(scalars), diagnosis=diagnosis, backward_source=backward_source)
    held_reach_outputs()
    return (finding, repro), True



# NOTE: [the log of a 0/1 mask]
# `scores + mask.float().log()` is how AllenNLP's masked_log_softmax, and code written after it, makes an
# additive mask: log(0) = -inf where the mask is 0 (allenai/allennlp#890). Judged as any log of zeros,
# it stopped every healthy batch at the log, and the NaN of a row masked whole was then propagation, so
# the log_softmax that made it, and its diagnosis, went unreported (a probe, session 51). So a log whose
# input holds only exact 0s and 1s that came from outside locate or from a cast (`.float()`, `.to()` of a
# bool or integer mask) makes intended infinities, as a masking op does. One of 0s and 1s that an op
# computed (a softmax saturated to one-hot) is no mask: its log is still the producer.
_LOG_PACKETS = frozenset(("log", "log_"))  # the idiom's (a log2 or log10 of a mask is no one's)
_MASK_CASTS = frozenset(("aten._to_copy.default",))


def _logs_a_mask(op: str, inputs: list, provenance: Provenance) -> bool:
    """Whether op is a log of a 0/1 mask (see the NOTE above), from its inputs as examine lists them."""
    if op.split(".")[1] not in _LOG_PACKETS or len(inputs) != 1 or inputs[0][1] is None:
        return False
    _, values, live, _ = inputs[0]
    if not bool(((values == 0) | (values == 1)).all()):
        return False
    record = provenance.record(live) if live is not None else None
    producer = record[1] if record is not None else _OUTSIDE
    return producer is _OUTSIDE or producer.op in _MASK_CASTS


# NOTE: [a non-finite value backward is called on]
# Infinities allowed where they are made (a mask's -inf from masked_fill, an input's) are not findings,
# and ops that carry them on are propagation. Label smoothing sums log_softmax over every class, the
# masked ones too: cross_entropy(logits.masked_fill(mask, -inf), y, label_smoothing=0.1) is +inf, its
# gradients finite, and locate said nothing (the same in candle-org/MindAct#1633; a probe, session 45).
# The value backward() is called on is where such infinities stop being allowed: a loss is never meant
# to be infinite. So when autograd makes the implicit gradient of a non-finite scalar (its ones_like, in
# torch.autograd._make_grads) and no finding explains the value, the op that made it is reported when
# its backward pass ends without a finding (before an optimizer step), or the region does: an inf weight
# (from outside, allowed too) makes an inf loss and then inf - inf in the weight's gradient, a finding
# nearer the cause, reported instead.
def root_finding(provenance: Provenance, root: torch.Tensor) -> LocateFinding:
    """The finding for `root`, a non-finite value backward() (or autograd.grad) was called on that no
    finding explains: the op under locate that last wrote it, or, when none did, the value as an input
    from outside (see NOTE: [a non-finite value backward is called on])."""
    values = _values(root)
    lo, hi = finite_min_max(values)
    info = TensorInfo("the value backward() was called on", tuple(root.shape), str(root.dtype).removeprefix("torch."),
                      str(root.device), *_counts([values])[0], lo, hi)
    record = provenance.record(root)
    producer = record[1] if record is not None and record[1] is not _OUTSIDE else None
    if producer is None:
        return LocateFinding("input", "(outside locate)", "forward", None, None, None,
                             "backward() was called on a non-finite value that no op under locate made", (info,), (), ())
    backward = producer.phase == "backward"
    return LocateFinding("producer", producer.op, producer.phase, producer.node, None if backward else producer.source,
                         producer.source if backward else None,
                         "made the non-finite value that backward() was called on, from infinities allowed where they "
                         "were made (a mask's -inf, an input's)", (info,), (), ())
