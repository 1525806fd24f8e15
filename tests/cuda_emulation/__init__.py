"""Builds csrc/cuda/stats_cuda.cu, unchanged, for the CPU emulation of the CUDA execution model (see
NOTE: [CUDA emulation] in cuda_emulation.h) and loads it as torch.ops.nanfast_emu: stats and
any_nonfinite over CPU tensors, run by the real kernels; configure(order, seed) picks the order of
threads and blocks (forward, reverse, shuffled); last_launches() gives [launches, blocks] of the last op.

Environment: NANFAST_CSRC (the csrc/ folder; default: next to tests/), NANFAST_CUDA_EMU_BUILD (the build
folder; default under ~/.cache/nanfast), NANFAST_CUDA_EMU_ORDER / NANFAST_CUDA_EMU_SEED (the initial order)."""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL_FILE = "cuda/stats_cuda.cu"

# `kernel<T><<<grid, block, shared, stream>>>(` on one line.
_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)<<<(.*?)>>>\(")
# `__shared__ T name[N];`
_SHARED = re.compile(r"(__shared__\s+[^;=]*?(\w+)\s*(?:\[[^\]]*\])+\s*;)")

_loaded = None


def csrc_dir() -> Path:
    """The csrc/ folder the kernels are built from."""
    return Path(os.environ.get("NANFAST_CSRC", HERE.parent.parent / "csrc")).resolve()


def rewrite(source: str, name: str) -> str:
    """The kernel file as the emulation compiles it: launches and shared arrays rewritten in place (same
    lines), after the emulation's header, with `name` as the file name in messages.

    Raises:
        ValueError: the file has no launch, or a launch the rewrite does not recognise.
    """
    launches = 0

    def launch(match: re.Match) -> str:
        nonlocal launches
        launches += 1
        kernel, config = match.group(1), match.group(2)
        return f'::cuda_emu::Launch(&{kernel}, ::cuda_emu::Site{{__FILE__, __LINE__, "{kernel}"}}, {config})('

    body = _LAUNCH.sub(launch, source)
    if launches == 0 or "<<<" in body:
        raise ValueError(f"{name}: found {launches} kernel launches the emulation can rewrite, and "
                         f"{body.count('<<<')} it cannot")
    body = _SHARED.sub(lambda m: f"{m.group(1)} ::cuda_emu::shared_declared({m.group(2)}, sizeof({m.group(2)}));", body)
    return f'#define CUDA_EMU_KERNEL_FILE 1\n#include "cuda_emulation.h"\n#line 1 "{name}"\n{body}'


def _loaded_libstdcxx() -> list[str]:
    """The libstdc++ this process mapped, linked by path so that the build uses it and carries no static
    copy (NOTE: [The process's one libstdc++] in setup.py)."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})[:1]


def _default_build_dir() -> Path:
    import torch

    key = hashlib.sha256(f"{torch.__version__} {sys.version} {csrc_dir()}".encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "nanfast" / "cuda_emulation" / key


def build(kernel_file: Path | None = None, build_dir: Path | None = None, tsan: bool | None = None,
          verbose: bool = False) -> None:
    """Compiles `kernel_file` (default: csrc/cuda/stats_cuda.cu) with the emulation, warnings as errors,
    and loads it, registering torch.ops.nanfast_emu (once per process). With `tsan` (default: the
    environment's NANFAST_CUDA_EMU_TSAN=1) it is built for ThreadSanitizer, in a build folder of its own:
    the process must have libtsan preloaded (tools/cuda_tsan does it).

    Raises:
        FileNotFoundError: the kernel file is missing (tests run outside the checkout: set NANFAST_CSRC).
        RuntimeError: the build failed.
    """
    import torch.utils.cpp_extension

    import nanfast._C

    kernel_file = Path(kernel_file or csrc_dir() / KERNEL_FILE)
    if not kernel_file.is_file():
        raise FileNotFoundError(f"{kernel_file} not found: the CUDA emulation builds the kernels from the "
                                "source tree (set NANFAST_CSRC to its csrc/ folder)")
    if tsan is None:
        tsan = os.environ.get("NANFAST_CUDA_EMU_TSAN") == "1"
    build_dir = Path(build_dir or os.environ.get("NANFAST_CUDA_EMU_BUILD") or _default_build_dir())
    if tsan:
        build_dir = build_dir.with_name(build_dir.name + "-tsan")
        # See NOTE: [Volatile accesses under ThreadSanitizer] in emulator.cpp.
        sanitize = ["-fsanitize=thread", "--param=tsan-distinguish-volatile=1", "-DCUDA_EMU_TSAN=1", "-g"]
        link = ["-fsanitize=thread"]
    else:
        # A misaligned 16-byte load aborts, as it faults on a GPU.
        sanitize = ["-fsanitize=alignment", "-fno-sanitize-recover=alignment"]
        link = ["-fsanitize=alignment"]
    build_dir.mkdir(parents=True, exist_ok=True)
    generated = build_dir / "stats_cuda_emu.cpp"
    text = rewrite(kernel_file.read_text(), f"csrc/{KERNEL_FILE}")
    if not generated.is_file() or generated.read_text() != text:  # unchanged: ninja keeps the object
        generated.write_text(text)
    library = Path(nanfast._C.__file__).resolve()  # describe_inputs() and the other host helpers
    # The compiler must not inherit the libtsan preloaded into this process (it crashes).
    preload = os.environ.pop("LD_PRELOAD", None) if tsan else None
    try:
        torch.utils.cpp_extension.load(
            name="nanfast_cuda_emu_tsan" if tsan else "nanfast_cuda_emu",
            sources=[str(generated), str(HERE / "emulator.cpp")],
            # -U_FORTIFY_SOURCE: glibc's fortified longjmp refuses the jumps between fiber stacks (NOTE: [Fibers]).
            extra_cflags=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unknown-pragmas", "-Werror",
                          "-U_FORTIFY_SOURCE"] + sanitize,
            extra_include_paths=[str(HERE / "include"), str(HERE), str(kernel_file.parent)],
            extra_ldflags=link + [str(library), f"-Wl,-rpath,{library.parent}"] + _loaded_libstdcxx(),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload


def ops_for_test():
    """ops() for a test: skips it where the sources are missing (a copy of tests/ outside the checkout),
    except under CI, which always has them."""
    import pytest

    try:
        return ops()
    except FileNotFoundError as error:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(str(error))


def ops():
    """torch.ops.nanfast_emu, built and loaded on first use (see build())."""
    global _loaded
    if _loaded is None:
        build()
        import torch

        _loaded = torch.ops.nanfast_emu
    return _loaded
