"""The checking API on inputs other code hands it, found by probing in session 37: numpy arrays with a
negative stride (BGR to RGB), a lazy module's parameters before its first forward, float8_e8m0fnu batch
fields, tensor subclasses the kernels cannot read, batch leaves that cannot be read (and, session 41, a
batch object of a class of its own), a batch that is one tensor, and clip_grad_norm_'s result dtype
(complex and mixed-precision gradients)."""

import math
import warnings

import pytest
import torch

import nanfast

NAN = float("nan")


def test_a_numpy_array_with_a_negative_stride_is_read():
    """img[..., ::-1] (cv2's BGR to RGB) raised torch's ValueError, naming nothing."""
    np = pytest.importorskip("numpy")
    image = np.ones((2, 4, 4, 3), dtype=np.float32)
    image[1, 0, 0, 0] = NAN
    rgb = image[..., ::-1]
    report = nanfast.check_batch({"image": rgb, "label": np.array([0, 1])}, raise_on_nonfinite=False)
    assert [(f.path, f.samples, f.nan) for f in report.bad] == [("image", (1,), 1)]
    assert nanfast.check_all({"image": np.flip(np.ones((2, 3), np.float32), 0)}).ok


def test_a_lazy_modules_parameters_before_the_first_forward_are_refused_by_name():
    """An UninitializedParameter is an empty tensor to the kernels: stats counted it clean, any_nonfinite
    said False."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning that lazy modules are experimental
        model = torch.nn.Sequential(torch.nn.LazyLinear(3))
    for call, api in ((nanfast.stats, "nanfast.stats"), (nanfast.any_nonfinite, "nanfast.any_nonfinite")):
        with pytest.raises(ValueError, match=rf"^{api}: entry 1 is a lazy module's UninitializedParameter"):
            call([torch.ones(2), model[0].weight])
    with pytest.raises(ValueError, match=r"^nanfast.check_all: '0.weight': .*before its first forward"):
        nanfast.check_all(model)
    model(torch.ones(1, 4))
    assert nanfast.check_all(model).ok and nanfast.stats([model[0].weight]).counts.sum() == 0


def test_a_float8_e8m0fnu_batch_field_names_its_sample():
    """torch.isfinite calls e8m0's NaN (0xFF) finite: the field was found bad with no sample named."""
    scales = torch.tensor([[127, 120], [1, 255]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    report = nanfast.check_batch({"scales": scales}, raise_on_nonfinite=False)
    assert [(f.path, f.samples, f.nan) for f in report.bad] == [("scales", (1,), 1)]


def test_a_tensor_subclass_the_kernels_cannot_read_is_named():
    masked = pytest.importorskip("torch.masked")
    m = masked.masked_tensor(torch.tensor([1.0, NAN]), torch.tensor([True, False]))
    for call, api in ((nanfast.stats, "nanfast.stats"), (nanfast.any_nonfinite, "nanfast.any_nonfinite")):
        with pytest.raises(TypeError, match=rf"^{api}: entry 1 is a MaskedTensor, a tensor subclass"):
            call([torch.ones(2), m])
    with pytest.raises(ValueError, match=r"field 'm' is a MaskedTensor \(a tensor subclass\)"):
        nanfast.check_batch({"x": torch.ones(2), "m": m})


def test_a_batch_leaf_that_cannot_be_read_is_listed_not_called_finite():
    """check_batch dropped an object-dtype array (holding a NaN) and said the batch was finite."""
    np = pytest.importorskip("numpy")
    batch = {"x": torch.ones(2, 3), "extra": np.array([1.0, NAN, "a"], dtype=object), "text": ["a", "b"]}
    report = nanfast.check_batch(batch)
    assert report.ok and report.unchecked == ("extra",)
    assert str(report).endswith("not checked (objects nanfast cannot read): extra")
    assert report.to_dict()["unchecked"] == ["extra"]


class GraphBatch:
    """A batch class of its own (as torch_geometric's Data): its tensors are attributes, which no
    container walker can know to read."""

    def __init__(self):
        self.x = torch.tensor([[1.0, NAN]])


def test_a_batch_object_that_cannot_be_read_is_named_and_checked_says_so():
    """Such a batch was listed as '' ("not checked (objects nanfast cannot read): " naming nothing), and
    nanfast.checked yielded it without a word, action="raise" included (a probe, session 41)."""
    report = nanfast.check_batch(GraphBatch())
    assert report.unchecked == ("the batch (GraphBatch)",) and str(report).endswith("read): the batch (GraphBatch)")
    assert nanfast.check_batch({"g": GraphBatch()}).unchecked == ("g",)
    with pytest.warns(RuntimeWarning, match=r"^nanfast.checked: batch 0; not checked .*: g; batches of this kind") as seen:
        assert len(list(nanfast.checked([{"g": GraphBatch()}] * 3))) == 3
    assert len(seen) == 1  # said once, not per batch


@pytest.mark.parametrize("dtypes", [(torch.complex64,), (torch.float16, torch.float32)], ids=["complex", "mixed"])
def test_clip_grad_norm_returns_the_norm_in_torchs_dtype(dtypes):
    """A complex gradient's norm came back complex (torch's is real); a float16 gradient listed first
    made a float32 one's norm of 1e5 inf (torch promotes)."""
    def parameters():
        params = []
        for i, dtype in enumerate(dtypes):
            p = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
            p.grad = torch.tensor([3.0, 4.0], dtype=dtype) * (2e4 if i else 1.0)  # 1e5: past float16's range
            params.append(p)
        return params

    ours = nanfast.clip_grad_norm_(parameters(), max_norm=1e9)
    theirs = torch.nn.utils.clip_grad_norm_(parameters(), max_norm=1e9)
    assert ours.dtype == theirs.dtype and not ours.dtype.is_complex
    assert math.isfinite(float(ours)) and float(ours) == pytest.approx(float(theirs))


def test_a_batch_that_is_one_tensor_is_named_as_check_all_names_it():
    x = torch.ones(3, 2)
    x[1, 0] = NAN
    report = nanfast.check_batch(x, raise_on_nonfinite=False)
    assert str(report) == "nanfast: non-finite values in sample 1 of field 'tensor' (nan=1, +inf=0, -inf=0)"


def test_a_tensor_whose_storage_was_freed_is_refused_by_name_not_read():
    """FSDP and offloading free a parameter's memory with storage().resize_(0): reading it crashed the
    process (torch's own ops do too); now an error names the entry (NOTE: [A storage smaller than its
    tensor])."""
    weight = torch.nn.Linear(4, 4).weight.detach()
    weight.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"nanfast.stats: tensors\[1\] reaches 64 bytes into its storage, which "
                                           r"holds 0 \(freed or shrunk"):
        nanfast.stats([torch.ones(2), weight])
    with pytest.raises(RuntimeError, match=r"^nanfast.check_all: 'w': .*freed or shrunk"):
        nanfast.check_all({"ok": torch.ones(2), "w": weight})
    many = [torch.ones(3) for _ in range(3000)]  # long lists read their data pointers on every thread
    many[2500] = weight
    with pytest.raises(RuntimeError, match=r"tensors\[2500\] reaches"):
        nanfast.any_nonfinite(many)
    # clip_grad_norm_ and check_batch name the entry too, not its position among those they read (a probe,
    # session 42: "tensors[1]" was the second gradient of a model whose first parameter had none).
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[0].weight.grad = None
    model[1].weight.grad.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"^nanfast.clip_grad_norm_: '1.weight': .*freed or shrunk"):
        nanfast.clip_grad_norm_(model.named_parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"^nanfast.check_batch: 'labels': .*freed or shrunk"):
        nanfast.check_batch({"x": torch.ones(2), "labels": weight})
    shrunk = torch.ones(8)
    view = shrunk[4:]
    shrunk.untyped_storage().resize_(20)  # 5 floats left: the view's last 3 are gone
    with pytest.raises(RuntimeError, match=r"tensors\[0\] reaches 32 bytes"):
        nanfast.stats([view])


# Session 43's probe of containers: a container whose own code raises, containers shared by many paths,
# tensors as mapping keys, an Enum whose value is a tensor.

class _LyingMapping(dict):
    def items(self):
        raise KeyError("a")


class _RaisingList(list):
    def __iter__(self):
        raise RuntimeError("boom")


def _unset_field():
    import dataclasses

    @dataclasses.dataclass
    class Pair:
        a: torch.Tensor
        b: torch.Tensor = dataclasses.field(init=False)  # set later, in a hook

    return Pair(torch.ones(1))


@pytest.mark.parametrize("make", [lambda: _LyingMapping(a=torch.ones(1)), lambda: _RaisingList([1])],
                         ids=["mapping whose items() raise", "list whose iter raises"])
def test_a_container_whose_own_code_raises_is_listed_not_checked(make):
    """Its exception escaped check_all and check_batch bare, naming nothing, and the NaN beside it went
    unreported."""
    batch = {"x": torch.tensor([NAN]), "c": make()}
    report = nanfast.check_all(batch, raise_on_nonfinite=False)
    assert [e.name for e in report.bad] == ["x"] and report.unchecked == ("c",)
    batch_report = nanfast.check_batch(batch, raise_on_nonfinite=False)
    assert [f.path for f in batch_report.bad] == ["x"] and "c" in str(batch_report)


def test_a_container_whose_own_code_raises_named_as_the_object_when_it_is_the_whole_input():
    """Passed itself, it was listed as not checked under an empty name ("not checked (...): ")."""
    report = nanfast.check_all(_LyingMapping(a=torch.ones(1)), raise_on_nonfinite=False)
    assert report.unchecked == ("the object (_LyingMapping)",) and "the object (_LyingMapping)" in str(report)


def test_entries_of_one_name_are_all_kept():
    """Pairs named alike, or a key "a.b" beside a["b"], made two entries of one name, and Report.norms
    kept only the last one's norm (a probe, session 49)."""
    nan = torch.tensor([NAN, 3.0])
    report = nanfast.check_all([("a", torch.tensor([3.0, 4.0])), ("a", nan)], raise_on_nonfinite=False)
    assert [e.name for e in report.entries] == ["a", "a (#2)"] and [e.name for e in report.bad] == ["a (#2)"]
    assert report.norms == {"a": 5.0, "a (#2)": 3.0}  # reference: the finite elements' L2 norms
    nested = nanfast.check_all({"a.b": torch.ones(4), "a": {"b": torch.full((1,), 2.0)}})
    assert nested.norms == {"a.b": 2.0, "a.b (#2)": 2.0} and len(nested.entries) == 2


def test_a_number_given_to_an_entry_of_one_name_is_one_no_other_entry_has():
    """A key that is itself named "a (#2)" beside two entries "a": the second "a" was named "a (#2)" too,
    and Report.norms kept one of the two (session 50's note, left until session 53)."""
    report = nanfast.check_all([("a", torch.ones(1)), ("a (#2)", torch.tensor([NAN, 2.0])), ("a", torch.full((1,), 3.0))],
                               raise_on_nonfinite=False)
    assert [e.name for e in report.entries] == ["a", "a (#2)", "a (#3)"]
    assert report.norms == {"a": 1.0, "a (#2)": 2.0, "a (#3)": 3.0} and [e.name for e in report.bad] == ["a (#2)"]
    later = nanfast.check_all([("a", torch.ones(1)), ("a", torch.ones(1)), ("a (#2)", torch.ones(1))])
    assert [e.name for e in later.entries] == ["a", "a (#2)", "a (#2) (#2)"] and len(later.norms) == 3


def test_a_dataclass_field_never_set_is_listed_alone_and_its_other_fields_are_checked():
    """The whole dataclass was listed as not checked, its NaN field called nothing."""
    pair = _unset_field()
    pair.a[0] = NAN
    report = nanfast.check_all({"c": pair}, raise_on_nonfinite=False)
    assert [e.name for e in report.bad] == ["c.a"] and report.unchecked == ("c.b",)
    batch_report = nanfast.check_batch({"c": pair}, raise_on_nonfinite=False)
    assert [f.path for f in batch_report.bad] == ["c.a"] and "c.b" in str(batch_report)


def test_a_container_shared_by_many_paths_is_walked_in_linear_time():
    """[x, x] nested 20 deep is a million paths to one tensor: 30 s before, a hang at 30 levels."""
    import time

    x = [torch.tensor([NAN])]
    for _ in range(30):
        x = [x, x]
    start = time.perf_counter()
    report = nanfast.check_all({"x": x}, raise_on_nonfinite=False)
    assert time.perf_counter() - start < 5  # a bound a hang cannot meet, not a timing
    assert not report.ok and len({e.name for e in report.entries}) == report.num_tensors <= 8
    shared = [torch.ones(1)]
    assert [e.name for e in nanfast.check_all({"a": shared, "b": shared}).entries] == ["a.0", "b.0"]


def test_a_tensor_used_as_a_mapping_key_is_checked():
    """Only values were walked: a NaN key was called clean."""
    report = nanfast.check_all({torch.tensor([NAN]): torch.tensor([1.0])}, raise_on_nonfinite=False)
    assert [e.name for e in report.bad] == ["<key 0>"] and report.num_tensors == 2


def test_an_enum_whose_value_is_a_tensor_is_not_called_clean():
    import enum

    class Preset(enum.Enum):
        SCALE = torch.tensor([NAN])
        ONE = 1

    report = nanfast.check_all({"p": Preset.SCALE, "q": Preset.ONE, "t": torch.ones(1)}, raise_on_nonfinite=False)
    assert report.unchecked == ("p",)
