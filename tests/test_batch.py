"""Batches: check_batch names the field and sample holding NaN/inf; checked(loader) the batch too."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import nanfast
from nanfast import batch as batch_module, batch_samples

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


def test_a_batch_without_tensors_is_not_called_finite():
    """A batch of strings (a tokenizer not run), an empty dict, the wrong object: nothing was looked at."""
    for batch in ({"text": ["a", "b"]}, {}, [None]):
        report = nanfast.check_batch(batch)
        assert report.ok and report.num_tensors == 0
        assert report.summary() == "nanfast: no tensors in the batch: nothing was checked"
    assert nanfast.check_batch({"x": torch.ones(2, 3)}).summary() == "nanfast: its 1 tensor is finite"


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


def test_numpy_fields_and_python_floats_are_checked_as_check_all_reads_them():
    """A collator with return_tensors="np" (HF), or a dataset of numpy arrays with a pass-through collate:
    such a batch was called finite while its NaN went unread."""
    np = pytest.importorskip("numpy")
    pixels = np.ones((3, 2), dtype=np.float32)
    pixels[2, 1] = np.nan
    batch = {"input_ids": np.arange(6).reshape(3, 2), "pixel_values": pixels, "scale": float("inf"),
             "text": np.array(["a", "b", "c"]), "mask": torch.ones(3, 2)}
    report = nanfast.check_batch(batch, raise_on_nonfinite=False)
    assert [(f.path, f.samples, f.nan, f.posinf) for f in report.bad] == [("pixel_values", (2,), 1, 0),
                                                                           ("scale", (), 0, 1)]
    assert report.num_tensors == 4  # the ids, the pixels, the scale and the mask; the strings hold no values
    assert check_all_names(batch) == ["input_ids", "pixel_values", "scale", "mask"]


def test_a_model_or_an_optimizer_is_not_a_batch():
    model = torch.nn.Linear(2, 2)
    for wrong in (model, torch.optim.SGD(model.parameters(), lr=0.1)):
        with pytest.raises(TypeError, match=r"check_batch: got a (Linear|SGD), not a batch; .* with nanfast.check_all"):
            nanfast.check_batch(wrong)


def check_all_names(batch) -> list[str]:
    return [e.name for e in nanfast.check_all(batch, raise_on_nonfinite=False).entries]


def test_raises_naming_sample_and_field():
    x = torch.zeros(3, 4)
    x[2, 0] = NAN
    with pytest.raises(nanfast.NonFiniteError, match=r"sample 2 of field '\[0\]' \(nan=1, \+inf=0, -inf=0\)") as e:
        nanfast.check_batch((x, torch.zeros(3)))
    assert isinstance(e.value.report, batch_module.BatchReport) and e.value.report.samples == [2]


def test_many_bad_samples_are_cut_in_the_message():
    x = torch.full((20, 2), NAN)
    report = nanfast.check_batch({"x": x}, raise_on_nonfinite=False)
    assert report.bad[0].samples == tuple(range(20))
    assert f"and {20 - batch_module.MAX_SAMPLES_IN_MESSAGE} more" in report.summary()


def test_half_and_complex_fields():
    h = torch.zeros(2, 3, dtype=torch.bfloat16)
    h[1, 1] = INF
    c = torch.zeros(2, dtype=torch.complex64)
    c[0] = complex(0, NAN)
    report = nanfast.check_batch({"h": h, "c": c}, raise_on_nonfinite=False)
    assert [(f.path, f.samples) for f in report.bad] == [("h", (1,)), ("c", (0,))]


@pytest.mark.parametrize("layout", ["coo", "hybrid coo", "csr", "csc", "bsr"])
def test_a_sparse_field_names_its_samples(layout):
    """A sparse batch field (bag-of-words features, a sparse adjacency) was refused with a ValueError
    although check_all reads sparse tensors; its samples are the rows of its values holding NaN or inf."""
    torch.manual_seed(0)
    dense = torch.randn(6, 4) * (torch.rand(6, 4) < 0.5)
    dense[1, 2], dense[4, 0] = NAN, INF
    make = {"coo": lambda d: d.to_sparse(), "hybrid coo": lambda d: d.to_sparse(1), "csr": torch.Tensor.to_sparse_csr,
            "csc": torch.Tensor.to_sparse_csc, "bsr": lambda d: d.to_sparse_bsr((2, 2))}[layout]
    report = nanfast.check_batch({"x": make(dense), "y": torch.ones(6)}, raise_on_nonfinite=False)
    # Reference: the dense field's rows holding NaN or inf, and its counts.
    want = tuple(i for i in range(6) if not torch.isfinite(dense[i]).all())
    assert [(f.path, f.samples, f.nan, f.posinf, f.shape) for f in report.bad] == [("x", want, 1, 1, (6, 4))]
    assert nanfast.check_batch({"x": make(torch.ones(6, 4))}).ok


def test_a_sparse_fields_duplicate_entries_are_summed_and_other_layouts_named():
    """An uncoalesced COO field's entries at one index are summed, as its values are: inf and -inf there
    are the NaN of sample 2. A layout nanfast cannot read is still named."""
    dup = torch.sparse_coo_tensor(torch.tensor([[2, 2, 4], [0, 0, 1]]), torch.tensor([INF, -INF, 1.0]), (5, 2))
    [field] = nanfast.check_batch({"x": dup}, raise_on_nonfinite=False).bad
    assert (field.samples, field.nan, field.posinf, field.neginf) == ((2,), 1, 0, 0)
    with pytest.raises(ValueError, match="field 'm' is a torch._mkldnn tensor"):
        nanfast.check_batch({"m": torch.ones(3).to_mkldnn()})


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
    with pytest.warns(RuntimeWarning) as caught:  # dropped data is said, never silent
        labels = torch.cat([labels for _, labels in loader])
    assert labels.tolist() == [0, 1, 2, 3, 8, 9]
    assert loader.bad_batches[0].samples == [3]
    assert [str(w.message) for w in caught] == [f"{r.summary()}: skipped the batch" for r in loader.bad_batches]


def test_checked_rejects_unknown_action():
    with pytest.raises(ValueError, match="action"):
        nanfast.checked([], action="ignore")


class TensorCounter(TorchDispatchMode):
    """Counts the tensors that ops take and return: unbinding a field into its samples shows up here."""

    def __init__(self):
        super().__init__()
        self.tensors = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tensors += sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args, kwargs, out)))
        return out


def test_sample_attribution_does_not_scale_with_the_batch_size():
    # Attribution used to unbind the bad field into one view per sample: 4M samples took 13 s and 3.7 GB.
    def tensors_touched(batch_size, dtype):
        x = torch.zeros(batch_size, dtype=dtype)
        x[3] = NAN
        with TensorCounter() as counter:
            report = nanfast.check_batch({"inputs": {"image": x}}, raise_on_nonfinite=False)
        assert report.bad[0].samples == (3,) and "sample 3 of field 'inputs.image'" in report.summary()
        return counter.tensors

    for dtype in (torch.float32, torch.float8_e4m3fn):  # isfinite has no float8_e4m3fn kernel
        tensors_touched(10, dtype)  # the first call with a dtype also asks the kernels whether they read it
        assert tensors_touched(100_000, dtype) == tensors_touched(1_000, dtype) < 50


def test_self_referencing_batch():
    x = torch.zeros(3)
    x[1] = NAN
    batch = {"x": x}
    batch["again"] = batch
    report = nanfast.check_batch(batch, raise_on_nonfinite=False)
    assert report.num_tensors == 1 and [(f.path, f.samples) for f in report.bad] == [("x", (1,))]


def test_fields_in_deques_and_sets_are_checked():
    """A deque or a set was a leaf, and not a tensor: its tensors were skipped and the batch called clean."""
    bad = torch.tensor([0.0, NAN])
    report = nanfast.check_batch({"queue": collections.deque([bad]), "tags": {bad}}, raise_on_nonfinite=False)
    assert [(f.path, f.samples) for f in report.bad] == [("queue[0]", (1,)), ("tags{0}", (1,))]


@pytest.mark.parametrize("field, what", [
    (torch.quantize_per_tensor(torch.ones(3), 0.5, 0, torch.quint8), "a quantized tensor"),
    (torch.zeros(3, dtype=torch.int16).view(torch.bits16), "of dtype torch.bits16"),
    (torch.empty(3, device="meta"), "a meta tensor"),
])
def test_fields_the_kernels_cannot_read_are_named(field, what):
    with pytest.raises(ValueError, match=f"nanfast.check_batch: field 'x' is {what}"):
        nanfast.check_batch({"ok": torch.ones(3), "x": field})


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_batch_names_its_components_as_samples(layout):
    """A batch of variable-length sequences as one nested tensor was refused ("a nested tensor"), though
    check_all reads it; its samples are its components."""
    rows = [torch.ones(2, 3), torch.tensor([[1.0, NAN, INF]]), torch.ones(4, 3), torch.tensor([[-INF, 0.0, 0.0]])]
    field = torch.nested.nested_tensor(rows, layout=layout)
    report = nanfast.check_batch({"ids": torch.arange(4), "x": field}, raise_on_nonfinite=False)
    assert [(f.path, f.samples, f.nan, f.posinf, f.neginf) for f in report.bad] == [("x", (1, 3), 1, 1, 1)]
    assert report.bad[0].shape == (4, -1, 3) and report.num_tensors == 2
    clean = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=layout)
    assert nanfast.check_batch({"x": clean}).ok


@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_a_packed_sequence_names_the_sequences_not_the_packed_rows(enforce_sorted):
    """A PackedSequence's data is ordered by time step, then by sequence: its row index was named as the
    sample ("sample 2" for the second step of sequence 0)."""
    from torch.nn.utils.rnn import pack_sequence

    seqs = [torch.tensor([[1.0], [2.0], [3.0], [NAN]]), torch.tensor([[1.0], [INF]]), torch.tensor([[4.0]])]
    if not enforce_sorted:  # the longest not first: sorted_indices maps positions back to samples
        seqs = [seqs[2], seqs[0], seqs[1]]
    packed = pack_sequence(seqs, enforce_sorted=enforce_sorted)
    report = nanfast.check_batch({"x": packed, "y": torch.ones(3)}, raise_on_nonfinite=False)
    want = (0, 1) if enforce_sorted else (1, 2)
    assert [(f.path, f.samples) for f in report.bad] == [("x.data", want)], report
    # Reference: each sequence checked alone.
    assert tuple(i for i, s in enumerate(seqs) if not torch.isfinite(s).all()) == want


class _DetectionDataset(torch.utils.data.Dataset):
    """Samples as torchvision's detection models take them: an image of its own size and a dict of boxes
    and labels, some samples with a NaN box or a NaN pixel."""

    def __init__(self, bad_box=(), bad_pixel=()):
        self.bad_box, self.bad_pixel = bad_box, bad_pixel

    def __len__(self):
        return 4

    def __getitem__(self, i):
        image = torch.rand(3, 20 + 4 * i, 24)
        boxes = torch.tensor([[1.0, 2.0, 10.0, 12.0]]).repeat(i + 1, 1)  # as many boxes as i + 1
        if i in self.bad_pixel:
            image[0, 5, 7] = NAN  # channel 0, of sample i
        if i in self.bad_box:
            boxes[0, 2] = NAN  # box 0, of sample i
        return image, {"boxes": boxes, "labels": torch.ones(i + 1, dtype=torch.long)}


def test_fields_in_lists_of_samples_are_named_by_their_sample():
    """A detection batch (a tuple of images and a tuple of target dicts, as torchvision's references'
    collate_fn makes it) named a NaN box of image 1 "sample 0" (the box row) and a NaN pixel of image 2
    "sample 0" (its channel). A default-collated [x, y] keeps dim 0 as the sample."""
    loader = torch.utils.data.DataLoader(_DetectionDataset(bad_box=(1,), bad_pixel=(2,)), batch_size=4,
                                         collate_fn=lambda b: tuple(zip(*b)))
    images, targets = next(iter(loader))
    for batch, prefix in [((images, targets), ("[0]", "[1]")), ({"images": list(images), "targets": list(targets)},
                                                               ("images", "targets"))]:
        report = nanfast.check_batch(batch, raise_on_nonfinite=False)
        assert [(f.path, f.samples) for f in report.bad] == [(f"{prefix[0]}[2]", (2,)), (f"{prefix[1]}[1].boxes", (1,))]
    # DETR-style: batched pixels, one dict of labels per image
    detr = {"pixel_values": torch.rand(4, 3, 8, 8), "labels": list(targets)}
    detr["pixel_values"][3, 0, 0, 0] = NAN
    report = nanfast.check_batch(detr, raise_on_nonfinite=False)
    assert [(f.path, f.samples) for f in report.bad] == [("pixel_values", (3,)), ("labels[1].boxes", (1,))]
    x, y = torch.randn(6, 3), torch.randn(6, 3)
    x[4, 1] = NAN
    batch = next(iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=6)))
    assert isinstance(batch, list)
    assert [(f.path, f.samples) for f in nanfast.check_batch(batch, raise_on_nonfinite=False).bad] == [("[0]", (4,))]
    # Two loaders combined (Lightning's CombinedLoader): a list of batches, each a dict of batched tensors,
    # whose positions are loaders, not samples.
    CombinedLoader = pytest.importorskip("lightning.pytorch.utilities").CombinedLoader
    loaders = [torch.utils.data.DataLoader([{"x": row} for row in rows], batch_size=len(rows))
               for rows in (x, torch.randn(3, 3))]
    combined = next(iter(CombinedLoader(loaders, "max_size_cycle")))  # ([batch 0, batch 1], index, loader)
    report = nanfast.check_batch(combined, raise_on_nonfinite=False)
    assert [(f.path, f.samples) for f in report.bad] == [("[0][0].x", (4,))]
    # Records of batched tensors side by side with a list or a tensor as long by chance (batch size 2):
    # they look batched (every tensor with one number of rows), and rows stay the samples.
    x2 = torch.zeros(2, 3)
    x2[1, 0] = NAN
    default_collated = [[{"x": x2}, {"m": torch.zeros(2, 3)}], torch.tensor([0, 1])]  # ((inputs, extras), label)
    assert [(f.path, f.samples) for f in nanfast.check_batch(default_collated, raise_on_nonfinite=False).bad] == [
        ("[0][0].x", (1,))]


def test_a_bad_fields_samples_are_found_in_bounded_memory(monkeypatch):
    """The samples of a bad field were found by one isfinite over its whole logical size: a 2-byte
    [nan].expand(2**15, 2**15) took 5 GB, a 256 MB float8 field 3 GB (read in float32). A broadcast
    dimension is read once, and rows in chunks (made small here); the samples are the same."""
    monkeypatch.setattr(batch_samples, "_CHUNK_ELEMENTS", 12)
    read = []
    isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: read.append(t.numel()) or isfinite(t))
    x = torch.zeros(10, 3, 4, dtype=torch.float8_e4m3fn)
    x.view(torch.uint8)[[2, 7], 1, 3] = 0x7F  # NaN in samples 2 and 7
    expanded = torch.tensor([[1.0], [NAN], [2.0]], dtype=torch.float16).expand(3, 1000)
    everywhere = torch.tensor([NAN]).expand(5, 1000)
    report = nanfast.check_batch({"x": x, "expanded": expanded, "everywhere": everywhere}, raise_on_nonfinite=False)
    assert [(f.path, f.samples) for f in report.bad] == [("x", (2, 7)), ("expanded", (1,)), ("everywhere", (0, 1, 2, 3, 4))]
    assert report.bad[1].nan == 1000 and max(read) <= 12


def test_a_record_with_data_and_batch_sizes_fields_is_not_read_as_a_packed_sequence():
    """Only a real PackedSequence's rows are mapped to its sequences: a batch whose record merely had
    `data` and `batch_sizes` fields had its bad row named as another sample, and one with a negative
    size crashed in repeat_interleave (a probe, session 49)."""
    import collections

    Record = collections.namedtuple("Record", "data batch_sizes")
    data = torch.ones(5, 2)
    data[3, 1] = NAN
    for sizes in (torch.tensor([3, 2]), torch.tensor([7, -2])):  # sums to the rows; a negative size
        for record in (Record(data, sizes), {"data": data, "batch_sizes": sizes}):
            report = nanfast.check_batch({"x": record}, raise_on_nonfinite=False)
            assert [(f.path, f.samples) for f in report.bad] == [("x.data", (3,))], report
            # Reference: the rows holding NaN, one by one.
            assert [i for i in range(5) if not torch.isfinite(data[i]).all()] == [3]


@pytest.mark.parametrize("sizes, order", [
    (torch.tensor([2, -1, 2]), None),   # a negative size
    (torch.tensor([1, 2]), None),       # increasing
    (torch.tensor([2, 2]), None),       # sums to 4, not the 3 rows
    (torch.tensor([2, 1]), torch.tensor([0, 0])),  # sorted_indices not a permutation
    (torch.tensor([2, 1]), torch.tensor([1])),     # nor of the right length
    (torch.tensor([2.0, 1.0]), None),   # not integers
])
def test_a_packed_sequence_whose_sizes_do_not_describe_its_rows_is_refused_by_name(sizes, order):
    """A PackedSequence built by hand with fields torch would not make: its rows' samples cannot be told,
    so the bad field is named in a ValueError, not mapped to wrong samples or crashed on."""
    from torch.nn.utils.rnn import PackedSequence

    data = torch.tensor([[1.0], [NAN], [2.0]])
    packed = PackedSequence.__new__(PackedSequence, data, sizes, order, order)  # as a user's own may be, unchecked
    with pytest.raises(ValueError, match=r"field 'x\.data' is the data of a PackedSequence"):
        nanfast.check_batch({"x": packed}, raise_on_nonfinite=False)


def test_variable_length_sequences_left_in_a_list_beside_their_labels_are_samples():
    """A collate_fn that pads nothing leaves each sample's sequence in a list beside the batched labels:
    a NaN at time step 4 of sequence 1 was "sample 4 of field 'seqs[1]'" (a probe, session 50). Tensors
    of one length in a list ([x, y] as default_collate makes it) are still batched fields."""
    seqs = [torch.ones(3, 2), torch.ones(5, 2), torch.ones(2, 2)]
    seqs[1][4, 0] = NAN
    report = nanfast.check_batch({"seqs": seqs, "labels": torch.tensor([0, 1, 2])}, raise_on_nonfinite=False)
    # Reference: the sequences holding NaN, one by one.
    assert [i for i, s in enumerate(seqs) if not torch.isfinite(s).all()] == [1]
    assert [(f.path, f.samples) for f in report.bad] == [("seqs[1]", (1,))] and report.samples == [1]
    x, y = torch.ones(2, 3), torch.zeros(2)  # rows as many as the labels: the batch's size
    x[1, 1] = INF
    report = nanfast.check_batch({"xy": [x, y], "labels": torch.tensor([0, 1])}, raise_on_nonfinite=False)
    assert [(f.path, f.samples) for f in report.bad] == [("xy[0]", (1,))]


def test_samples_in_a_list_are_told_by_the_batch_size_even_when_their_rows_agree():
    """Entries of one number of rows were taken for batched fields whatever their siblings showed: two
    sequences of 5 steps beside 2 labels, a NaN at step 4 of sequence 1, were "sample 4" (past the batch);
    a detection batch (tuple(zip(*batch))) whose images have 3 channels and whose targets have 1 box each
    named the channel or the box as the sample (a probe, session 52). Batched fields share one batch size."""
    seqs = [torch.ones(5, 3), torch.ones(5, 3)]
    seqs[1][4, 0] = NAN
    report = nanfast.check_batch({"seqs": seqs, "labels": torch.tensor([0, 1])}, raise_on_nonfinite=False)
    assert [(f.path, f.samples) for f in report.bad] == [("seqs[1]", (1,))] and report.samples == [1]
    images = (torch.rand(3, 8, 8), torch.rand(3, 8, 8))
    targets = tuple({"boxes": torch.rand(1, 4), "labels": torch.tensor([1])} for _ in range(2))
    targets[1]["boxes"][0, 2] = NAN
    images[1][2, 0, 0] = INF
    report = nanfast.check_batch((images, targets), raise_on_nonfinite=False)
    assert [(f.path, f.samples) for f in report.bad] == [("[0][1]", (1,)), ("[1][1].boxes", (1,))]


@pytest.mark.parametrize("record", ["tuple", "dict", "dataclass"])
def test_a_plain_list_of_the_datasets_samples_names_the_sample(record):
    """collate_fn=lambda b: b leaves the batch a plain list of the dataset's samples, with no sibling
    to show it: a NaN pixel of image 2 was "sample 0" (its channel) and a NaN box of image 1 "sample 0"
    (the box row), though their paths start at the right one (a probe, session 53). An entry holding an
    image's 3 channels beside its boxes, or a sample's label (a 0-dim tensor), is one sample's."""
    @dataclasses.dataclass
    class Sample:
        image: torch.Tensor
        target: dict

    def as_record(sample):
        image, target = sample
        return {"tuple": sample, "dict": {"image": image, **target}, "dataclass": Sample(image, target)}[record]

    dataset = _DetectionDataset(bad_box=(1,), bad_pixel=(2,))
    batch = next(iter(torch.utils.data.DataLoader([as_record(dataset[i]) for i in range(4)], batch_size=4,
                                                  collate_fn=lambda b: b)))
    assert isinstance(batch, list) and len(batch) == 4
    report = nanfast.check_batch(batch, raise_on_nonfinite=False)
    # Reference: the samples whose tensors hold NaN, one by one.
    expected = [i for i in range(4) if any(not torch.isfinite(t).all() for t in (dataset[i][0], *dataset[i][1].values()))]
    assert expected == [1, 2] and report.samples == expected
    assert sorted(f.samples for f in report.bad) == [(1,), (2,)]
    # A classification dataset's samples: an image and a 0-dim label each.
    samples = [{"image": torch.rand(3, 4, 4), "label": torch.tensor(i)} for i in range(3)]
    samples[2]["image"][1, 0, 0] = INF
    assert [(f.path, f.samples) for f in nanfast.check_batch(samples, raise_on_nonfinite=False).bad] == [
        ("[2].image", (2,))]
    # torchvision's datasets: (image, int label) each.
    pairs = [(sample["image"], int(sample["label"])) for sample in samples]
    assert [(f.path, f.samples) for f in nanfast.check_batch(pairs, raise_on_nonfinite=False).bad] == [("[2][0]", (2,))]
    named = [(sample["image"], f"{i}.jpg") for i, sample in enumerate(samples)]  # an image and its file name
    assert [(f.path, f.samples) for f in nanfast.check_batch(named, raise_on_nonfinite=False).bad] == [("[2][0]", (2,))]
