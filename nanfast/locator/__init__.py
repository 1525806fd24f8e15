"""`locate`: find the first ATen op that turns finite values into NaN or inf, forward or backward, and
say where it ran, what its inputs were and which ops made them (tfdbg's workflow, done per op).

`locate_step` re-runs one training step under `locate`; `replay` re-runs a dumped op.

The rooms: region.py (the context manager), mode.py (the TorchDispatchMode), examine.py (judging an op),
provenance.py (who wrote each storage), findings.py (what is reported), schema.py and values.py (what
an op is and what its tensors hold), source.py (the user's line), node_verdict.py (backward nodes),
diagnosis/ (patterns in words), replay.py (dumps), step.py (re-running a training step)."""

from .findings import LocateFinding, Producer, TensorInfo
from .region import Locate, locate
from .replay import replay
from .schema import MASKING_OPS
from .source import SourceLine
from .step import StepState, locate_step

__all__ = ["MASKING_OPS", "Locate", "LocateFinding", "Producer", "SourceLine", "StepState", "TensorInfo", "locate",
           "locate_step", "replay"]
