"""nanfast scan on PT2 archives, as torch.export.save writes them (NOTE: [PT2 archives]), and on the layout
it wrote before torch 2.8: the weights, buffers and constants read without loading the program or running
pickled code."""

from __future__ import annotations

import io
import json
import math
import sys
import zipfile

import pytest
import torch

from nanfast import check_all, scan
from nanfast.checkpoint_paths import checkpoint_files
from nanfast.cli import main
from test_scan import RunsCode

pytest.importorskip("torch.export.pt2_archive", reason="this torch writes no PT2 archives")

NAN, INF = math.nan, math.inf
WEIGHTS_CONFIG = "model/data/weights/model_weights_config.json"


class WithConstant(torch.nn.Module):
    """A Linear, a persistent buffer (a weight of the archive) and a tensor attribute (a constant)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("running", torch.ones(3))
        self.offset = torch.full((3,), 0.5)

    def forward(self, x):
        return self.linear(x) * self.running + self.offset


def save(tmp_path, module: torch.nn.Module, width: int = 4):
    """torch.export.save of the module exported on a batch of `width` features."""
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(module, (torch.randn(2, width),)), str(path))
    return path


def run_scan(capsys, *paths) -> tuple[int, str]:
    code = main(["scan", *map(str, paths)])
    return code, capsys.readouterr().out


def rewrite(path, records: dict[str, bytes], drop: str = "\0") -> None:
    """The archive with some records replaced and those whose name holds `drop` left out (the others
    kept), as a hostile or damaged file would be."""
    with zipfile.ZipFile(path) as z:
        kept = {name: z.read(name) for name in z.namelist() if drop not in name}
    kept.update(records)
    with zipfile.ZipFile(path, "w") as z:
        for name, data in kept.items():
            z.writestr(name, data)


def weights_config(path) -> dict:
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read(WEIGHTS_CONFIG))


def test_an_exported_models_weights_buffers_and_constants_are_read(capsys, tmp_path):
    torch.manual_seed(0)
    module = WithConstant()
    path = save(tmp_path, module)
    result = scan.scan_file(str(path))
    assert result.status == "clean" and result.not_checked == ()
    read = {e.name: e for e in result.report.entries}
    assert set(read) == {"linear.weight", "linear.bias", "running", "offset"}
    expected = check_all(dict(module.state_dict(), offset=module.offset), raise_on_nonfinite=False)
    for entry in expected.entries:  # the same counts and norms as the tensors in memory
        assert (read[entry.name].shape, read[entry.name].norm) == (entry.shape, entry.norm)
    assert checkpoint_files(str(tmp_path)) == [str(path)]  # a directory's .pt2 files are scanned
    assert run_scan(capsys, path)[0] == 0


def test_nan_and_inf_in_an_archive_are_named(capsys, tmp_path):
    module = WithConstant()
    with torch.no_grad():
        module.linear.weight[1, 2] = NAN
        module.offset[0] = -INF
    code, out = run_scan(capsys, save(tmp_path, module))
    assert code == 1 and "4 tensors, 21 elements: 2 of them hold non-finite values" in out
    rows = {line.split()[0]: line.split()[-3:] for line in out.splitlines()[2:]}
    assert rows == {"linear.weight": ["1", "0", "0"], "offset": ["0", "0", "1"]}


def test_tied_weights_are_read_under_each_name(tmp_path):
    """Weights that share storage are stored once and listed under each name (the archive keeps aliasing)."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    module[1].weight = module[0].weight
    with torch.no_grad():
        module[0].weight[0, 0] = INF
    result = scan.scan_file(str(save(tmp_path, module, width=3)))
    assert result.status == "nonfinite" and [e.name for e in result.report.bad] == ["0.weight", "1.weight"]


def test_every_weight_is_read_though_freed_addresses_come_back(monkeypatch, tmp_path):
    """An archive's weights are read one at a time and freed once their chunk is checked, so the next
    one of the same size may get the same address: a scan that took it for a view already read said
    "clean" of 80 [1024, 1024] layers with 16 unread, a NaN among them (a probe, session 48)."""
    module = torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(40)))
    with torch.no_grad():
        module[39].weight[5, 5] = NAN
    path = save(tmp_path, module, width=64)
    monkeypatch.setattr(scan, "CHUNK_BYTES", 64 * 64 * 4)  # one weight per fused pass, then freed
    result = scan.scan_file(str(path))
    assert sorted(e.name for e in result.report.entries) == sorted(f"{i}.weight" for i in range(40))
    assert result.status == "nonfinite" and [e.name for e in result.report.bad] == ["39.weight"]


def test_every_model_of_an_archive_is_read_under_its_name(tmp_path):
    from torch.export.pt2_archive._package import package_pt2

    clean, dirty = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with torch.no_grad():
        dirty.bias[1] = NAN
    path = tmp_path / "two.pt2"
    package_pt2(str(path), exported_programs={"encoder": torch.export.export(clean, (torch.randn(1, 2),)),
                                              "decoder": torch.export.export(dirty, (torch.randn(1, 2),))})
    result = scan.scan_file(str(path))
    assert {e.name for e in result.report.entries} == {"encoder.weight", "encoder.bias", "decoder.weight", "decoder.bias"}
    assert [e.name for e in result.report.bad] == ["decoder.bias"]


def test_a_pickled_record_is_read_weights_only_and_one_that_runs_code_is_not(capsys, tmp_path):
    """torch.export.load reads a pickled record (a tensor subclass's) with weights_only=False: a record that
    names a function would run it. nanfast reads pickled records weights-only."""
    path = save(tmp_path, torch.nn.Linear(3, 2), width=3)
    config = weights_config(path)
    config["config"]["weight"]["use_pickle"] = True
    buffer = io.BytesIO()
    torch.save(torch.tensor([[1.0, INF, 0.0]] * 2), buffer)
    record = "model/data/weights/" + config["config"]["weight"]["path_name"]
    rewrite(path, {WEIGHTS_CONFIG: json.dumps(config).encode(), record: buffer.getvalue()})
    code, out = run_scan(capsys, path)
    assert code == 1 and "weight" in out.splitlines()[2]

    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"payload": RunsCode(marker)}, buffer)
    rewrite(path, {record: buffer.getvalue()})
    result = scan.scan_file(str(path))
    assert not marker.exists()
    assert result.status == "incomplete" and [name for name, _ in result.not_checked] == ["weight"]
    assert "asks to run" in result.not_checked[0][1]


@pytest.mark.parametrize("damage", ["outside-its-folder", "short-record", "fake-tensor", "bad-sizes", "unknown-dtype"])
def test_a_damaged_or_hostile_record_is_named_not_checked(tmp_path, damage):
    path = save(tmp_path, torch.nn.Linear(3, 2), width=3)
    config = weights_config(path)
    entry = config["config"]["weight"]
    record = "model/data/weights/" + entry["path_name"]
    records = {}
    if damage == "outside-its-folder":
        entry["path_name"] = "../../models/model.json"
    elif damage == "short-record":
        records[record] = bytes(8)  # 2 float32 of the 6 its sizes need
    elif damage == "fake-tensor":
        records[record] = b""
    elif damage == "bad-sizes":
        entry["tensor_meta"]["sizes"] = [{"as_int": 2}, {"as_sym": "s0"}]
    else:
        entry["tensor_meta"]["dtype"] = 999
    records[WEIGHTS_CONFIG] = json.dumps(config).encode()
    rewrite(path, records)
    result = scan.scan_file(str(path))
    assert result.status == "incomplete" and [name for name, _ in result.not_checked] == ["weight"]
    assert [e.name for e in result.report.entries] == ["bias"]  # the others still read


def test_an_archive_of_the_other_byte_order_is_unreadable_not_misread(capsys, tmp_path):
    path = save(tmp_path, torch.nn.Linear(3, 2), width=3)
    rewrite(path, {"model/byteorder": b"big" if sys.byteorder == "little" else b"little"})
    code, out = run_scan(capsys, path)
    assert code == 2 and "byte order, not this machine's" in out


def test_an_archive_without_weights_is_unreadable_not_clean(capsys, tmp_path):
    path = save(tmp_path, torch.nn.Linear(3, 2), width=3)
    rewrite(path, {}, drop="/data/weights/")
    code, out = run_scan(capsys, path)
    assert code == 2 and "unreadable: a PT2 archive with no weights config" in out


def save_legacy(path, module: torch.nn.Module, width: int) -> None:
    """What torch.export.save wrote before torch 2.8 (its zip layout, in torch/export/__init__.py): the records of
    torch.export's own serializer, flat in the zip."""
    from torch._export.serde.schema import SCHEMA_VERSION
    from torch._export.serde.serialize import serialize

    artifact = serialize(torch.export.export(module, (torch.randn(2, width),)))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("serialized_exported_program.json", artifact.exported_program)
        z.writestr("serialized_state_dict.pt", artifact.state_dict)
        z.writestr("serialized_constants.pt", artifact.constants)
        z.writestr("serialized_example_inputs.pt", artifact.example_inputs)
        z.writestr("version", ".".join(map(str, SCHEMA_VERSION)))


def test_an_archive_from_before_torch_2_8_is_read(capsys, tmp_path):
    module = WithConstant()
    with torch.no_grad():
        module.linear.bias[2] = INF
    path = tmp_path / "old.pt2"
    save_legacy(path, module, width=4)
    result = scan.scan_file(str(path))
    assert {e.name for e in result.report.entries} == {"linear.weight", "linear.bias", "running", "offset"}
    assert result.status == "nonfinite" and [e.name for e in result.report.bad] == ["linear.bias"]

    buffer = io.BytesIO()
    marker = tmp_path / "pwned"
    torch.save({"weight": RunsCode(marker)}, buffer)
    rewrite(path, {"serialized_state_dict.pt": buffer.getvalue()})
    result = scan.scan_file(str(path))
    assert not marker.exists() and result.status == "incomplete"
    assert [name for name, _ in result.not_checked] == ["serialized_state_dict.pt"]
    assert [e.name for e in result.report.entries] == ["offset"]  # the constants are still read
