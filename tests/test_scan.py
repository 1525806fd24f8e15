"""Scans: check_batch / checked name the batch, sample and field; `python -m nanfast scan` on clean,
poisoned, truncated and malicious files, with its exit codes and --json."""

from __future__ import annotations

import builtins
import collections
import dataclasses
import json
import sys

import pytest
import torch

import nanfast
from nanfast import scan
from nanfast.cli import main

NAN = float("nan")
INF = float("inf")


# --------------------------------------------------------------------------------------------------
# check_batch
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Inputs:
    image: torch.Tensor
    mask: torch.Tensor


Pair = collections.namedtuple("Pair", ["left", "right"])


def test_clean_batch():
    report = nanfast.check_batch({"x": torch.randn(4, 3), "y": torch.arange(4), "name": "ignored"})
    assert report.ok and report.num_tensors == 2 and report.bad == () and report.samples == []


def test_names_field_paths_and_sample_indices():
    image = torch.randn(5, 2, 3)
    image[3, 1, 2] = NAN
    image[1, 0, 0] = -INF
    weights = torch.ones(5)
    weights[4] = INF
    batch = {"inputs": Inputs(image, torch.ones(5, 3, dtype=torch.bool)),
             "pair": Pair(torch.zeros(5), weights), "targets": [torch.zeros(5), torch.tensor(NAN)]}
    report = nanfast.check_batch(batch, raise_on_nonfinite=False)
    assert [(f.path, f.samples, (f.nan, f.posinf, f.neginf)) for f in report.bad] == [
        ("inputs.image", (1, 3), (1, 0, 1)),
        ("pair.right", (4,), (0, 1, 0)),
        ("targets[1]", (), (1, 0, 0)),
    ]
    assert report.samples == [1, 3, 4]
    assert report.bad[0].shape == (5, 2, 3) and report.bad[0].dtype == "float32"


def test_raises_naming_sample_and_field():
    x = torch.zeros(3, 4)
    x[2, 0] = NAN
    with pytest.raises(nanfast.NonFiniteError, match=r"sample 2 of field '\[0\]' \(nan=1, \+inf=0, -inf=0\)") as e:
        nanfast.check_batch((x, torch.zeros(3)))
    assert isinstance(e.value.report, scan.BatchReport) and e.value.report.samples == [2]


def test_many_bad_samples_are_cut_in_the_message():
    x = torch.full((20, 2), NAN)
    report = nanfast.check_batch({"x": x}, raise_on_nonfinite=False)
    assert report.bad[0].samples == tuple(range(20))
    assert f"and {20 - scan.MAX_SAMPLES_IN_MESSAGE} more" in report.summary()


def test_half_and_complex_fields():
    h = torch.zeros(2, 3, dtype=torch.bfloat16)
    h[1, 1] = INF
    c = torch.zeros(2, dtype=torch.complex64)
    c[0] = complex(0, NAN)
    report = nanfast.check_batch({"h": h, "c": c}, raise_on_nonfinite=False)
    assert [(f.path, f.samples) for f in report.bad] == [("h", (1,)), ("c", (0,))]


def test_sparse_field_is_a_clear_error():
    with pytest.raises(ValueError, match="field 'sp'"):
        nanfast.check_batch({"sp": torch.eye(3).to_sparse()})


def test_report_to_dict_is_json():
    x = torch.zeros(2)
    x[1] = NAN
    d = json.loads(json.dumps(nanfast.check_batch({"x": x}, raise_on_nonfinite=False).to_dict()))
    assert d["ok"] is False and d["bad"][0]["path"] == "x" and d["bad"][0]["samples"] == [1]


# --------------------------------------------------------------------------------------------------
# checked(loader)
# --------------------------------------------------------------------------------------------------

def poisoned_loader():
    features = torch.randn(10, 3)
    features[7, 2] = NAN  # batch 1 (batch size 4), sample 3 within it
    dataset = torch.utils.data.TensorDataset(features, torch.arange(10))
    return torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False)


def test_checked_raises_with_batch_sample_and_field():
    loader = nanfast.checked(poisoned_loader())
    assert len(loader) == 3
    seen = []
    with pytest.raises(nanfast.NonFiniteError, match=r"batch 1: non-finite values in sample 3 of field '\[0\]'") as e:
        for batch in loader:
            seen.append(batch)
    assert len(seen) == 1 and e.value.report.batch_index == 1


def test_checked_warn_yields_every_batch():
    loader = nanfast.checked(poisoned_loader(), action="warn")
    with pytest.warns(RuntimeWarning, match=r"batch 1: .*sample 3 of field '\[0\]'"):
        batches = list(loader)
    assert len(batches) == 3 and [r.batch_index for r in loader.bad_batches] == [1]


def test_checked_skip_drops_bad_batches():
    loader = nanfast.checked(poisoned_loader(), action="skip")
    labels = torch.cat([labels for _, labels in loader])
    assert labels.tolist() == [0, 1, 2, 3, 8, 9]
    assert loader.bad_batches[0].samples == [3]


def test_checked_rejects_unknown_action():
    with pytest.raises(ValueError, match="action"):
        nanfast.checked([], action="ignore")


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


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch has no MX dtypes (torch < 2.8)")
def test_scan_mx_checkpoint(capsys, tmp_path):
    """An MX checkpoint (packed fp4 weights, e8m0 scales) is read, not called damaged; 0xFF is the NaN scale."""
    scale = torch.tensor([[127], [130], [0xFF]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    weight = torch.arange(48, dtype=torch.uint8).view(3, 16).view(torch.float4_e2m1fn_x2)
    path = tmp_path / "mx.pt"
    torch.save({"layer.weight": weight, "layer.weight_scale": scale}, path)
    code, out = run_scan(capsys, path)
    lines = out.splitlines()
    assert code == 1 and lines[0] == f"{path}: 2 tensors, 51 elements: 1 of them hold non-finite values"
    assert lines[2].split() == ["layer.weight_scale", "(3,", "1)", "float8_e8m0fnu", "1", "0", "0"]


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
