"""The command line a new user meets first: `nanfast --version` tells what was built, and long runs show
a progress bar on a terminal only."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

import nanfast
from nanfast import build_info, cli
from nanfast.progress import byte_progress, progress


def test_version_names_nanfast_torch_the_cpu_isa_and_the_cuda_build(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"nanfast {nanfast.__version__}"
    assert f"torch {torch.__version__}" in out
    assert f"this CPU runs {nanfast.ops._C.cpu_isa()}" in out
    record = build_info.build_record()
    if build_info.has_cuda_kernels():
        assert f"architectures {record['cuda_archs'] if record else 'not recorded'}" in out
    else:
        assert "CUDA kernels: not built (" in out


def test_version_of_the_console_script_and_the_module_agree():
    module = subprocess.run([sys.executable, "-m", "nanfast", "--version"], capture_output=True, text=True, check=True)
    assert module.stdout == build_info.describe() + "\n"


def test_build_record_matches_the_loaded_extension():
    record = build_info.build_record()
    if record is None:
        pytest.skip("this extension was not built by setup.py (no nanfast/_build.py)")
    assert record["torch"].split("+")[0] == torch.__version__.split("+")[0]
    # The record says CUDA kernels were built exactly when the dispatcher has them.
    assert (record["cuda_archs"] is not None) == build_info.has_cuda_kernels()
    assert (record["cuda_skipped"] is None) == build_info.has_cuda_kernels()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert list(progress(range(3), desc="x")) == [0, 1, 2]
    assert sys.stderr.getvalue() == ""  # not a terminal: nothing drawn
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(progress(range(3), desc="files")) == [0, 1, 2]
    assert "files:" in terminal.getvalue() and "/3 [" in terminal.getvalue()  # tqdm's bar, with the total


def test_progress_without_tqdm_is_silent(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(progress(iter("ab"), desc="x")) == ["a", "b"]
    assert terminal.getvalue() == ""


def test_byte_progress_only_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with byte_progress(2048, desc="scan") as bar:
        bar.update(2048)
    assert sys.stderr.getvalue() == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with byte_progress(2048, desc="scan") as bar:
        bar.update(1024)
    drawn = terminal.getvalue()
    assert "scan:" in drawn and "/2.05k [" in drawn and "B/s]" in drawn  # bytes, scaled
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: silent
    with byte_progress(2048, desc="scan") as bar:
        bar.update(2048)
    assert terminal.getvalue() == drawn
