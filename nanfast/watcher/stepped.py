"""What the watched optimizer steps against what the watched model holds: parameters outside either one
(warned of when a skipping watch is made, read before a skip), and whether the next step creates
optimizer state (a step a skip on the device could not undo)."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .. import _C
from ..locator.source import user_stacklevel
from ..report import first_few
from .options import ignored


def warn_of_parameters_outside(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Warns when a skipping watch's optimizer and model hold different parameters. One that steps
    parameters outside the model: a skip puts back the model's buffers only, so the BatchNorm statistics
    of a module outside it that a bad batch reached (a watched backbone, a head outside it) keep that
    batch, NaN for good (a probe, session 43). A model with trainable parameters the optimizer does not
    step (a sparse embedding under SparseAdam beside the watched Adam): another optimizer's update of
    them is no part of the step a skip undoes (see NOTE: [Parameters another optimizer steps])."""
    inside = {id(p) for p in model.parameters()}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    outside = [f"param[{i}]" for i, p in enumerate(stepped) if id(p) not in inside]
    if outside:
        warnings.warn(f"nanfast.watch: the optimizer steps {len(outside)} parameter(s) outside the watched "
                      f"{type(model).__name__} ({first_few(outside, 3)}): a skipped step puts back the watched "
                      "model's buffers only, so a module outside it that a bad batch reached (its BatchNorm "
                      "statistics) keeps what that batch wrote. Watch the module that holds every parameter the "
                      "optimizer steps.", UserWarning, stacklevel=user_stacklevel())
    unstepped = [name for name, p in unstepped_parameters(model, optimizer) if p.requires_grad]
    if unstepped:
        warnings.warn(f"nanfast.watch: {len(unstepped)} trainable parameter(s) of the watched {type(model).__name__} "
                      f"are not in its optimizer ({first_few(unstepped, 3)}): a skip undoes this optimizer's step "
                      "only, so another optimizer's update of them in a bad step stays (a skip then raises once "
                      "they are non-finite). Give them to this optimizer, or set requires_grad=False on those "
                      "not trained.", UserWarning, stacklevel=user_stacklevel())


def unstepped_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters in none of the optimizer's groups (frozen ones too), with their names."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [(name, p) for name, p in model.named_parameters() if id(p) not in stepped]


def nonfinite_unstepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ignore: tuple[str, ...],
                        nan_only: bool) -> Optional[list[str]]:
    """The names of the model's parameters outside the optimizer (unstepped_parameters) holding a NaN or
    inf (a NaN alone with `nan_only`; none that `ignore` names): one fused call and one host read, made
    only when a skip is about to be taken; None when the model has no such parameters to read (on several
    ranks the skip still asks every rank: pipeline stages hold different modules)."""
    # NOTE: [Parameters another optimizer steps]
    # A model trained by two optimizers (a sparse embedding under SparseAdam, the rest under Adam) is
    # watched with one. In a bad step the other one, stepped first, wrote the bad gradients into its
    # parameters, which a skip of the watched step does not undo: every later step then found NaN in
    # the forward and skipped it too, silently, naming the embedding's output and never its weight (a
    # probe, session 46). So before skipping, the model's parameters outside the optimizer are read, and
    # a non-finite one makes the skip raise instead, naming it. Frozen ones too: a frozen base weight that
    # went NaN (written in place, an adapter merged into it) made every later step skip the same way.
    unstepped = [(name, p) for name, p in unstepped_parameters(model, optimizer) if not ignored(ignore, name)]
    if not unstepped:
        return None
    counts = _C.stats_on([p for _, p in unstepped], unstepped[0][1].device)[0]
    bad = (counts[:, 0] if nan_only else counts.sum(dim=1)).gt(0).tolist()
    return [name for (name, _), b in zip(unstepped, bad) if b]


def lacks_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the next step creates optimizer state: some parameter with a gradient has none yet."""
    state = optimizer.state
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(state) >= len(params):
        return False
    return any(p.grad is not None and not state.get(p) for p in params)
