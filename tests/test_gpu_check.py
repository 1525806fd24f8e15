"""tools/gpu-check, the one command for a machine with a GPU: what can be checked without one."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parent.parent / "tools" / "gpu-check"

pytestmark = pytest.mark.skipif(not TOOL.is_file(), reason="tools/ is not shipped: run from the checkout")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the tool runs the real check")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    done = run(str(tmp_path / "report"))
    assert done.returncode == 2
    assert "no NVIDIA GPU is visible" in done.stderr
    assert not (tmp_path / "report").exists()


def test_plan_covers_every_check(tmp_path):
    done = run(str(tmp_path), "--plan")
    assert done.returncode == 0, done.stderr
    steps = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert list(steps) == ["install", "version", "cuda-tests", "sanitizer-memcheck", "sanitizer-racecheck",
                           "sanitizer-synccheck", "sync-debug-watched-step", "cuda-graph", "bench-core",
                           "ncu-kernels", "small-tensors-timeline", "bench-watch", "watch-cost-parts"]
    for tool in ("memcheck", "racecheck", "synccheck"):
        assert f"--tool {tool} --error-exitcode 1" in steps[f"sanitizer-{tool}"]
        assert steps[f"sanitizer-{tool}"].endswith("gpu_check_cases.py hard-cases")
    assert "bench --device cuda" in steps["bench-core"]
    assert "--profile-from-start off" in steps["ncu-kernels"] and steps["ncu-kernels"].endswith("cuda_kernel_profile.py")
    assert steps["small-tensors-timeline"].endswith("--timeline --workload 5000x1024-fp32")
    assert "--suite watch" in steps["bench-watch"] and "--device cuda" in steps["watch-cost-parts"]
    assert Path(steps["watch-cost-parts"].split()[1]).exists()  # the script the step runs is in the checkout


def test_only_runs_the_named_steps_and_names_the_steps_for_an_unknown_one(tmp_path):
    done = run(str(tmp_path), "--plan", "--only", "bench-core,install")
    assert done.returncode == 0, done.stderr
    assert [line.split(": ", 1)[0] for line in done.stdout.splitlines()] == ["install", "bench-core"]
    done = run(str(tmp_path), "--only", "install,sanitizers")
    assert done.returncode == 2 and "no step named sanitizers" in done.stderr and "sanitizer-memcheck" in done.stderr


def test_the_install_downloads_nothing(tmp_path):
    """The GPU machines it runs on reach no package index: the install takes what the Python holds."""
    install = dict(line.split(": ", 1) for line in run(str(tmp_path), "--plan").stdout.splitlines())["install"]
    assert "--no-deps" in install and "--no-build-isolation" in install and "[" not in install


def test_the_report_names_a_tree_that_differs_from_its_commit(tmp_path):
    tool = runpy.run_path(str(TOOL), run_name="gpu_check")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert tool["tree_commit"](tmp_path) == head
    (tmp_path / "a.txt").write_text("2")
    assert tool["tree_commit"](tmp_path) == f"{head} + uncommitted changes"
