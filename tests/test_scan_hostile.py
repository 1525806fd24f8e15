"""Crafted checkpoints a probe of the scan made (stop 40): small files that cost exponential time or
memory out of proportion to their size, and pickles naming code the deny-list did not hold. Each was
scanned clean, or hung; none is a file a tool writes by accident."""

from __future__ import annotations

import enum
import json
import pickle
import struct
import threading
import warnings
import zipfile

import numpy as np
import pytest
import torch

from test_scan import NAN, run_scan


def scan_within(capsys, path, seconds=60):
    """run_scan in a thread: a regression to exponential time fails instead of hanging the suite."""
    result = []
    worker = threading.Thread(target=lambda: result.append(run_scan(capsys, path)), daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    assert result, f"the scan of {path} did not end in {seconds} s"
    return result[0]


def test_lists_sharing_sublists_are_walked_once_before_the_mapped_load(capsys, tmp_path):
    """L_i = [L_(i-1), L_(i-1)], 40 deep: a 1.9 KB file of 2^40 paths to one tensor. The scan's walk took
    each list once, but the check of the records' sizes before the memory-mapped load walked every path."""
    node = [torch.tensor([1.0, NAN])]
    for _ in range(40):
        node = [node, node]
    path = tmp_path / "dag.pt"
    torch.save({"x": node}, path)
    code, out = scan_within(capsys, path)
    assert code == 1 and out.startswith(f"{path}: 1 tensor, 2 elements: 1 of them hold non-finite values")


def test_views_of_one_storage_are_read_once(capsys, tmp_path):
    """torch.save writes a storage once and names each view of it in ~70 bytes: 300 identical views of a
    4 MB storage were read 300 times (a 100 MB storage named 2000 times took 17 s)."""
    base = torch.zeros(1_000_000)
    base[-1] = NAN
    path = tmp_path / "views.pt"
    torch.save({"views": [base.view(-1) for _ in range(300)], "other": base[10:20]}, path)
    code, out = run_scan(capsys, path)
    # the 300 views are one (the first named), the slice another
    assert code == 1 and out.startswith(f"{path}: 2 tensors, 1,000,010 elements: 1 of them hold non-finite values")
    assert out.splitlines()[2].split()[0] == "views[0]"


def test_an_array_named_many_times_is_read_and_named_once(capsys, tmp_path):
    """The pickle's memo names one numpy array again in a few bytes: a 100 MB array named 5000 times took
    37 s (tensors were read once already; arrays were not)."""
    array = np.zeros(1000, dtype=np.float32)
    array[5] = np.inf
    path = tmp_path / "refs.pt"
    torch.save({"arrays": [array] * 500}, path)
    code, out = run_scan(capsys, path)
    assert code == 1 and out.startswith(f"{path}: 1 tensor, 1,000 elements: 1 of them hold non-finite values")
    assert out.splitlines()[2].split()[0] == "arrays[0]"


def _pickle_calling(module: str, name: str, argument: str) -> bytes:
    """A protocol-2 pickle of {"lr": 0.1, "x": module.name(argument)}, written by hand (nothing imported)."""
    def text(s: str) -> bytes:
        return b"X" + struct.pack("<I", len(s.encode())) + s.encode()

    return (b"\x80\x02}(" + text("lr") + b"G" + struct.pack(">d", 0.1) + text("x")
            + b"c" + module.encode() + b"\n" + name.encode() + b"\n(" + text(argument) + b"tRu.")


# Each runs code when the file is loaded with weights_only=False; each was given an inert stand-in and
# the file called clean (torch.storage._load_from_bytes is torch.load without weights_only).
CODE_GLOBALS = [("torch.storage", "_load_from_bytes"), ("torch.fx.graph_module", "reduce_graph_module"),
                ("torch._inductor.codecache", "PyCodeCache"), ("torch.utils.collect_env", "run"),
                ("_posixsubprocess", "fork_exec"), ("pydoc", "pipepager"), ("cProfile", "run"), ("profile", "run"),
                ("pkgutil", "resolve_name"), ("distutils.spawn", "spawn"), ("dill._dill", "_create_code"),
                ("cloudpickle.cloudpickle", "_make_function"), ("joblib.numpy_pickle", "load"), ("bdb", "Bdb"),
                ("trace", "Trace")]


@pytest.mark.parametrize("module, name", CODE_GLOBALS, ids=[f"{m}.{n}" for m, n in CODE_GLOBALS])
def test_a_pickle_naming_code_the_list_lacked_is_refused(capsys, tmp_path, module, name):
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("evil/data.pkl", _pickle_calling(module, name, "echo pwned"))
        z.writestr("evil/byteorder", "little")
        z.writestr("evil/version", "3\n")
    code, out = run_scan(capsys, path)
    assert code == 2 and out.startswith(f"{path}: refused: its pickle asks to run {module}.{name};")


def test_a_distributed_checkpoint_item_described_but_not_stored_is_not_checked(capsys, tmp_path):
    """A DCP .metadata describing tensor 'w' with no storage entry for it (a rank's entries lost in a
    merge): the scan read what was stored and called the checkpoint clean; DCP's load fails on it."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves as a single process
        dcp.save({"w": torch.tensor([1.0, NAN]), "b": torch.ones(3)}, checkpoint_id=str(path))
    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != "w"}
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    code, out = run_scan(capsys, path)
    assert code == 2 and out.strip() == (f"{path}: 1 tensor, 3 elements checked: no NaN/inf; 1 not checked: 'w' "
                                         "(its .metadata describes it but says where no data of it is stored)")


def test_a_torch_save_cut_short_anywhere_says_it_is_damaged(capsys, tmp_path):
    """Cut within its zip directory, torch's reader raised "[Errno 22] Invalid argument", which the scan
    printed alone."""
    whole = tmp_path / "whole.pt"
    torch.save({"a": torch.zeros(1000), "w": torch.tensor([1.0, NAN])}, whole)
    data = whole.read_bytes()
    for cut in (len(data) - 1, len(data) - 22, len(data) - 100, len(data) - 200, len(data) // 2, 100):
        path = tmp_path / f"cut{cut}.pt"
        path.write_bytes(data[:cut])
        code, out = run_scan(capsys, path)
        assert code == 2 and out.startswith(f"{path}: unreadable: damaged or truncated"), out


def test_a_byte_flipped_in_a_record_is_damage_not_clean(capsys, tmp_path):
    """torch.load never compares a record with its CRC-32: a torch.save file whose tensor record had one
    byte flipped (a 0.0 become 0.5, finite) was scanned clean, and so was the same damage inside a
    distributed checkpoint's .distcp (a probe, session 42; NOTE: [Records checked against their
    checksums]). Both are damage now, named by their record."""
    path = tmp_path / "flipped.pt"
    torch.save({"w": torch.zeros(1024)}, path)
    data = bytearray(path.read_bytes())
    record = next(r for r in zipfile.ZipFile(path).infolist() if r.filename.endswith("/data/0"))
    name_length, extra_length = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    data[record.header_offset + 30 + name_length + extra_length + 4 * 100 + 3] ^= 0x3F
    path.write_bytes(data)
    assert torch.load(path, weights_only=True)["w"][100].item() == 0.5  # torch loads it
    code, out = run_scan(capsys, path)
    assert code == 2 and out.strip() == (f"{path}: unreadable: its record flipped/data/0 does not match the "
                                         "checksum (CRC-32) its zip lists: damaged (nothing was checked)")

    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves as a single process
        dcp.save({"w": torch.zeros(1024), "b": torch.ones(3)}, checkpoint_id=str(directory))
    shard = next(directory.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[data.index(bytes(4096)) + 401] ^= 0x3F  # inside w's zeros
    shard.write_bytes(data)
    code, out = run_scan(capsys, directory)
    assert code == 2 and "1 not checked: 'w' (its record" in out and "does not match the checksum" in out


class Mode(enum.Enum):
    TRAIN = "train"


class Config(dict):
    """A dict subclass holding a run's settings (as EasyDict or addict do)."""


def test_hyper_parameters_keyed_by_an_enum_or_held_in_a_dict_subclass(capsys, tmp_path):
    """Lightning-style checkpoints whose hyper_parameters are keyed by an enum member, or held in a dict
    subclass, were called "damaged or truncated" (a probe, session 42): an enum key's stand-in could not
    be hashed, and torch's weights-only loader rebuilds no dict subclass. The first is read, its NaN
    found; the second is said to hold what the loader cannot rebuild, not to be damaged."""
    weights = {"weight": torch.tensor([[1.0, NAN], [0.0, 2.0]])}
    keyed = tmp_path / "enum_key.ckpt"
    torch.save({"state_dict": weights, "hyper_parameters": {Mode.TRAIN: 0.1}}, keyed)
    code, out = run_scan(capsys, keyed)
    assert code == 1 and "state_dict.weight" in out and "Mode" in out
    held = tmp_path / "dict_subclass.ckpt"
    torch.save({"state_dict": weights, "hyper_parameters": Config(lr=0.1)}, held)
    code, out = run_scan(capsys, held)
    assert code == 2 and out.strip() == (f"{held}: unreadable: its pickle holds a subclass of dict or list (a config "
                                         "object?), which weights-only loading cannot rebuild: nothing was checked")


def test_compressed_records_larger_than_the_memory_are_refused_by_name(capsys, tmp_path, monkeypatch):
    """A re-zipped checkpoint's records are read whole: a 3.9 MB file inflating to 4 GB peaked at 4.4 GB,
    and a larger one would have the process killed without a word. (The memory is made small here.)"""
    from nanfast.readers import zip_records
    from test_scan import rezip_deflated

    stored, deflated = tmp_path / "stored.pt", tmp_path / "deflated.pt"
    torch.save({"w": torch.zeros(2_000_000)}, stored)  # 8 MB of zeros: a few KB compressed
    rezip_deflated(stored, deflated)
    monkeypatch.setattr(zip_records, "available_memory", lambda: 4 << 20)
    code, out = run_scan(capsys, deflated)
    assert code == 2 and out.startswith(f"{deflated}: unreadable: its compressed records inflate to 8 MiB (")
    assert "x the file), more than the 4 MiB of memory available: nothing was checked" in out
    assert run_scan(capsys, stored)[0] == 0  # stored, it is mapped: no memory asked
    monkeypatch.setattr(zip_records, "available_memory", lambda: 64 << 20)
    assert run_scan(capsys, deflated)[0] == 0


# Session 44's probe of damaged and hostile files: a TorchScript archive missing its module, a DCP chunk
# placed with no offset or covering part of its tensor, a name that is not UTF-8, an .npz member
# inflating past the memory, a safetensors entry of a dtype torch lacks.

def _torchscript_records(tmp_path):
    """A TorchScript archive of a module with a NaN weight, and its records as (name, bytes)."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([1.0, NAN]))

        def forward(self, x):
            return x * self.w

    good = tmp_path / "good.pt"
    torch.jit.save(torch.jit.script(Scaled()), str(good))
    return good, [(r.filename, zipfile.ZipFile(good).read(r)) for r in zipfile.ZipFile(good).infolist()]


def test_a_torchscript_archive_missing_its_module_or_split_over_folders_is_damaged(capsys, tmp_path):
    """Both were scanned "no tensors in it", exit 0, the module's NaN never read; torch.jit.load fails."""
    good, records = _torchscript_records(tmp_path)
    assert run_scan(capsys, good)[0] == 1
    decoy, lost = tmp_path / "decoy.pt", tmp_path / "lost.pt"
    with zipfile.ZipFile(decoy, "w") as z:
        z.writestr("decoy/version", b"3\n")
        for name, data in records:
            z.writestr(name, data)
    with zipfile.ZipFile(lost, "w") as z:
        for name, data in records:
            if not name.endswith("/data.pkl"):
                z.writestr(name, data)
    code, out = run_scan(capsys, decoy)
    assert code == 2 and "records lie in 2 folders (decoy, good)" in out
    code, out = run_scan(capsys, lost)
    assert code == 2 and "without its module's record (data.pkl)" in out


def _dcp_of_two_chunks(tmp_path, name, offsets, storage):
    """A DCP checkpoint of one tensor 'w' of 8 elements described in chunks of 4 at `offsets`, its data
    where `storage` ((offset or None) per entry) says: the first entry's file holds [1, 2, 3, 4], the
    second's [5, nan, 7, 8]."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    path = tmp_path / name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves as a single process
        dcp.save({"a": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([5.0, NAN, 7.0, 8.0])},
                 checkpoint_id=str(path))
    metadata = pickle.loads((path / ".metadata").read_bytes())  # ours: written just above
    where = {index.fqn: place for index, place in metadata.storage_data.items()}
    changed = copy.deepcopy(metadata)
    changed.state_dict_metadata = {"w": TensorStorageMetadata(
        properties=metadata.state_dict_metadata["a"].properties, size=torch.Size([8]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([o]), sizes=torch.Size([4])) for o in offsets])}
    changed.storage_data = {MetadataIndex("w", None if o is None else torch.Size([o]), i): where["ab"[i]]
                            for i, o in enumerate(storage)}
    (path / ".metadata").write_bytes(pickle.dumps(changed))
    return path


def test_distributed_chunks_are_matched_by_offset_and_must_cover_their_tensor(capsys, tmp_path):
    """An entry with no offset counted for the chunk at [4] holding the NaN: "clean", exit 0, while DCP's
    load fails; chunks covering half the tensor were "clean" too, and DCP's load leaves the rest as it was."""
    assert run_scan(capsys, _dcp_of_two_chunks(tmp_path, "whole", [0, 4], [0, 4]))[0] == 1
    code, out = run_scan(capsys, _dcp_of_two_chunks(tmp_path, "no_offset", [0, 4], [0, None]))
    assert code == 2 and "'w' (its .metadata stores it with no chunk offset: damaged)" in out
    assert "'w[4]' (its .metadata describes this chunk but says where no data of it is stored)" in out
    code, out = run_scan(capsys, _dcp_of_two_chunks(tmp_path, "half", [0], [0]))
    assert code == 2 and "'w' (its .metadata describes a tensor of 8 elements [8] in chunks of 4 in all" in out


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_checkpoint_whose_name_is_not_utf8_is_read(tmp_path, suffix):
    """torch's zip reader and safetensors take UTF-8 paths only: a healthy file so named (legal on Linux)
    was "damaged or truncated", its NaN unreported."""
    import os

    from nanfast import scan

    if suffix == ".safetensors":
        save_file = pytest.importorskip("safetensors.torch").save_file

    written = tmp_path / f"plain{suffix}"
    tensors = {"w": torch.tensor([1.0, NAN])}
    torch.save(tensors, written) if suffix == ".pt" else save_file(tensors, written)
    path = os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xffname" + suffix.encode())
    os.replace(written, path)
    result = scan.scan_file(path)
    assert result.status == "nonfinite" and [e.name for e in result.report.bad] == ["w"]


def test_an_npz_member_inflating_past_the_memory_is_not_read_and_its_siblings_are(capsys, tmp_path, monkeypatch):
    """Members are read whole: a 14 MB file inflating to 3.7 GB was read (the memory is made small here)."""
    from nanfast.readers import zip_records

    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, zeros=np.zeros(2_000_000, dtype=np.float32), bad=np.array([NAN], dtype=np.float32))
    monkeypatch.setattr(zip_records, "available_memory", lambda: 4 << 20)
    code, out = run_scan(capsys, path)
    assert code == 2 and "'zeros' (it inflates to 8 MiB, more than the 4 MiB of memory available)" in out
    assert "1 of them hold non-finite values" in out


def test_a_safetensors_entry_torch_cannot_read_is_named_and_the_others_are_checked(capsys, tmp_path):
    """One entry of a dtype torch lacks made the whole file unreadable, unnamed, and the NaN beside it
    went unreported."""
    pytest.importorskip("safetensors")
    header = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "b": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [4, 7]}}).encode()
    path = tmp_path / "mixed.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<f", NAN) + b"\0\0\0")
    code, out = run_scan(capsys, path)
    assert code == 2 and "1 not checked: 'b' (it could not be read (SafetensorError: Dtype not understood" in out
    assert "a     (1,)   float32    1" in out


# A probe of the scan (stop 52): each of these was "clean" (exit 0), read a tensor twice, or stopped the
# scan with a traceback.

def test_a_folder_or_a_file_that_cannot_be_opened_is_reported_not_read(capsys, tmp_path, monkeypatch):
    """os.walk drops the folders it cannot list: a checkpoint-500/ without read permission was skipped,
    and the directory scanned clean; a file named otherwise (accelerate's *.pkl) that could not be opened
    was left out as no torch.save file. (Permissions are simulated: the suite may run as root.)"""
    import os

    from nanfast.readers import torch_save

    torch.save({"w": torch.ones(3)}, tmp_path / "model.pt")
    (tmp_path / "checkpoint-500").mkdir()
    torch.save({"w": torch.tensor([NAN])}, tmp_path / "checkpoint-500" / "optimizer.pt")
    (tmp_path / "random_states_0.pkl").write_bytes(b"\0" * 64)
    scandir, real_open = os.scandir, open

    def denied(path, *args, **kwargs):
        if str(path).endswith(("checkpoint-500", "random_states_0.pkl")):
            raise PermissionError(13, "Permission denied", str(path))
        return (scandir if not args and not kwargs else real_open)(path, *args, **kwargs)

    monkeypatch.setattr(os, "scandir", denied)
    monkeypatch.setattr(torch_save, "open", denied, raising=False)
    code, out = run_scan(capsys, tmp_path)
    assert code == 2 and "model.pt: 1 tensor, 3 elements: clean" in out
    assert "checkpoint-500: unreadable: a folder that could not be listed: [Errno 13] Permission denied" in out
    assert "random_states_0.pkl: unreadable" in out


def test_distributed_chunks_that_overlap_do_not_tile_their_tensor(capsys, tmp_path):
    """Chunks [0:4] and [2:6] of an [8] tensor: as many elements in all, but 6 and 7 stored nowhere (DCP's
    load leaves them as the target held them)."""
    code, out = run_scan(capsys, _dcp_of_two_chunks(tmp_path, "overlap", [0, 2], [0, 2]))
    assert code == 2 and "in chunks of 8 in all that do not tile it: some of it is stored nowhere, or twice" in out


def test_npz_members_are_read_by_their_names_in_the_zip(capsys, tmp_path):
    """numpy's keys drop ".npy": of members "w" and "w.npy" both keys read "w", and the NaN in "w.npy" was
    never read; a member with no numpy header (damaged, or a torch.save file renamed .npz) came back as
    bytes and was skipped: "no tensors in it", exit 0."""
    import io

    def npy(values):
        buffer = io.BytesIO()
        np.save(buffer, np.array(values, dtype=np.float32))
        return buffer.getvalue()

    shadowed = tmp_path / "shadowed.npz"
    with zipfile.ZipFile(shadowed, "w") as z:
        z.writestr("w", npy([1.0, 2.0]))
        z.writestr("w.npy", npy([1.0, NAN]))
    code, out = run_scan(capsys, shadowed)
    assert code == 1 and "2 tensors, 4 elements" in out and "w.npy  (2,)" in out
    damaged = tmp_path / "damaged.npz"
    with zipfile.ZipFile(damaged, "w") as z:
        z.writestr("w.npy", b"\0" + npy([NAN])[1:])
    code, out = run_scan(capsys, damaged)
    assert code == 2 and "'w' (it is not a .npy array (no numpy header): not read)" in out


def test_an_index_nested_too_deep_for_the_json_reader_is_unreadable(capsys, tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("[" * 100_000 + "]" * 100_000)
    torch.save({"w": torch.tensor([NAN])}, tmp_path / "other.pt")
    code, out = run_scan(capsys, tmp_path)  # the directory's other files are still read
    assert code == 2 and "not a sharded checkpoint's index" in out and "RecursionError" in out
    assert "other.pt: 1 tensor, 1 elements: 1 of them hold non-finite values" in out


def test_names_the_output_cannot_encode_are_escaped(capsys, tmp_path):
    """A tensor named with a lone surrogate stopped the table with a UnicodeEncodeError and no report."""
    path = tmp_path / "surrogate.pt"
    torch.save({"layer\ud800.weight": torch.tensor([NAN, 1.0])}, path)
    code, out = run_scan(capsys, path)
    assert code == 1 and "layer\\ud800.weight" in out


def test_json_output_is_strict_json(capsys, tmp_path):
    """The norm of finite float64 values past its range was printed as Infinity, which JSON has not."""
    path = tmp_path / "huge.pt"
    torch.save({"w": torch.tensor([NAN, 1.7e308, 1.7e308], dtype=torch.float64)}, path)
    code, out = run_scan(capsys, "--json", path)

    def refuse(constant):
        raise AssertionError(f"{constant} in the JSON output")

    report = json.loads(out, parse_constant=refuse)
    assert code == 1 and report["files"][0]["bad"][0]["norm"] is None


def test_a_directory_given_with_extra_separators_reads_each_shard_once(capsys, tmp_path):
    """DIR// listed DIR//x beside the DIR/x its index names: each shard was read twice, and the index was
    compared with none of them (a tensor it lists that no shard holds went unsaid)."""
    save_file = pytest.importorskip("safetensors.torch").save_file
    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00001.safetensors", "ghost": "model-00001-of-00001.safetensors"}}))
    code, out = run_scan(capsys, f"{tmp_path}//")
    assert code == 2 and out.count("model-00001-of-00001.safetensors: 1 tensor") == 1
    assert "'ghost' (listed in the index for model-00001-of-00001.safetensors, which does not hold it)" in out


def test_an_overlapping_view_is_read_in_time_proportional_to_its_storage(capsys, tmp_path):
    """A 7 KB file of a view of 10^12 elements (shape (256,) * 5, strides (1,) * 5 over 1280 floats): the
    scan read every element, for hours. Its counts are the view's, with multiplicity: the NaN at storage
    element 7 is held by as many indices as sum to 7."""
    storage = torch.zeros(5 * 256)
    storage[7] = NAN
    path = tmp_path / "window.pt"
    torch.save({"w": storage.as_strided((256,) * 5, (1,) * 5)}, path)
    code, out = scan_within(capsys, path, seconds=60)
    held = sum(1 for a in range(8) for b in range(8 - a) for c in range(8 - a - b) for d in range(8 - a - b - c)
               if 7 - a - b - c - d >= 0)  # indices (a, b, c, d, e) of sum 7
    assert code == 1 and "1,099,511,627,776 elements" in out
    assert f"  w     (256, 256, 256, 256, 256)  float32  {held}" in out, out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int32])
def test_overlapping_views_are_counted_as_their_elements(dtype):
    """overlapping_view_entry against a float64 reference over the view's elements, on random views of
    random data holding NaN and infinities (broadcast dimensions among them)."""
    import math
    import random

    from nanfast.overlapping_views import overlapping_view_entry, reads_faster_by_storage

    rng = random.Random(0)
    torch.manual_seed(0)
    faster = 0
    for _ in range(150):
        sizes = [rng.randint(1, 6) for _ in range(rng.randint(1, 5))]
        strides = [rng.choice([0, 1, 1, 2, 3, 5]) for _ in sizes]
        offset = rng.randint(0, 3)
        span = 1 + sum((s - 1) * k for s, k in zip(sizes, strides))
        base = (torch.randn(offset + span + 2, dtype=torch.float64) * 10.0 ** rng.randint(-3, 3) * 100).to(dtype)
        if dtype.is_floating_point:
            for _ in range(rng.randint(0, 3)):
                base[rng.randrange(len(base))] = rng.choice([NAN, float("inf"), -float("inf")])
        view = base.as_strided(sizes, strides, offset)
        faster += reads_faster_by_storage(view)
        entry = overlapping_view_entry("v", view)
        values = view.double().contiguous()
        finite = values[torch.isfinite(values)].abs()
        top = float(finite.max()) if finite.numel() else 0.0
        norm = top * math.sqrt(float(((finite / top) ** 2).sum())) if top else 0.0
        assert (entry.nan, entry.posinf, entry.neginf) == (int(values.isnan().sum()), int(values.isposinf().sum()),
                                                           int(values.isneginf().sum()))
        assert entry.absmax == top and math.isclose(entry.norm, norm, rel_tol=1e-12), (sizes, strides)
        assert (entry.numel, entry.shape) == (view.numel(), tuple(sizes))
    assert faster > 10  # the scan's path was taken by many of them
