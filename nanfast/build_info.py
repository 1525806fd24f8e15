"""What this copy of nanfast is: its version, the torch it runs on and was built against, the CPU
instruction set its kernels use here, and the CUDA architectures it was compiled for
(`python -m nanfast --version`)."""

from __future__ import annotations

import torch

from . import _C
from ._extension import build_record, other_torch

# The CPU kernels are compiled for every instruction set below (each under its own target pragma);
# the best one this CPU supports is picked at run time, capped by NANFAST_CPU_ISA.
CPU_ISAS = ("avx512", "avx2", "baseline")


def has_cuda_kernels() -> bool:
    """Whether the loaded extension registered CUDA kernels (asked of the dispatcher, not the record)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("nanfast::stats", "CUDA")


def describe() -> str:
    """The lines `nanfast --version` prints.

    Returns:
        A multi-line string: nanfast's version, torch's, the CPU ISA in use, the CUDA kernels' build.
    """
    from . import __version__

    record = build_record()
    built_with = f" (built against {other})" if (other := other_torch()) is not None else ""
    lines = [f"nanfast {__version__}",
             f"torch {torch.__version__}{built_with}",
             f"CPU kernels: {', '.join(CPU_ISAS)} compiled; this CPU runs {_C.cpu_isa()}"]
    if has_cuda_kernels():
        archs = record["cuda_archs"] if record else "not recorded (built without setup.py)"
        cuda = record["cuda"] if record else torch.version.cuda
        lines.append(f"CUDA kernels: CUDA {cuda}, architectures {archs}; "
                     f"GPUs visible: {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    else:
        why = record["cuda_skipped"] if record else "not recorded"
        lines.append(f"CUDA kernels: not built ({why})")
    return "\n".join(lines)
