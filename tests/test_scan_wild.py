"""`nanfast scan` on what other tools and real directories leave behind, found by probing in session 37:
numpy scalars (a saved `np.mean(losses)`), pickles of protocol 2 (torch.save's default) that name code
by its Python 2 module names, directories with entries that cannot be read or shards that are missing,
TorchScript archives (NOTE: [TorchScript archives]), and (session 41) an index listing a tensor its
shard lacks."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import warnings
import zipfile

import pytest
import torch

from nanfast import scan
from nanfast.checkpoint_paths import checkpoint_files
from test_scan import NAN, INF, RunsCode, run_scan


def test_numpy_scalars_in_a_checkpoint_are_checked(capsys, tmp_path):
    """numpy pickles a scalar as numpy._core.multiarray.scalar(dtype, bytes); it was read as an inert
    stand-in whose bytes were no values, and a NaN val_loss scanned clean."""
    np = pytest.importorskip("numpy")
    path = tmp_path / "trainer_state.pt"
    torch.save({"val_loss": np.mean(np.array([1.0, NAN])), "max_logit": np.float32(INF), "acc": np.float16(0.5),
                "epoch": np.int64(3), "weight": torch.ones(2)}, path)
    result = scan.scan_file(str(path))
    assert result.status == "nonfinite" and result.stand_ins == ()
    assert [(e.name, e.dtype, e.nan, e.posinf) for e in result.report.bad] == [
        ("val_loss", "float64", 1, 0), ("max_logit", "float32", 0, 1)]
    assert result.report.num_tensors == 5
    torch.save({"val_loss": np.float64(0.25), "weight": torch.ones(2)}, path)
    assert run_scan(capsys, path)[0] == 0


def test_a_numpy_scalar_in_a_distributed_checkpoint_is_checked(tmp_path):
    np = pytest.importorskip("numpy")
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves as a single process
        dcp.save({"w": torch.ones(2), "extra": {"loss": np.float64(NAN)}}, checkpoint_id=str(tmp_path / "dcp"))
    result = scan.scan_file(str(tmp_path / "dcp"))
    assert result.status == "nonfinite" and [e.name for e in result.report.bad] == ["extra.loss"]


class CallsSubprocess:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return subprocess.call, (["touch", self.marker],)


@pytest.mark.parametrize("protocol", [2, 3])
def test_code_named_by_its_python_2_module_is_refused(capsys, tmp_path, protocol):
    """A pickle of protocol 2 (torch.save's default) names subprocess.call as commands.call, which the
    unpickler maps back to subprocess: it was given an inert stand-in and scanned clean."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": CallsSubprocess(marker)}, evil, pickle_protocol=protocol)
    code, out = run_scan(capsys, evil)
    named = "commands.call" if protocol == 2 else "subprocess.call"
    assert code == 2 and out.startswith(f"{evil}: refused: its pickle asks to run {named};")
    assert not marker.exists()


def test_a_directory_reports_entries_it_cannot_read(capsys, tmp_path, monkeypatch):
    """A Hugging Face cache snapshot links its files to blobs; a deleted blob leaves a dangling link. A
    directory scan dropped such entries (and loops, FIFOs) without a word and said clean."""
    torch.save({"w": torch.ones(2)}, tmp_path / "optimizer.pt")
    os.symlink(tmp_path / "blobs" / "gone", tmp_path / "pytorch_model.bin")
    os.symlink("loop2.pt", tmp_path / "loop1.pt")
    os.symlink("loop1.pt", tmp_path / "loop2.pt")
    os.mkfifo(tmp_path / "rng_state.pth")
    (tmp_path / "sub.pt").mkdir()  # a subdirectory: not entered, as before
    code, out = run_scan(capsys, tmp_path)
    verdicts = {os.path.basename(line.split(": ", 1)[0]): line.split(": ", 2)[1] for line in out.splitlines()}
    assert verdicts == {"optimizer.pt": "1 tensor, 2 elements", "pytorch_model.bin": "unreadable",
                        "loop1.pt": "unreadable", "loop2.pt": "unreadable", "rng_state.pth": "refused"}
    assert code == 2


def test_a_directory_with_an_index_reports_a_missing_shard(capsys, tmp_path):
    for shard in ("model-00001-of-00003.pt", "model-00003-of-00003.pt"):
        torch.save({shard: torch.ones(2)}, tmp_path / shard)
    weight_map = {f"w{i}": f"model-0000{i}-of-00003.pt" for i in (1, 2, 3)}
    (tmp_path / "model.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    files = checkpoint_files(str(tmp_path))
    assert [os.path.basename(f) for f in files] == sorted(weight_map.values())
    code, out = run_scan(capsys, tmp_path)
    assert code == 2
    assert f"{tmp_path / 'model-00002-of-00003.pt'}: unreadable: [Errno 2] No such file or directory" in out


@pytest.mark.parametrize("make", ["script", "trace"])
def test_a_torchscript_archive_is_read_without_its_code(capsys, tmp_path, make):
    """torch.jit.save files are .pt files too: the scan said "damaged or truncated" (torch.load hands them
    to torch.jit.load, and torch warned so). Its module's tensors are read as a state_dict names them,
    weights-only, its classes through stand-ins (NOTE: [TorchScript archives]); a traced model's example
    inputs, which the file does not hold, are not asked for."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    scripted = torch.jit.script(model) if make == "script" else torch.jit.trace(model, torch.ones(1, 3))
    path = tmp_path / "model.pt"
    torch.jit.save(scripted, str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.load's dispatch warning: torch.load is not called on it
        code, out = run_scan(capsys, path)
    assert code == 0 and out.startswith(f"{path}: 2 tensors, 8 elements: clean; objects of 2 other classes read as data")
    with torch.no_grad():
        model[0].weight[1, 2] = NAN
    scripted = torch.jit.script(model) if make == "script" else torch.jit.trace(model, torch.ones(1, 3))
    torch.jit.save(scripted, str(path))
    result = scan.scan_file(str(path))
    assert result.status == "nonfinite" and [(e.name, e.nan) for e in result.report.bad] == [("0.weight", 1)]


class TimesConstant(torch.nn.Module):
    def forward(self, x):
        return x * torch.tensor([1.0, INF])


def test_a_torchscript_archives_tensor_constants_are_read(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warning about the constant
        traced = torch.jit.trace(TimesConstant(), torch.ones(2))
    path = tmp_path / "constant.pt"
    torch.jit.save(traced, str(path))
    result = scan.scan_file(str(path))
    assert result.status == "nonfinite" and [(e.name, e.posinf) for e in result.report.bad] == [("constants.pkl[0]", 1)]


def test_a_torchscript_archive_whose_pickle_names_code_is_refused(capsys, tmp_path):
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(evil, "w") as target:
        for name in source.namelist():
            data = pickle.dumps(RunsCode(marker), protocol=2) if name.endswith("/data.pkl") else source.read(name)
            target.writestr(name, data)
    code, out = run_scan(capsys, evil)
    assert code == 2 and "refused: its pickle asks to run" in out and not marker.exists()


# --- hostile files (a probe of crafted files, session 37) -------------------------------------------


def test_a_record_shorter_than_its_storage_is_unreadable_not_read_on_into_the_zip(capsys, tmp_path):
    """Memory-mapped, torch took the storage's 160 bytes from the record's start: 16 bytes of it and the
    zip's next records and directory as values, and the file scanned clean (NOTE: [Records of a
    memory-mapped load])."""
    path = tmp_path / "short.pt"
    torch.save({"w": torch.ones(40)}, path)
    with zipfile.ZipFile(path) as z:
        records = {name: z.read(name) for name in z.namelist()}
    with zipfile.ZipFile(path, "w") as z:
        for name, data in records.items():
            z.writestr(name, data[:16] if name.endswith("/data/0") else data)
    code, out = run_scan(capsys, path)
    assert code == 2 and "its record data/0 holds 16 bytes but its pickle asks for 160" in out


class LoadsFromTheHub:
    def __reduce__(self):
        return torch.hub.load, ("attacker/repo", "model")


@pytest.mark.parametrize("with_tensor", [True, False])
def test_a_pickle_naming_code_of_torch_itself_is_refused(capsys, tmp_path, with_tensor):
    """torch.hub.load (and cpp_extension.load_inline, numpy.testing's runstring) got an inert stand-in,
    and the file scanned clean; with no tensor beside it, even the stand-in's name went unsaid."""
    path = tmp_path / "hub.pt"
    torch.save({"w": torch.ones(2), "x": LoadsFromTheHub()} if with_tensor else LoadsFromTheHub(), path)
    code, out = run_scan(capsys, path)
    assert code == 2 and "refused: its pickle asks to run torch.hub.load" in out


def test_a_tensor_named_many_times_is_read_once(tmp_path):
    """A pickle can reference one tensor 200,000 times in a few bytes each; each reference was read."""
    path = tmp_path / "refs.pt"
    t = torch.ones(1000)
    t[3] = NAN
    torch.save({"refs": [t] * 5000, "other": torch.ones(2)}, path)
    result = scan.scan_file(str(path))
    assert [(e.name, e.nan) for e in result.report.bad] == [("refs[0]", 1)] and result.report.num_tensors == 2


def test_a_npy_file_numpy_refuses_is_not_called_a_pickle(capsys, tmp_path):
    np = pytest.importorskip("numpy")
    path = tmp_path / "wide.npy"
    np.save(path, np.zeros(3, dtype=[(f"field{i}", "f4") for i in range(600)]))  # a header over 10 KB
    code, out = run_scan(capsys, path)
    assert code == 2 and "Python objects" not in out and "Header info length" in out


def test_a_distributed_checkpoint_item_past_its_file_or_outside_its_directory_is_not_read(tmp_path):
    """Its declared length was allocated before it was compared with the file (2^40 bytes: MemoryError,
    and the whole checkpoint unreadable); a link to a file outside the directory was followed."""
    from collections import namedtuple

    from nanfast.readers import dcp

    where = namedtuple("where", "relative_path offset length")
    (tmp_path / "__0_0.distcp").write_bytes(b"PK\x03\x04" + bytes(60))
    item = dcp._item(str(tmp_path), where("__0_0.distcp", 0, 2**40))
    assert isinstance(item, scan.NotRead) and "ends before the item's 1099511627776 bytes" in item.reason
    outside = tmp_path.parent / "outside.bin"
    outside.write_bytes(b"PK\x03\x04" + bytes(60))
    os.symlink(outside, tmp_path / "__1_0.distcp")
    item = dcp._item(str(tmp_path), where("__1_0.distcp", 0, 8))
    assert isinstance(item, scan.NotRead) and "not a file in the checkpoint's directory" in item.reason


def test_a_pt2_record_declaring_more_than_the_archive_holds_is_not_allocated(tmp_path):
    pt2 = pytest.importorskip("test_scan_pt2")
    path = pt2.save(tmp_path, pt2.WithConstant())
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        target = next(i.filename for i in z.infolist() if "/data/weights/" in i.filename)
    at = 0
    while (at := data.find(b"PK\x01\x02", at + 1)) != -1:  # the central directory's entries
        name_length = int.from_bytes(data[at + 28:at + 30], "little")
        if data[at + 46:at + 46 + name_length].decode() == target:
            data[at + 24:at + 28] = (2**30).to_bytes(4, "little")  # its uncompressed size: 1 GiB
    path.write_bytes(bytes(data))
    result = scan.scan_file(str(path))
    assert any("more than the archive holds" in why for _, why in result.not_checked), result.not_checked


def test_a_file_too_large_for_memory_is_called_so_not_damaged(capsys, tmp_path, monkeypatch):
    """A bare MemoryError (a compressed record inflating past the machine's memory) printed as
    "damaged or truncated, or not a checkpoint (MemoryError: )"."""
    path = tmp_path / "big.pt"
    torch.save({"w": torch.ones(2)}, path)

    def out_of_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(scan, "torch_load", out_of_memory)
    code, out = run_scan(capsys, path)
    assert code == 2 and "memory is too small to read it" in out and "damaged" not in out
    assert scan.first_sentence(MemoryError()) == "no message"


def test_a_tensor_the_index_lists_but_its_shard_lacks_is_reported(capsys, tmp_path, monkeypatch):
    """A sharded save_pretrained checkpoint whose shard was rewritten without one of its tensors (an
    edited or mixed-up copy: transformers then fails on missing keys) scanned clean, exit 0: every tensor
    the shards held was read, and what the index promised was never compared (session 41). The real
    writer's healthy checkpoint adds nothing."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                 n_positions=16))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1  # really sharded
    code, out = run_scan(capsys, tmp_path)
    assert code == 0 and "index.json" not in out
    name, shard = next((n, s) for n, s in weight_map.items() if n.endswith("attn.c_attn.weight"))
    tensors = load_file(tmp_path / shard)
    del tensors[name]
    save_file(tensors, tmp_path / shard, metadata={"format": "pt"})
    for target in (tmp_path, index):
        code, out = run_scan(capsys, target)
        assert code == 2, out
        assert f"{index}: no tensors in it: nothing checked; 1 not checked: '{name}' (listed in the index for " \
               f"{shard}, which does not hold it)" in out


def test_one_file_of_a_distributed_checkpoint_is_read_through_its_directorys_metadata(capsys, tmp_path):
    """`nanfast scan dir/__0_0.distcp` said "damaged or truncated" of an intact file: a .distcp file is the
    items that its directory's .metadata places in it, read as the directory's are. Alone, or not named by
    the metadata beside it, it is unreadable, saying why, never clean."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves as a single process
        dcp.save({"w": torch.tensor([1.0, NAN]), "b": torch.ones(3), "c": torch.zeros(2)}, checkpoint_id=str(path),
                 storage_writer=dcp.FileSystemWriter(str(path), thread_count=2))
    files = sorted(path.glob("*.distcp"))
    assert len(files) == 2  # the items split over two files
    scans = [scan.scan_file(str(f)) for f in files]
    names = [sorted(e.name for e in s.report.entries) for s in scans]
    assert sorted(sum(names, [])) == ["b", "c", "w"] and all(names)  # each file its own items, all of them once
    assert {s.status for s in scans} == {"clean", "nonfinite"}
    assert next(s for s in scans if s.status == "nonfinite").report.bad[0].name == "w"
    alone = tmp_path / "alone.distcp"
    alone.write_bytes(files[0].read_bytes())
    stray = path / "__9_0.distcp"
    stray.write_bytes(files[0].read_bytes())
    for unread, why in ((alone, "not beside it"), (stray, "names no item stored in __9_0.distcp")):
        result = scan.scan_file(str(unread))
        assert result.status == "unreadable" and why in result.error
    code, out = run_scan(capsys, alone)
    assert code == 2 and "damaged" not in out


@pytest.mark.parametrize("damage", ["sizes", "dtype"])
def test_a_distributed_checkpoint_whose_metadata_misdescribes_an_item_is_not_clean(tmp_path, damage):
    """A flipped bit in a .metadata size (or dtype) leaves every item intact and readable: the scan called
    the checkpoint clean while DCP's own load of it fails. Each tensor chunk is held to its description."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves as a single process
        dcp.save({"w": torch.ones(4, 4), "b": torch.ones(3)}, checkpoint_id=str(path))
    assert scan.scan_file(str(path)).status == "clean"
    metadata = pickle.loads((path / ".metadata").read_bytes())  # ours: written just above
    described = metadata.state_dict_metadata["w"]
    if damage == "sizes":
        described.chunks[0] = dataclasses.replace(described.chunks[0], sizes=torch.Size([4, 5]))
    else:
        described.properties = dataclasses.replace(described.properties, dtype=torch.float16)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    result = scan.scan_file(str(path))
    assert result.status == "incomplete" and [name for name, _ in result.not_checked] == ["w"]
    assert "the metadata or the item is damaged" in result.not_checked[0][1]
    assert [e.name for e in result.report.entries] == ["b"]


def test_a_file_torch_itself_cannot_load_is_not_only_called_damaged(tmp_path):
    """torch.save's legacy format writes a float8 tensor that torch.load then fails on (AttributeError):
    "damaged or truncated, or not a checkpoint" sent the user looking for a broken disk (a probe,
    session 48). Still unreadable, never clean."""
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(4).to(torch.float8_e4m3fn)}, path, _use_new_zipfile_serialization=False)
    try:
        torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001  (what this torch raises for it)
        pass
    else:
        pytest.skip("this torch loads a legacy float8 file")
    result = scan.scan_file(str(path))
    assert result.status == "unreadable" and "or one this torch cannot load (AttributeError" in result.error
