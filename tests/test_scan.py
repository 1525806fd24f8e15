"""`python -m nanfast scan` on clean, poisoned, truncated and malicious files, with its exit codes and --json."""

from __future__ import annotations

import builtins
import json
import sys

import pytest
import torch

from nanfast import scan
from nanfast.cli import main

NAN = float("nan")
INF = float("inf")


# --------------------------------------------------------------------------------------------------
# python -m nanfast scan
# --------------------------------------------------------------------------------------------------

def run_scan(capsys, *argv):
    code = main(["scan", *map(str, argv)])
    return code, capsys.readouterr().out


@pytest.fixture
def clean_file(tmp_path):
    path = tmp_path / "clean.pt"
    torch.save({"layer.weight": torch.randn(4, 4), "layer.bias": torch.zeros(4), "step": 10}, path)
    return path


@pytest.fixture
def poisoned_file(tmp_path):
    weight = torch.randn(4, 4)
    weight[0, 1] = NAN
    weight[2, 2] = -INF
    path = tmp_path / "poisoned.pth"
    torch.save({"model": {"layer.weight": weight, "layer.bias": torch.zeros(4)},
                "optimizer": {"state": {0: {"exp_avg": torch.full((4,), INF)}}}}, path)
    return path


class RunsCode:
    """Unpickling this creates `marker`: the file a malicious checkpoint would write."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


def test_scan_clean(capsys, clean_file):
    code, out = run_scan(capsys, clean_file)
    assert code == 0 and out.strip() == f"{clean_file}: 2 tensors, 20 elements: clean"


def test_scan_poisoned_prints_a_table(capsys, poisoned_file):
    code, out = run_scan(capsys, poisoned_file)
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == f"{poisoned_file}: 3 tensors, 24 elements: 2 of them hold non-finite values"
    assert lines[1].split() == ["name", "shape", "dtype", "nan", "+inf", "-inf"]
    assert lines[2].split() == ["model.layer.weight", "(4,", "4)", "float32", "1", "0", "1"]
    assert lines[3].split() == ["optimizer.state.0.exp_avg", "(4,)", "float32", "0", "4", "0"]


def test_scan_truncated(capsys, tmp_path, clean_file):
    data = clean_file.read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    code, out = run_scan(capsys, truncated)
    assert code == 2 and out.startswith(f"{truncated}: unreadable: damaged or truncated")


def test_scan_truncated_legacy_format(capsys, tmp_path):
    legacy = tmp_path / "legacy.bin"
    torch.save({"w": torch.ones(100)}, legacy, _use_new_zipfile_serialization=False)
    assert run_scan(capsys, legacy)[0] == 0  # not a zip: read without mmap
    legacy.write_bytes(legacy.read_bytes()[:-200])
    code, out = run_scan(capsys, legacy)
    assert code == 2 and "unreadable: damaged or truncated" in out


def test_scan_refuses_a_malicious_file_without_running_it(capsys, tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "payload": RunsCode(marker)}, evil)
    code, out = run_scan(capsys, evil)
    assert code == 2
    opener = f"{builtins.open.__module__}.{builtins.open.__qualname__}"  # io.open
    assert out.strip() == (f"{evil}: refused: its pickle asks to run {opener}; weights-only loading never "
                           "runs code from a file, and nanfast does not load it any other way")
    assert not marker.exists()


def test_scan_missing_file(capsys, tmp_path):
    code, out = run_scan(capsys, tmp_path / "nope.pt")
    assert code == 2 and "unreadable: [Errno 2] No such file or directory" in out


def test_unreadable_input_dominates_the_exit_code(capsys, clean_file, poisoned_file, tmp_path):
    assert run_scan(capsys, clean_file, poisoned_file)[0] == 1
    assert run_scan(capsys, poisoned_file, tmp_path / "nope.pt", clean_file)[0] == 2


def test_scan_json(capsys, clean_file, poisoned_file, tmp_path):
    code, out = run_scan(capsys, "--json", clean_file, poisoned_file, tmp_path / "nope.pt")
    result = json.loads(out)
    assert code == 2 and result["exit_code"] == 2
    clean, poisoned, missing = result["files"]
    assert (clean["status"], clean["num_tensors"], clean["bad"]) == ("clean", 2, [])
    assert poisoned["status"] == "nonfinite"
    assert [(b["name"], b["nan"], b["posinf"], b["neginf"]) for b in poisoned["bad"]] == [
        ("model.layer.weight", 1, 0, 1), ("optimizer.state.0.exp_avg", 0, 4, 0)]
    assert missing["status"] == "unreadable" and "No such file" in missing["error"]


def test_scan_loads_weights_only_and_memory_mapped(monkeypatch, clean_file):
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    assert scan.scan_file(str(clean_file)).status == "clean"
    assert [(c["weights_only"], c["mmap"]) for c in calls] == [(True, True)]


def test_scan_in_chunks_finds_the_same(monkeypatch, poisoned_file):
    whole = scan.scan_file(str(poisoned_file)).report
    monkeypatch.setattr(scan, "CHUNK_BYTES", 1)  # one tensor per fused pass
    assert scan.scan_file(str(poisoned_file)).report == whole


def test_safetensors_without_the_package(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    code, out = run_scan(capsys, path)
    assert code == 2 and "needs the safetensors package (pip install safetensors)" in out


def test_safetensors(capsys, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    weight = torch.randn(3, 3)
    weight[1, 1] = NAN
    clean, poisoned = tmp_path / "clean.safetensors", tmp_path / "poisoned.safetensors"
    safetensors_torch.save_file({"a": torch.ones(3), "b": torch.zeros(2, 2, dtype=torch.bfloat16)}, clean)
    safetensors_torch.save_file({"a": torch.ones(3), "w": weight}, poisoned)
    assert run_scan(capsys, clean) == (0, f"{clean}: 2 tensors, 7 elements: clean\n")
    code, out = run_scan(capsys, poisoned)
    assert code == 1 and out.splitlines()[2].split() == ["w", "(3,", "3)", "float32", "1", "0", "0"]
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(poisoned.read_bytes()[:-8])
    code, out = run_scan(capsys, truncated)
    assert code == 2 and "unreadable" in out


def test_scan_deep_nesting(capsys, tmp_path):
    deep = node = {}
    for _ in range(5000):
        node["a"] = node = {}
    node["w"] = torch.tensor([1.0, NAN])
    path = tmp_path / "deep.pt"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # for torch.save, which recurses; loading it does not
    try:
        torch.save(deep, path)
    finally:
        sys.setrecursionlimit(limit)
    code, out = run_scan(capsys, path)
    assert code == 1 and out.splitlines()[2].split()[0] == ".".join(["a"] * 5000 + ["w"])


def test_scan_self_referencing_containers(capsys, tmp_path):
    weights = [torch.ones(2), torch.tensor([INF])]
    weights.append(weights)  # a list holding itself
    state = {"weights": weights}
    state["self"] = state
    path = tmp_path / "cycle.pt"
    torch.save(state, path)
    code, out = run_scan(capsys, path)
    assert code == 1 and out.splitlines()[0] == f"{path}: 2 tensors, 3 elements: 1 of them hold non-finite values"
    assert out.splitlines()[2].split()[0] == "weights[1]"
