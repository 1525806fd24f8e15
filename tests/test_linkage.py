"""The extension uses the process's one libstdc++, never a static copy of its own (NOTE: [The process's
one libstdc++] in setup.py). On an H100 machine's image, a g++ wrapper linked one in: every TORCH_CHECK
message with a number in it then crashed the process instead of raising."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import nanfast


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("readelf") is None,
                    reason="reads the ELF dynamic section with readelf (Linux)")
def test_the_extension_needs_the_shared_libstdcxx():
    dynamic = subprocess.run(["readelf", "-d", nanfast.ops._C.__file__], capture_output=True, text=True, check=True)
    needed = [line for line in dynamic.stdout.splitlines() if "(NEEDED)" in line]
    assert any("[libstdc++.so" in line for line in needed), needed


def test_an_error_message_that_formats_numbers_is_raised_not_a_crash():
    # In a child process: a crash there fails this test rather than ending the test run.
    code = ("import torch, nanfast\n"
            "try:\n"
            "    nanfast.stats([torch.zeros(2), torch._neg_view(torch.arange(5, dtype=torch.uint8))])\n"
            "except RuntimeError as error:\n"
            "    print(error)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "tensors[1] is a negative view of an unsigned Byte tensor" in child.stdout
