"""What a watch reports: a `Place` (where, within a step, non-finite values were seen) and the step's
`Event` (the first place in execution order and those after it)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..report import NonfiniteCounts, first_few

# Phases in the order their values arise within a step.
PHASES = ("param", "input", "forward", "buffer", "loss_value", "loss", "backward", "grad")
# What an event reports: non-finite values (the watch's actions apply), or a warning about finite values
# (overflow headroom running out, a spike in the loss or a gradient norm).
KINDS = ("nonfinite", "headroom", "spike", "absorbed")
_MAX_NAMED_IN_SUMMARY = 8
# How events name the model itself (its qualified name is ""); `ignore` matches it under both names.
MODEL = "<model>"


@dataclasses.dataclass(frozen=True)
class InputEntry(NonfiniteCounts):
    """An entry of a dirty input batch (a tensor among the forward's arguments), or a field of a dirty
    module output, and its counts."""

    name: str  # named by the forward's arguments: "x", "targets[1].boxes", "pixel_values"; an output's field: "loss"
    nan: int
    posinf: int
    neginf: int


@dataclasses.dataclass(frozen=True)
class Place(NonfiniteCounts):
    """Where, within a step, non-finite values were seen.

    ``phase`` is one of PHASES. ``name`` is the module's qualified name ("" for the model itself) in
    phases forward, backward and loss; the parameter's name in phases param and grad, the buffer's in
    phase buffer (read after a training forward: NOTE: [Buffers a forward writes]); "input" in phase
    input; the name given to Watch.loss in phase loss_value. ``call`` tells the calls of a module called
    several times in one forward apart (1-based); ``microbatch`` is the index of the model's forward
    within the step (gradient accumulation). ``entries``, in phase input: the entries of the batch that
    held the non-finite values (InputEntry), when the watch could name them; in phase forward, the fields
    of the output that held them ("loss", "[1]": NOTE: [Naming the output's fields]); empty elsewhere."""

    phase: str
    name: str
    module_class: str
    nan: int
    posinf: int
    neginf: int
    call: int = 1
    microbatch: int = 0
    entries: tuple[InputEntry, ...] = ()

    def where(self) -> str:
        """Returns:
            The place in words ("output of layer1 (Linear)", "gradient of parameter fc.weight", ...)."""
        module = f"{self.name or MODEL} ({self.module_class})" + (f" call {self.call}" if self.call > 1 else "")
        return {
            "param": f"parameter {self.name}",
            "input": "the input batch",
            "forward": f"output of {module}",
            "buffer": f"buffer {self.name} after the forward",
            "loss_value": f"value of {self.name!r} passed to Watch.loss",
            "loss": f"gradient of the loss w.r.t. the output of {module}",
            "backward": f"gradient flowing out of {module} in backward",
            "grad": f"gradient of parameter {self.name}",
        }[self.phase] + (f" [microbatch {self.microbatch}]" if self.microbatch else "")

    def describe(self) -> str:
        """Returns:
            The place and its counts in words (a dirty input's: each entry's)."""
        if self.entries:
            return f"{self.where()}: {self.entries_text()}"
        return f"{self.where()} ({self.counts_text()})"

    def entries_text(self) -> str:
        """Returns:
            A dirty input's entries with their counts, in words ("targets[1].boxes (nan=1, +inf=0, -inf=0)")."""
        return first_few([f"{e.name} ({e.counts_text()})" for e in self.entries], _MAX_NAMED_IN_SUMMARY)

    def dirty_text(self) -> str:
        """Returns:
            What a dirty input held, in words: its entries with their counts, or the counts alone when the
            entries could not be named."""
        return self.entries_text() if self.entries else self.counts_text()


def _of_first(field: str) -> property:
    """A read-only property giving the event's first place's `field`."""
    return property(lambda event: getattr(event.first, field), doc=f"The first place's {field}.")


@dataclasses.dataclass(frozen=True)
class Event:
    """What a watch found in one step. Kind "nonfinite": the first place in execution order where a
    non-finite value appeared (the producer) and the places hit after it (where it propagated). The
    parameters are read together at a step's start and their gradients together after backward (NOTE:
    [Parameters and gradients in one pass]): several of them are in the optimizer's order (or the
    model's), which says nothing of which came first, and none propagated to another; the summary says
    so. Kinds "headroom" and "spike": a warning about finite values at `first` (its counts are zeros),
    said in `detail`. Kind "absorbed": -inf only, in forward outputs, in a training step whose loss and
    gradients are finite (see NOTE: [-inf that did no harm]): its places, and the notice in `detail`."""

    step: int
    first: Place
    later: tuple[Place, ...]
    # Distributed (see NOTE: [Agreeing across ranks]): the rank whose place is `first` (the earliest
    # over all ranks), and every rank that saw non-finite values with its places.
    rank: Optional[int] = None
    by_rank: tuple[tuple[int, tuple[Place, ...]], ...] = ()
    # on_event="locate": what the re-run of the step under nanfast.locate found (a LocateFinding), or
    # None when the re-run stayed finite or was not made.
    located: Optional[Any] = None
    # Why `located` names another place than `first`, or None when they agree (nanfast.agreement).
    located_differs: Optional[str] = None
    kind: str = "nonfinite"  # one of KINDS
    detail: Optional[str] = None  # kinds headroom, spike and absorbed: what was seen, in words
    # Seen in an evaluation forward (eval mode, no gradients: a validation pass), read when it returned;
    # `step` is the training step it came before or in.
    evaluation: bool = False
    # Seen in a batch the loop dropped after its backward (its gradients cleared with no optimizer step:
    # its own NaN guard), read at the next forward; `step` is the optimizer step it came before.
    abandoned: bool = False
    # A loss passed to Watch.loss before any forward of the model in its step (after optimizer.step()),
    # read alone at once; `step` is the step it came after (NOTE: [A loss passed after its step]).
    late_loss: bool = False
    # Seen in forwards no step end read (after the last optimizer.step() or w.step()), read when the
    # watch's `with` block ended (NOTE: [Forwards the loop never ended]); `step` is the one they came after.
    unended: bool = False
    # The first place's forward ran in eval mode with gradients enabled: a training forward for the watch
    # (fine-tuning with frozen BatchNorm statistics trains so), or a validation pass without no_grad.
    eval_mode_with_grad: bool = False
    # No forward of the model ran where the watch's hooks saw it in this step (a compiled forward): its
    # input, activations and output were not checked, and `first` is where the values first reached what
    # the step's pass reads (see NOTE: [The watch and torch.compile]).
    forward_unchecked: bool = False
    # The loop wrote the parameters between this step's forwards (SAM's or an adversarial perturbation):
    # a non-finite parameter found at its end may be that write's, not the previous optimizer step's.
    params_rewritten: bool = False
    # The watch's every= (a non-finite parameter's event only): the steps between two checked ones went
    # unchecked, so the values may come from any optimizer step since the last checked one.
    every: int = 1

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that saw non-finite values in this step (empty in a single process)."""
        return tuple(rank for rank, _ in self.by_rank)

    # The first place's fields, as the event's own (an event is mostly read for its producer).
    phase = _of_first("phase")
    name = _of_first("name")
    module_class = _of_first("module_class")
    nan = _of_first("nan")
    posinf = _of_first("posinf")
    neginf = _of_first("neginf")

    @property
    def dirty_input(self) -> bool:
        """The batch itself held non-finite values: bad data, not a fault of the model."""
        return self.first.phase == "input"

    @property
    def places(self) -> tuple[Place, ...]:
        return (self.first, *self.later)

    def summary(self) -> str:
        """Returns:
            The event in words: the first place (the producer), the ranks, the located op, and where it
            propagated (the first few places)."""
        if self.kind != "nonfinite":
            return f"nanfast.watch: step {self.step}: {self.detail}"
        on = f" on rank {self.rank}" if self.rank is not None else ""
        at = f"step {self.step}" + (" (an evaluation: a forward in eval mode without gradients)" if self.evaluation
                                    else " (a batch the loop dropped: its gradients were cleared without an optimizer "
                                    "step)" if self.abandoned else " (a loss passed to Watch.loss after optimizer.step(), "
                                    "read alone: the step was already applied)" if self.late_loss else " (forwards no step "
                                    "ended, after the last optimizer.step() or w.step(): read when the watch ended)"
                                    if self.unended else "")
        # The parameters' rows, and the gradients', are read together: the ones after `first` are not
        # where its values went, and their order is the optimizer's (see the class docstring).
        together = 0
        if self.first.phase in ("param", "grad"):
            while together < len(self.later) and self.later[together].phase == self.first.phase:
                together += 1
        read_with = self.later[:together]
        if self.dirty_input:
            head = (f"{at}: {self.first.where()}{on} is dirty: {self.first.dirty_text()}; the model did not produce "
                    "it in this step")
        elif self.first.phase == "param":
            # The watch's first step has no optimizer step of its own before it.
            last_checked = self.step - self.every
            made = ("already there when the watch began (the initial values, a loaded checkpoint, or whatever "
                    "wrote them before)" if self.step == 0 else
                    "made by the previous optimizer step (or whatever last wrote the parameters)" if self.every == 1 else
                    f"made by one of the optimizer steps {max(last_checked, 0)} to {self.step - 1} (or whatever last "
                    f"wrote the parameters): with every={self.every}, the steps after {last_checked} were not checked")
            if self.params_rewritten:  # read at the step's end: the loop's own write may have made them
                head = (f"{at}: non-finite values{on} in {_listed(self.first, read_with)} at the step's end; the loop "
                        "wrote the parameters between this step's forwards (a perturbation, as SAM's), which may "
                        f"have made them, or they were {made}")
            else:
                head = f"{at} began with non-finite values{on} in {_listed(self.first, read_with)}: {made}"
        elif read_with:
            head = (f"{at}: non-finite values first appeared{on} in the gradients of {1 + together} "
                    f"parameters, read together after backward (which one backward made first is not known): "
                    f"{_listed(self.first, read_with)}")
        else:
            head = f"{at}: non-finite values first appeared{on} in the {self.first.describe()}"
        if self.by_rank:
            head += f" (ranks that saw non-finite values: {list(self.ranks)})"
        if self.located is not None:
            head += f"; located: {self.located.summary()}"
            head += f" ({self.located_differs})" if self.located_differs else ""
        # A dirty input after the first place (non-finite parameters) is no place the values went to.
        later = [p for p in self.later[together:] if p.phase != "input"]
        for dirty in (p for p in self.later[together:] if p.phase == "input"):
            head += f"; {dirty.where()} was dirty too: {dirty.dirty_text()}"
        hint = (" (its forward ran in eval mode with gradients enabled: if it was a validation pass, run it "
                "under torch.no_grad() so that it is read as an evaluation, not as part of the training step)"
                if self.eval_mode_with_grad else
                " (no forward of the model ran where its own hooks see it in this step: a compiled one, or submodules "
                "the loop called itself; its input and output were not checked, nor a compiled region's activations, "
                "so this is where the values first reached a check, and a dirty batch would show here)"
                if self.forward_unchecked else "")
        hint += self._intended_hint()
        if not later:
            return f"nanfast.watch: {head}{hint}"
        named = first_few([p.where() for p in later], _MAX_NAMED_IN_SUMMARY, "; ")
        places = "1 place" if len(later) == 1 else f"{len(later)} places"
        return f"nanfast.watch: {head}; then propagated to {places}: {named}{hint}"

    __str__ = summary

    def _intended_hint(self) -> str:
        """Where every place holds only -inf in a module's output and nothing after it does (no loss or
        gradient the watch checked): the shape of logits or scores masked with -inf on purpose (an RL
        policy's illegal actions), which the watch cannot tell from a fault; how to say so."""
        if not minus_inf_in_outputs_only(self.places):
            return ""
        return (" (only -inf, in forward outputs, and no loss or gradient the watch checked is non-finite: if they "
                f"are intended, logits or scores masked with -inf, pass ignore={ignore_names(self.places)} to "
                "nanfast.watch)")

    def absorbed(self) -> Event:
        """The notice the watch gives instead of this event, of -inf only in forward outputs in a
        training step whose loss and gradients are finite (see NOTE: [-inf that did no harm]).

        Returns:
            This event as kind "absorbed", its notice in `detail`."""
        named = first_few([p.describe() for p in self.places], _MAX_NAMED_IN_SUMMARY, "; ")
        return dataclasses.replace(self, kind="absorbed", detail=(
            f"only -inf, in {named}, and the step's loss and gradients are finite: taken for values masked on "
            "purpose (logits or scores masked with -inf), not a fault, and the step went on; said once for these "
            f"places (pass ignore={ignore_names(self.places)} to nanfast.watch to say they are intended)"))


# NOTE: [-inf that did no harm]
# Code masks logits and scores with -inf on purpose: an RL policy's illegal actions (its forward
# returns them; torch's Categorical takes -inf logits), a module's attention scores. The watch cannot
# tell those from a module's own log(0), and stopped (or skipped every step of) a healthy policy from its
# first step, saying nothing of how to tell it (a probe, session 53). What tells them apart for training
# is where the values went: a -inf that a softmax or an exp absorbed leaves the loss and the gradients
# finite, and harms nothing; one that did harm makes NaN or inf where the watch looks next (a later
# output, the loss, a gradient). So in a training step whose loss (given to Watch.loss, as the HF and
# Lightning callbacks give it) and gradients the watch read, an event whose every place holds only -inf,
# in forward outputs, is no fault: the step goes on, and the watch warns once for those places (an event
# of kind "absorbed", in `events`), naming the `ignore=` that says they are intended; the spike alarms
# take the step as the healthy one it is. Such a model's steps still take the bad step's path (its
# places made, and gathered across ranks), which `ignore=` saves, but for one part: a bad step reads the
# parameters again to name a non-finite one (NOTE: [Parameters read when they add information]), and a
# -inf bias makes -inf in the output just as a mask does, so the first step with -inf at some places
# reads them; a later step with -inf at the same places alone does not (a read of every parameter at
# every step: a 1.1M-parameter masked policy's steps cost 3.1 points more than the same policy's
# unmasked, 1.8 without it and with the places summed faster). A module's weight or bias gone -inf
# since then makes a new place (that module's output): the parameters are read and it is named at
# once. One whose -inf lands only at places already taken for masked (the model's own offset added to
# the masked logits) did no harm the watch can see either; the full read every `params_every` steps
# names it (tested). Where it cannot see the harm (an inference or evaluation forward; a step whose
# loss it was not given: -inf * 0 makes a NaN loss with finite gradients; a step whose gradients it
# does not read) the event stands, and its message names that `ignore=`.
def minus_inf_in_outputs_only(places: tuple[Place, ...]) -> bool:
    """Whether every place holds only -inf, in a forward output (see NOTE: [-inf that did no harm])."""
    return all(p.phase == "forward" and p.nan == 0 and p.posinf == 0 for p in places)


def did_no_harm(places: tuple[Place, ...], loss_checked: bool, grads_checked: bool) -> bool:
    """Whether `places`, the places of a step whose loss and gradients were checked (`loss_checked`,
    `grads_checked`: finite, since they are not among the places), hold -inf that did no harm (see NOTE:
    [-inf that did no harm])."""
    return loss_checked and grads_checked and minus_inf_in_outputs_only(places)


def absorbed_key(places: tuple[Place, ...]) -> frozenset:
    """What the watch keeps of places whose -inf did no harm, to tell them once and know them again."""
    return frozenset((p.name, p.module_class) for p in places)


def ignore_names(places: tuple[Place, ...]) -> list[str]:
    """The `ignore=` patterns that name `places`' modules ("<model>" for the model)."""
    return list(dict.fromkeys(p.name or MODEL for p in places))


def _listed(first: Place, read_with: tuple[Place, ...]) -> str:
    """`first` and the places read together with it, in words, the first few named."""
    if not read_with:
        return first.describe()
    return first_few([p.describe() for p in (first, *read_with)], _MAX_NAMED_IN_SUMMARY)


def phase_order(place: Place) -> tuple[int, int]:
    """Where a place comes in a step, comparable across ranks: parameters first, then each microbatch's
    forward and backward, the parameters' gradients last."""
    if place.phase == "param":
        return (-1, 0)
    if place.phase == "grad":
        return (1 << 30, 0)
    return (place.microbatch, PHASES.index(place.phase))
