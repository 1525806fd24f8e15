"""nanfast: find NaN and inf in PyTorch training at memory bandwidth.

Fused kernels (torch.ops.nanfast.*, CPU and CUDA) count NaN/+inf/-inf and compute norms over many
tensors in one pass; check_all, watch and locate build on them."""

from .check import check_all, named_tensors
from .clip import clip_grad_norm_
from .locator import LocateFinding, StepState, locate, locate_step, replay
from .ops import Stats, any_nonfinite, stats
from .report import Entry, NonFiniteError, Report
from .batch import check_batch, checked
from .watcher import Event, Place, SpikeError, SpikeOptions, StepRecord, Watch, watch

__all__ = ["Entry", "NonFiniteError", "Report", "Stats", "any_nonfinite", "check_all", "named_tensors", "stats",
           "LocateFinding", "StepState", "locate", "locate_step", "replay",
           "check_batch", "checked",
           "Event", "Place", "SpikeError", "SpikeOptions", "StepRecord", "Watch", "clip_grad_norm_", "watch"]
__version__ = "0.1.0"
