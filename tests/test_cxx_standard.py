"""The sources build as C++17 too: torch 2.11 builds extensions as C++17 (2.14 as C++20), and pyproject
promises torch >= 2.8. The SIMD units include no header that needs C++20, so the compiler checks them
here as C++17; the other units include torch headers that demand the standard of the torch installed,
and tools/gpu-check's build under torch 2.11 covers them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch.utils.cpp_extension

CSRC = Path(__file__).resolve().parent.parent / "csrc"
UNITS = ["isa.cpp", "simd_baseline.cpp", "simd_avx2.cpp", "simd_avx512.cpp"]

pytestmark = [pytest.mark.skipif(not (CSRC / "cpu").is_dir(), reason="needs the source tree (csrc/)"),
              pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")]


@pytest.mark.parametrize("unit", UNITS)
def test_simd_units_compile_as_cxx17(unit):
    includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
    done = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-fopenmp", "-Wall", "-Wextra", "-Werror",
                           "-Wno-unused-parameter", *includes, str(CSRC / "cpu" / unit)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
