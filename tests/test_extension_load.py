"""Importing nanfast where its extension is missing or was built against another torch (a probe, session
43): a checkout never built said "cannot import name '_C' from partially initialized module (most likely
due to a circular import)", and a build for another torch "libc10_cuda.so: cannot open shared object
file". Each copy of the package here is a fresh one in a temporary folder, imported in a fresh process
under another name (an editable install's finder would hand `nanfast._C` over from the checkout)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import torch

import nanfast

PACKAGE = pathlib.Path(nanfast.__file__).parent
EXTENSION = next(PACKAGE.glob("_C.*"))


def _copy(tmp_path: pathlib.Path, extension: bytes | None, built_against: str | None) -> pathlib.Path:
    """The package's Python files in tmp_path/nanfast_copy, with `extension` as its _C file (None: none) and a
    build record naming `built_against` (None: none)."""
    target = tmp_path / "nanfast_copy"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("_C.*", "_build.py", "__pycache__"))
    if extension is not None:
        (target / EXTENSION.name).write_bytes(extension)
    if built_against is not None:
        (target / "_build.py").write_text(f"BUILD = {{'torch': {built_against!r}, 'cuda': None, 'cuda_archs': None, "
                                          "'cuda_skipped': 'test'}\n")
    return tmp_path


def _import(root: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "always", "-c", "import nanfast_copy; print('imported')"],
                          cwd=root, capture_output=True, text=True, timeout=300)


def test_a_checkout_never_built_says_so_and_how_to_build_it(tmp_path):
    result = _import(_copy(tmp_path, extension=None, built_against=None))
    assert result.returncode != 0 and "circular import" not in result.stderr
    assert "its compiled extension (nanfast/_C) is not built" in result.stderr
    assert "pip install --no-build-isolation -e ." in result.stderr


def test_an_extension_that_cannot_load_under_another_torch_names_both_versions(tmp_path):
    result = _import(_copy(tmp_path, extension=b"not a shared object", built_against="2.9.0+cu126"))
    assert result.returncode != 0
    assert (f"was built against torch 2.9.0+cu126, and torch {torch.__version__} is running, which cannot load "
            "it") in result.stderr
    assert "rebuild it with pip install --no-build-isolation -e ." in result.stderr


def test_an_extension_built_against_another_torch_that_loads_warns(tmp_path):
    result = _import(_copy(tmp_path, extension=EXTENSION.read_bytes(), built_against="2.9.0+cu126"))
    assert result.returncode == 0 and "imported" in result.stdout
    assert f"built against torch 2.9.0+cu126, and torch {torch.__version__} is running" in result.stderr
    same = _import(_copy(tmp_path / "same", extension=EXTENSION.read_bytes(), built_against=torch.__version__))
    assert same.returncode == 0 and "built against" not in same.stderr
