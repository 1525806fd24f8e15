"""`python -m nanfast scan` on clean, poisoned, truncated and malicious files, with its exit codes and --json."""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import types
import warnings
import zipfile

import pytest
import torch

from nanfast import scan
from nanfast.checkpoint_paths import checkpoint_files
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


class WholeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.act = torch.nn.GELU(approximate="tanh")


def test_a_whole_pickled_model_is_read_as_data(capsys, tmp_path):
    """torch.save(model) pickles the modules themselves: their classes are read as data, never imported
    or run (NOTE: [Other libraries' objects in checkpoints]), and the weights in them are checked."""
    model = WholeModel()
    with torch.no_grad():
        model.fc.weight[0, 0] = NAN
    path = tmp_path / "model.pt"
    torch.save(model, path)
    result = scan.scan_file(str(path))
    assert result.status == "nonfinite" and [e.name for e in result.report.bad] == ["_modules.fc._parameters.weight"]
    assert sorted(result.stand_ins) == [f"{__name__}.WholeModel", "torch.nn.modules.activation.GELU",
                                        "torch.nn.modules.linear.Linear"]
    code, out = run_scan(capsys, "--json", path)
    assert code == 1 and json.loads(out)["files"][0]["read_as_data"] == list(result.stand_ins)


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
    # The pickle onto the meta device first, its records' sizes checked (NOTE: [Records of a memory-mapped
    # load]), then the mapped read.
    assert [(c["weights_only"], c.get("mmap"), c["map_location"]) for c in calls] == [(True, None, "meta"),
                                                                                     (True, True, "cpu")]


def test_scan_in_chunks_finds_the_same(monkeypatch, poisoned_file):
    whole = scan.scan_file(str(poisoned_file)).report
    monkeypatch.setattr(scan, "CHUNK_BYTES", 1)  # one tensor per fused pass
    assert scan.scan_file(str(poisoned_file)).report == whole


def test_safetensors_without_the_package(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    code, out = run_scan(capsys, path)
    assert code == 2 and "needs the safetensors package (pip install 'nanfast[safetensors]')" in out


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
    # torch.save recurses (loading does not). From Python 3.12 on the C pickler's depth is fixed, whatever
    # sys.setrecursionlimit says (this test failed there), so the file is written by the pure-Python one.
    pure_pickle = types.SimpleNamespace(**vars(pickle))
    pure_pickle.Pickler = pickle._Pickler
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)
    try:
        torch.save(deep, path, pickle_module=pure_pickle)
    finally:
        sys.setrecursionlimit(limit)
    code, out = run_scan(capsys, path)
    # 5001 steps: 16 at each end are written, the levels between counted (tests/test_tree.py).
    assert code == 1 and out.splitlines()[2].split()[0] == ".".join(["a"] * 16) + "<4969-levels>." + ".".join(
        ["a"] * 15 + ["w"])


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


def rezip_deflated(src, dst):
    """The same records, compressed: torch.load reads it, but mmap=True would map the compressed bytes."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))


def test_scan_compressed_zip_records(capsys, tmp_path):
    weight = torch.zeros(111)
    weight[10] = NAN  # mapped raw, its compressed bytes read as 111 finite floats: "clean"
    for name, state, code, last in [("poisoned", {"w": weight}, 1, ["w", "(111,)", "float32", "1", "0", "0"]),
                                    ("clean", {"w": torch.arange(1000.0)}, 0, ["clean"])]:
        stored, deflated = tmp_path / f"{name}.pt", tmp_path / f"{name}-deflated.pt"
        torch.save(state, stored)
        rezip_deflated(stored, deflated)
        assert {i.compress_type for i in zipfile.ZipFile(deflated).infolist()} == {zipfile.ZIP_DEFLATED}
        assert run_scan(capsys, deflated)[0] == code
        scanned = scan.scan_file(str(deflated))
        assert scanned.report == scan.scan_file(str(stored)).report
        assert format_last_row(scanned) == last


def format_last_row(scanned):
    return scan.format_scan(scanned).splitlines()[-1].split()[-6 if scanned.status == "nonfinite" else -1:]


def test_scan_checks_the_values_of_sparse_tensors(capsys, tmp_path):
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 0, 2]]), torch.tensor([1.0, NAN, 2.0]), (4,))  # uncoalesced
    csr = torch.eye(3).to_sparse_csr()
    csr.values()[1] = INF
    path = tmp_path / "sparse.pt"
    torch.save({"coo": coo, "csr": csr, "bsc": torch.eye(4).to_sparse_bsc((2, 2))}, path)
    code, out = run_scan(capsys, path)
    lines = out.splitlines()
    # The COO tensor's two entries at index 0 are summed as its values are: 2 values, not 3 stored.
    assert code == 1 and lines[0] == f"{path}: 3 tensors, 13 elements: 2 of them hold non-finite values"
    assert [line.split()[0] for line in lines[2:]] == ["coo.values()", "csr.values()"]


def test_scan_never_calls_a_file_clean_without_reading_every_tensor(capsys, tmp_path):
    path = tmp_path / "meta.pt"
    torch.save({"w": torch.ones(3), "m": torch.empty(2, device="meta")}, path)
    code, out = run_scan(capsys, path)
    assert code == 2
    assert out.strip() == f"{path}: 1 tensor, 3 elements checked: no NaN/inf; 1 not checked: 'm' (a meta tensor: it holds no values)"
    scanned = json.loads(run_scan(capsys, "--json", path)[1])["files"][0]
    assert scanned["status"] == "incomplete" and scanned["not_checked"] == [
        {"name": "m", "reason": "a meta tensor: it holds no values"}]


def test_a_tensor_the_kernels_refuse_is_named_not_checked(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(scan, "reads_dtype", lambda dtype: True)  # so bits16 reaches the kernels
    path = tmp_path / "bits16.pt"
    torch.save({"a": torch.tensor([NAN]), "scale": torch.zeros(4, dtype=torch.int16).view(torch.bits16),
                "b": torch.ones(2)}, path)
    code, out = run_scan(capsys, path)
    assert code == 2 and out.startswith(f"{path}: 2 tensors, 3 elements: 1 of them hold non-finite values; "
                                        "1 not checked: 'scale' (nanfast.check_all: 'scale': nanfast.stats: ")
    assert "unsupported dtype Bits16" in out.splitlines()[0] and out.splitlines()[2].split()[0] == "a"


def test_scan_refuses_fifos_and_devices_at_once(capsys, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    paths = [fifo] + [p for p in ("/dev/zero", "/dev/urandom") if os.path.exists(p)]
    result = []
    # Reading a FIFO with no writer blocks forever: run in a thread, so a regression fails instead of hanging.
    worker = threading.Thread(target=lambda: result.append(run_scan(capsys, *paths)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert result, "scan blocked on a FIFO"
    code, out = result[0]
    assert code == 2
    kinds = ["a FIFO"] + ["a character device"] * (len(paths) - 1)
    assert out.splitlines() == [f"{p}: refused: {kind}, not a regular file: nanfast scans files only (reading it "
                                "could block or never end)" for p, kind in zip(paths, kinds)]


def test_scan_reads_a_sparse_tensor_saved_before_a_quantized_one(capsys, tmp_path):
    """The mapped load's trial on the meta device fails at a quantized tensor, after it rebuilt a sparse
    one, which torch keeps in its list of sparse tensors to validate: the real load then validated that
    meta tensor and failed, and scan called the file damaged (exit 2), its NaN unreported (a probe,
    session 42). Saved in the other order it was read."""
    sparse = torch.tensor([[0.0, NAN], [1.0, 0.0]]).to_sparse()
    quantized = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.1, 0, torch.qint8)
    path = tmp_path / "sparse_then_quantized.pt"
    torch.save({"sp": sparse, "q": quantized}, path)
    code, out = run_scan(capsys, path)
    assert code == 1 and [line.split()[0] for line in out.splitlines()[2:]] == ["sp.values()"]
    assert list(torch.load(path, weights_only=True)) == ["sp", "q"]  # and torch's next load is unharmed


def test_a_directory_scan_reads_torch_save_files_of_any_name(capsys, tmp_path):
    """accelerate's save_state writes random_states_0.pkl and custom_checkpoint_0.pkl (an object registered
    for checkpointing) with torch.save: a directory scan left them out and called the directory clean
    with a NaN in one (a probe, session 42). A file that is not a torch.save (a plain pickle, a README)
    stays out."""
    torch.save({"step": torch.tensor(3), "ema_loss": torch.tensor([NAN])}, tmp_path / "custom_checkpoint_0.pkl")
    torch.save({"w": torch.ones(2)}, tmp_path / "optimizer.bin")
    (tmp_path / "notes.pkl").write_bytes(pickle.dumps({"lr": 0.1}))
    (tmp_path / "README.md").write_text("a run")
    code, out = run_scan(capsys, tmp_path)
    assert code == 1 and [line.split(":")[0] for line in out.splitlines() if line.startswith(str(tmp_path))] == [
        str(tmp_path / "custom_checkpoint_0.pkl"), str(tmp_path / "optimizer.bin")]
    assert "ema_loss" in out


def test_scan_reads_quantized_nested_and_e8m0_tensors(capsys, tmp_path):
    scale = torch.tensor([1.0, 2.0, 4.0, 1.0]).to(torch.float8_e8m0fnu)
    scale.view(torch.uint8)[3] = 0xFF  # float8_e8m0fnu's NaN: it has no inf
    channel_scales = torch.tensor([0.1, INF])
    quantized = torch.quantize_per_channel(torch.ones(2, 3), channel_scales, torch.zeros(2, dtype=torch.long), 0,
                                           torch.qint8)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.tensor([1.0, NAN, 3.0])])
    path = tmp_path / "kinds.pt"
    torch.save({"scale": scale, "q": quantized, "nested": nested, "q_ok": torch.quantize_per_tensor(
        torch.ones(3), 0.5, 0, torch.quint8)}, path)
    code, out = run_scan(capsys, path)
    assert code == 1 and out.splitlines()[0] == f"{path}: 4 tensors, 18 elements: 3 of them hold non-finite values"
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["scale", "q.dequantize()", "nested.values()"]


def test_scan_nested_jagged_tensor_in_a_fresh_process(tmp_path):
    # Loading one needs torch._dynamo imported (torch allows its names only then); a fresh process has not.
    njt = torch.nested.nested_tensor([torch.ones(2, 3), torch.tensor([[1.0, 2.0, -INF]])], layout=torch.jagged)
    path = tmp_path / "njt.pt"
    torch.save({"njt": njt}, path)
    done = subprocess.run([sys.executable, "-m", "nanfast", "scan", str(path)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[2].split() == ["njt.values()", "(3,", "3)", "float32", "0", "0", "1"]


def test_scan_names_what_a_non_checkpoint_is_without_calling_it_malicious(capsys, tmp_path):
    plain, garbage, protocol4 = tmp_path / "plain.pkl", tmp_path / "garbage.bin", tmp_path / "protocol4.pt"
    with open(plain, "wb") as f:
        pickle.dump({"a": 1}, f)
    garbage.write_bytes(bytes(range(256)) * 8)
    torch.save({"w": torch.ones(2)}, protocol4, pickle_protocol=4)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    code, out = run_scan(capsys, plain, garbage, protocol4, empty)
    assert code == 2 and "run" not in out
    assert out.splitlines() == [
        f"{plain}: unreadable: not a checkpoint: a plain pickle (as pickle.dump writes), not a torch.save file; "
        "nanfast loads only torch.save and .safetensors files (nothing was checked)",
        f"{garbage}: unreadable: not a checkpoint: neither a torch.save file (zip or legacy) nor a pickle (nothing "
        "was checked)",
        f"{protocol4}: unreadable: its pickle uses an instruction weights-only loading does not read (Unsupported "
        "operand 149; torch.save with pickle_protocol above 2?), so nothing was checked",
        f"{empty}: unreadable: an empty file: nothing to check"]


class FakeTqdm:
    """Records what the scan tells its progress bar."""

    made: list["FakeTqdm"] = []

    def __init__(self, total, **kwargs):
        self.total, self.steps = total, []
        FakeTqdm.made.append(self)

    def update(self, n):
        self.steps.append(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_progress_bar_on_a_terminal_only(capsys, monkeypatch, tmp_path, clean_file, poisoned_file):
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeTqdm))
    monkeypatch.setattr(scan, "CHUNK_BYTES", 1)  # a progress step per tensor
    FakeTqdm.made = []
    run_scan(capsys, clean_file, poisoned_file)
    assert FakeTqdm.made == []  # not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, _ = run_scan(capsys, clean_file, poisoned_file, tmp_path / "missing.pt")
    total = clean_file.stat().st_size + poisoned_file.stat().st_size
    assert code == 2 and [(bar.total, sum(bar.steps)) for bar in FakeTqdm.made] == [(total, total)]
    assert len([step for step in FakeTqdm.made[0].steps if step > 0]) >= 5  # a step per tensor (chunk), not per file
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed: no bar, same result
    assert run_scan(capsys, clean_file, poisoned_file)[0] == 1


def test_scan_finds_tensors_in_sets_and_tensor_attributes(capsys, tmp_path):
    weight = torch.nn.Parameter(torch.ones(2))
    weight.scale = torch.tensor([INF])  # torch.save keeps a tensor's attributes
    path = tmp_path / "hidden.pt"
    torch.save({"w": weight, "s": {torch.tensor([NAN])}}, path)
    code, out = run_scan(capsys, path)
    assert code == 1 and out.splitlines()[0] == f"{path}: 3 tensors, 4 elements: 2 of them hold non-finite values"
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["w.scale", "s{0}"]


def test_python_floats_are_read_as_check_all_reads_them(capsys, tmp_path):
    """A checkpoint's Python floats are values too: a NaN learning rate in the optimizer's state resumes
    into NaN training; a scheduler's initial best score is a sentinel (ReduceLROnPlateau's `best` and
    `mode_worse` are inf in its state_dict)."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    path = tmp_path / "checkpoint.pt"
    torch.save(state, path)
    result = scan.scan_file(str(path))
    assert result.status == "clean" and [e.name for e in result.report.sentinels] == ["scheduler.mode_worse",
                                                                                      "scheduler.best"]
    state["optimizer"]["param_groups"][0]["lr"] = NAN
    torch.save(state, path)
    code, out = run_scan(capsys, path)
    assert code == 1 and "optimizer.param_groups[0].lr  ()" in out


def test_a_checkpoint_with_no_tensor_is_empty_not_clean(capsys, tmp_path):
    """A file read whole that holds no values (a torch.save of integers and strings; a .safetensors file
    with no tensor; the wrong file of a checkpoint folder) is named empty: nothing was checked, so it is
    not called clean; nothing in it is unreadable or non-finite, so the exit code is 0 (2 if another file
    is unreadable, 1 if another holds NaN/inf, as before). Its floats would be read (see the next test)."""
    args = tmp_path / "training_args.bin"
    torch.save({"output_dir": "out", "seed": 42, "fp16": False, "warmup_steps": 0}, args)
    paths = [args]
    safetensors_torch = pytest.importorskip("safetensors.torch")
    empty_safetensors = tmp_path / "empty.safetensors"
    safetensors_torch.save_file({}, empty_safetensors)
    paths.append(empty_safetensors)
    code, out = run_scan(capsys, *paths)
    assert code == 0
    assert out.splitlines() == [f"{path}: no tensors in it: nothing checked" for path in paths]
    assert {scan.scan_file(str(path)).status for path in paths} == {"empty"}
    code, out = run_scan(capsys, "--json", args)
    assert (code, json.loads(out)["files"][0]["status"]) == (0, "empty")
    one = tmp_path / "one.pt"
    torch.save({"w": torch.ones(3)}, one)
    assert run_scan(capsys, one) == (0, f"{one}: 1 tensor, 3 elements: clean\n")


# --------------------------------------------------------------------------------------------------
# files other tools made: Lightning's checkpoints (NOTE: [Sentinel infinities])
# --------------------------------------------------------------------------------------------------

def _lightning_checkpoint(tmp_path, monitor: bool, nan_validation: bool = False):
    """A checkpoint saved by the real Lightning Trainer after two steps of a tiny model, with its default
    ModelCheckpoint (kth_value = +inf) and, with `monitor`, an EarlyStopping waiting for a metric logged at
    validation (best_score = -inf in mode "max"; no validation runs, so it stays there). With
    `nan_validation`, the one a ModelCheckpoint monitoring a validation loss saved, the validation data
    holding a NaN."""
    import logging
    import warnings

    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).square().mean()

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.layer(batch[0]).square().mean())

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    callbacks = [L.pytorch.callbacks.EarlyStopping(monitor="val_acc", mode="max", check_on_train_epoch_end=False)] \
        if monitor else []
    if nan_validation:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "saved"), monitor="val_loss"))
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=callbacks)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    validation = torch.randn(8, 4)
    validation[0, 0] = NAN
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), data, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(validation), batch_size=4)
                    if nan_validation else None)
    if nan_validation:
        (saved,) = (tmp_path / "saved").iterdir()
        return saved
    path = tmp_path / "lightning.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_a_healthy_lightning_checkpoint_is_clean_and_its_callbacks_sentinels_are_listed_apart(capsys, tmp_path):
    path = _lightning_checkpoint(tmp_path, monitor=True)
    raw = torch.load(path, weights_only=True)
    assert "pytorch-lightning_version" in raw  # what the scan recognises
    result = scan.scan_file(str(path))
    assert result.status == "clean" and scan.exit_code([result]) == 0
    found = sorted((e.name.rsplit(".", 1)[-1], e.posinf, e.neginf) for e in result.report.sentinels)
    assert found == [("best_score", 0, 1), ("kth_value", 1, 0)]
    code, out = run_scan(capsys, path)
    assert code == 0 and ": clean; left out, as infinities a best or worst score or a running min or max" in out
    assert "kth_value (+inf)" in out


def test_a_lightning_checkpoint_with_a_nan_weight_or_a_nan_callback_score_is_still_non_finite(tmp_path):
    path = _lightning_checkpoint(tmp_path, monitor=False)
    raw = torch.load(path, weights_only=True)
    raw["state_dict"]["layer.weight"][0, 0] = NAN
    (sentinel,) = [key for key in raw["callbacks"] if key.startswith("ModelCheckpoint")]
    raw["callbacks"][sentinel]["kth_value"] = torch.tensor(NAN)  # a NaN is never a sentinel
    torch.save(raw, path)
    result = scan.scan_file(str(path))
    assert result.status == "nonfinite" and result.report.sentinels == []
    assert sorted(e.name.rsplit(".", 1)[-1] for e in result.report.bad) == ["kth_value", "weight"]
    # An infinity in a one-element tensor not named as a score, or in a larger one named so, is reported.
    other = tmp_path / "other.pt"
    torch.save({"callbacks": {"x": {"value": torch.tensor(INF), "best_scores": torch.tensor([INF, 1.0])}}}, other)
    assert [e.name for e in scan.scan_file(str(other)).report.bad] == ["callbacks.x.value", "callbacks.x.best_scores"]


def test_a_lightning_checkpoint_of_a_diverged_validation_loss_is_non_finite(capsys, tmp_path):
    """ModelCheckpoint(monitor="val_loss") turns a NaN validation loss into +inf, stored as best_model_score
    (and current_score, one tensor): taken for a best score's starting value, it was left out and the
    checkpoint called clean (exit 0). best_model_score starts at None: an infinity there is the metric's."""
    path = _lightning_checkpoint(tmp_path, monitor=False, nan_validation=True)
    result = scan.scan_file(str(path))
    assert result.status == "nonfinite" and scan.exit_code([result]) == 1
    # current_score and kth_value are that tensor too: read once, under its first name.
    assert [e.name.rsplit(".", 1)[-1] for e in result.report.bad] == ["best_model_score"]


# --------------------------------------------------------------------------------------------------
# numpy arrays (NOTE: [numpy arrays in checkpoints]), directories and sharded checkpoints' indexes
# --------------------------------------------------------------------------------------------------

def test_numpy_arrays_in_a_checkpoint_are_checked_and_an_object_array_runs_nothing(capsys, tmp_path):
    np = pytest.importorskip("numpy")
    path = tmp_path / "arrays.pt"
    torch.save({"stats": np.array([1.0, NAN, -INF], dtype=np.float32), "counts": np.arange(5, dtype=np.uint32),
                "weight": torch.ones(2), "names": np.array([None, 3], dtype=object)}, path)
    result = scan.scan_file(str(path))
    assert result.status == "nonfinite" and [(e.name, e.nan, e.neginf) for e in result.report.bad] == [("stats", 1, 1)]
    assert result.report.num_tensors == 3 and [name for name, _ in result.not_checked] == ["names"]
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil_array.pt"
    torch.save({"a": np.array([RunsCode(marker)], dtype=object)}, evil)  # the array's item asks to run code
    code, out = run_scan(capsys, evil)
    assert code == 2 and "refused: its pickle asks to run" in out and not marker.exists()


def test_npy_and_npz_files_are_read_without_pickles(capsys, tmp_path):
    np = pytest.importorskip("numpy")
    np.save(tmp_path / "one.npy", np.array([[1.0, INF]], dtype=np.float16))
    np.savez(tmp_path / "many.npz", w=np.array([NAN, 1.0]), ids=np.arange(4), tags=np.array(["a", "b"]),
             big=np.array([INF], dtype=">f4"))  # strings hold no values (as check_all); big-endian is read
    np.save(tmp_path / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    one, many, pickled = (scan.scan_file(str(tmp_path / name)) for name in ("one.npy", "many.npz", "pickled.npy"))
    assert [(e.name, e.posinf) for e in one.report.bad] == [("one.npy", 1)]
    assert [(e.name, e.nan, e.posinf) for e in many.report.bad] == [("w", 1, 0), ("big", 0, 1)]
    assert many.report.num_tensors == 3 and many.not_checked == ()
    assert pickled.status == "refused" and "an array of Python objects (a pickle)" in pickled.error
    # An .npz member of objects is left out, not the whole file: its other members are still read.
    np.savez(tmp_path / "objects.npz", ok=np.ones(2), bad=np.array([None], dtype=object), w=np.array([NAN]))
    objects = scan.scan_file(str(tmp_path / "objects.npz"))
    assert objects.status == "nonfinite" and [(e.name, e.nan) for e in objects.report.bad] == [("w", 1)]
    assert [name for name, _ in objects.not_checked] == ["bad"] and "Python objects" in objects.not_checked[0][1]
    np.savez(tmp_path / "clean_objects.npz", ok=np.ones(2), bad=np.array([None], dtype=object))
    assert scan.scan_file(str(tmp_path / "clean_objects.npz")).status == "incomplete"


def test_a_directory_is_its_checkpoint_files_and_an_index_its_shards(capsys, tmp_path, clean_file, poisoned_file):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "sub").mkdir()
    deeper = tmp_path / "sub" / "deeper.pt"
    torch.save({"x": torch.tensor([NAN])}, deeper)  # subdirectories are entered (a Trainer's checkpoint-N/)
    (tmp_path / "linked").symlink_to(tmp_path / "sub", target_is_directory=True)  # links to folders are not
    assert checkpoint_files(str(tmp_path)) == [str(clean_file), str(poisoned_file), str(deeper)]
    code, out = run_scan(capsys, tmp_path)
    assert code == 1 and out.startswith(f"{clean_file}: 2 tensors") and f"{deeper}: 1 tensor" in out
    code, out = run_scan(capsys, tmp_path / "sub" / "..")  # the same directory
    assert code == 1
    empty = tmp_path / "empty"
    (empty / "logs").mkdir(parents=True)
    code, out = run_scan(capsys, empty)
    assert code == 2 and "refused: a directory with no checkpoint file in it or its subdirectories" in out

    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"a": "clean.pt", "b": "poisoned.pth", "c": "clean.pt"}}))
    assert checkpoint_files(str(index)) == [str(clean_file), str(poisoned_file)]
    assert run_scan(capsys, index)[0] == 1
    index.write_text(json.dumps({"weights": []}))
    code, out = run_scan(capsys, index)
    assert code == 2 and "unreadable: not a sharded checkpoint's index" in out
    # An index naming a shard outside its directory is refused, as the DCP reader refuses such links, and
    # a directory holding it says so too (it was followed there, and a directory left the index unsaid).
    index.write_text(json.dumps({"weight_map": {"a": "clean.pt", "b": "../elsewhere/model.safetensors"}}))
    refused = f"{index}: refused: its \"weight_map\" names shards outside its directory (../elsewhere/model.safetensors)"
    code, out = run_scan(capsys, index)
    assert code == 2 and out.count(refused) == 1
    code, out = run_scan(capsys, tmp_path)
    assert code == 2 and out.count(refused) == 1


def test_a_real_hf_trainer_checkpoint_directory(capsys, tmp_path, monkeypatch):
    """What `nanfast scan checkpoint-2/` says of the files the HF Trainer wrote: the weights (safetensors),
    the optimizer's state, the RNG states (numpy's among them), the scheduler's (its learning rates) and
    the training arguments (a pickled TrainingArguments, read as data with stand-ins for transformers'
    and accelerate's classes, none imported: NOTE: [Other libraries' objects in checkpoints]) read and
    clean: exit 0; the JSON files skipped. A NaN learning rate in the arguments is found."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                                                 n_positions=16))
    data = [{"input_ids": torch.randint(0, 50, (8,)), "labels": torch.randint(0, 50, (8,))} for _ in range(4)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, save_steps=2,
                                          per_device_train_batch_size=2, report_to="none", use_cpu=True,
                                          disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    capsys.readouterr()  # the Trainer's own prints
    code, out = run_scan(capsys, "--json", tmp_path / "checkpoint-2")
    files = {os.path.basename(f["path"]): f for f in json.loads(out)["files"]}
    assert {name: f["status"] for name, f in files.items()} == {
        "model.safetensors": "clean", "optimizer.pt": "clean", "rng_state.pth": "clean", "scheduler.pt": "clean",
        "training_args.bin": "clean"}
    assert code == 0
    assert "transformers.training_args.TrainingArguments" in files["training_args.bin"]["read_as_data"]
    assert all(not f["read_as_data"] for name, f in files.items() if name != "training_args.bin")
    arguments = tmp_path / "checkpoint-2" / "training_args.bin"
    # In a process that has not imported them, the scan imports neither library.
    probe = ("import sys; from nanfast import scan; r = scan.scan_file(sys.argv[1]); "
             "print(r.status, sorted(m for m in ('transformers', 'accelerate') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, str(arguments)], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["clean", "[]"], done.stderr
    code, out = run_scan(capsys, arguments)
    assert code == 0 and ": clean; objects of" in out and "read as data, never imported:" in out
    args.learning_rate = NAN
    torch.save(args, arguments)
    code, out = run_scan(capsys, arguments)
    assert code == 1 and "learning_rate" in out


def test_a_timm_training_directory_is_scanned(capsys, tmp_path):
    """timm's train.py saves through its CheckpointSaver: checkpoint-N.pth.tar, last.pth.tar and
    model_best.pth.tar, with its argparse arguments inside. `scan DIR` on such a directory said "no
    checkpoint file" and checked nothing."""
    pytest.importorskip("timm")  # in the test extra
    from timm.utils import CheckpointSaver

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saver = CheckpointSaver(model, optimizer, args=argparse.Namespace(model="mlp", lr=0.1), checkpoint_dir=str(tmp_path),
                            recovery_dir=str(tmp_path), decreasing=True)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    saver.save_checkpoint(0, metric=1.0)
    with torch.no_grad():
        model[2].weight[1, 3] = NAN
    saver.save_checkpoint(1, metric=2.0)  # worse: model_best stays epoch 0's
    files = checkpoint_files(str(tmp_path))
    assert [os.path.basename(f) for f in files] == ["checkpoint-0.pth.tar", "checkpoint-1.pth.tar", "last.pth.tar",
                                                    "model_best.pth.tar"]
    code, out = run_scan(capsys, tmp_path)
    assert code == 1
    verdicts = {os.path.basename(line.split(":")[0]): line for line in out.splitlines() if line.startswith(str(tmp_path))}
    assert "clean" in verdicts["checkpoint-0.pth.tar"] and "clean" in verdicts["model_best.pth.tar"]
    for bad in ("checkpoint-1.pth.tar", "last.pth.tar"):
        assert "1 of them hold non-finite values" in verdicts[bad]
        assert "objects of 1 other class read as data, never imported: argparse.Namespace" in verdicts[bad]
    assert "state_dict.2.weight" in out


# --------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint directories (NOTE: [Distributed checkpoints]; a sharded one in
# test_distributed.py)
# --------------------------------------------------------------------------------------------------

def _dcp_checkpoint(tmp_path, nan=False):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    if nan:
        with torch.no_grad():
            model[1].bias[0] = NAN
    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves as a single process
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": {"lr": 0.5, "lrs": [0.1, 0.2]}},
                 checkpoint_id=str(path))
    return path


def test_a_distributed_checkpoint_directory_is_read_item_by_item(capsys, tmp_path):
    path = _dcp_checkpoint(tmp_path)
    assert checkpoint_files(str(path)) == [str(path)]
    result = scan.scan_file(str(path))
    names = [e.name for e in result.report.entries]
    assert result.status == "clean" and result.not_checked == ()
    assert {"model.0.weight", "optim.state.0.exp_avg_sq", "optim.param_groups.0.lr", "extra.lr", "extra.lrs[1]"} <= set(names)
    assert run_scan(capsys, path)[0] == 0
    poisoned = _dcp_checkpoint(tmp_path / "poisoned", nan=True)
    code, out = run_scan(capsys, poisoned)
    assert code == 1 and "model.1.bias" in out


def test_every_item_of_a_distributed_checkpoint_is_read_though_freed_addresses_come_back(monkeypatch, tmp_path):
    """DCP items are loaded one at a time and freed once their chunk is checked, so the next item of the
    same size may get the same address. A scan that took a tensor at a seen address for a view already
    read skipped 16 of 80 [1024, 1024] layers of a 320 MiB checkpoint, one of them holding a NaN, and
    said "clean" (a probe, session 48). Small chunks make the allocator hand addresses back here."""
    import torch.distributed.checkpoint as dcp

    layers = {f"layers.{i}.weight": torch.zeros(64, 64) for i in range(40)}
    layers["layers.39.weight"][5, 5] = NAN
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves as a single process
        dcp.save(layers, checkpoint_id=str(tmp_path / "dcp"))
    monkeypatch.setattr(scan, "CHUNK_BYTES", 64 * 64 * 4)  # one layer per fused pass, then freed
    result = scan.scan_file(str(tmp_path / "dcp"))
    assert sorted(e.name for e in result.report.entries) == sorted(layers)
    assert result.status == "nonfinite" and [e.name for e in result.report.bad] == ["layers.39.weight"]


def test_a_distributed_checkpoints_metadata_runs_nothing(capsys, tmp_path):
    path = _dcp_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    code, out = run_scan(capsys, path)
    assert code == 2 and "refused: its .metadata names" in out and not marker.exists()
    (path / ".metadata").write_bytes(b"not a pickle")
    code, out = run_scan(capsys, path)
    assert code == 2 and "unreadable: its .metadata is not a distributed checkpoint's metadata" in out


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_a_distributed_checkpoints_paths_are_read_as_either_python_names_them(capsys, tmp_path, module):
    """Python 3.13 moved pathlib's classes to pathlib._local and pickles them under that name: every DCP
    checkpoint saved on 3.13 was refused (found running the suite on 3.13). A .metadata naming either
    module is read on every Python."""
    path = _dcp_checkpoint(tmp_path)
    metadata = pickle.loads((path / ".metadata").read_bytes())  # ours: written just above
    written = pickle.dumps(metadata, protocol=2)  # protocol 2 names a class as text: c<module>\n<name>\n
    renamed, paths = re.subn(rb"c(pathlib|pathlib\._local)\n(\w*Path)\n", b"c" + module.encode() + rb"\n\2\n", written)
    assert paths >= 1  # the metadata holds a path (its storage's checkpoint id)
    (path / ".metadata").write_bytes(renamed)
    code, out = run_scan(capsys, path)
    assert code == 0 and ": clean" in out


def test_a_distributed_checkpoint_item_that_runs_code_is_named_and_not_run(tmp_path):
    """An item is a torch.save of its own, loaded weights-only: one that names a function is listed as not
    checked, saying so, and the function never runs (the others are read)."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves as a single process
        dcp.save({"w": torch.ones(2), "extra": {"hook": RunsCode(marker)}}, checkpoint_id=str(tmp_path / "dcp"))
    result = scan.scan_file(str(tmp_path / "dcp"))
    assert not marker.exists()
    assert result.status == "incomplete" and [e.name for e in result.report.entries] == ["w"]
    assert [name for name, _ in result.not_checked] == ["extra.hook"] and "asks to run" in result.not_checked[0][1]


def test_a_distributed_checkpoint_item_outside_its_directory_is_not_read(capsys, tmp_path):
    path = _dcp_checkpoint(tmp_path)
    metadata = pickle.loads((path / ".metadata").read_bytes())  # ours: written just above
    index = next(i for i in metadata.storage_data if i.fqn == "model.0.weight")
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="../elsewhere.distcp")
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    result = scan.scan_file(str(path))
    assert result.status == "incomplete" and [name for name, _ in result.not_checked] == ["model.0.weight"]
    assert "is not a file in the checkpoint's directory" in result.not_checked[0][1]


def test_a_damaged_item_of_a_distributed_checkpoint_is_named_not_checked(tmp_path):
    path = _dcp_checkpoint(tmp_path)
    (distcp,) = path.glob("*.distcp")
    data = bytearray(distcp.read_bytes())
    metadata = pickle.loads((path / ".metadata").read_bytes())  # ours: written just above
    where = next(w for i, w in metadata.storage_data.items() if i.fqn == "model.1.weight")
    data[where.offset + where.length // 2: where.offset + where.length // 2 + 64] = bytes(64)  # zeroes mid-item
    distcp.write_bytes(bytes(data))
    result = scan.scan_file(str(path))
    assert result.status == "incomplete" and [name for name, _ in result.not_checked] == ["model.1.weight"]
    assert "model.0.weight" in [e.name for e in result.report.entries]  # the others still read
