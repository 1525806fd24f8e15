"""nanfast: find NaN and inf in PyTorch training at memory bandwidth.

Fused kernels (torch.ops.nanfast.*, CPU and CUDA) count NaN/+inf/-inf and compute norms over many
tensors in one pass; check_all, watch and locate build on them."""

from ._extension import load as _load_extension

_load_extension()  # first: a checkout not built, or built against another torch, says so

from .check import check_all, named_tensors  # noqa: E402
from .clip import clip_grad_norm_  # noqa: E402
from .locator import LocateFinding, StepState, locate, locate_step, replay  # noqa: E402
from .ops import Stats, any_nonfinite, stats  # noqa: E402
from .report import Entry, NonFiniteError, Report  # noqa: E402
from .batch import check_batch, checked  # noqa: E402
from .watcher import Event, Place, SpikeError, SpikeOptions, StepRecord, Watch, watch  # noqa: E402

__all__ = ["Entry", "NonFiniteError", "Report", "Stats", "any_nonfinite", "check_all", "named_tensors", "stats",
           "LocateFinding", "StepState", "locate", "locate_step", "replay",
           "check_batch", "checked",
           "Event", "Place", "SpikeError", "SpikeOptions", "StepRecord", "Watch", "clip_grad_norm_", "watch"]
__version__ = "0.1.0"
