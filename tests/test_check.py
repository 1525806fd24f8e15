"""nanfast.check_all and its Report / NonFiniteError."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import pathlib
import warnings

import pytest
import torch
from reference import FLOAT4_E2M1FN_X2, FLOAT8_E8M0FNU, reference_stats, torch_total_norm, unsupported_dtype_tensor

import nanfast
from nanfast import NonFiniteError, Report, check_all


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def manual_total_norm(tensors) -> float:
    return math.sqrt(sum(reference_stats(t).norm ** 2 for t in tensors))


def test_module_parameters_and_floating_buffers():
    model = small_model()
    report = check_all(model)
    # BatchNorm's num_batches_tracked is an int64 counter, not a value to check.
    expected = dict(model.named_parameters()) | {
        name: b for name, b in model.named_buffers() if name != "1.num_batches_tracked"
    }
    assert [e.name for e in report.entries] == list(dict(model.named_parameters())) + [
        "1.running_mean", "1.running_var"
    ]
    assert report.ok and report.bad == [] and report.num_tensors == len(expected)
    assert report.num_elements == sum(t.numel() for t in expected.values())
    for name, norm in report.norms.items():
        assert math.isclose(norm, reference_stats(expected[name]).norm, rel_tol=1e-6)
    assert math.isclose(report.total_norm, manual_total_norm(expected.values()), rel_tol=1e-6)
    assert math.isclose(report.total_norm, torch_total_norm(expected.values()).item(),
                        rel_tol=1e-5)


def test_poisoned_parameter_is_reported():
    model = small_model()
    with torch.no_grad():
        model[0].weight[1, 2] = math.nan
        model[2].bias[0] = -math.inf
        model[1].running_var[3] = math.inf
    with pytest.raises(NonFiniteError) as e:
        check_all(model)
    assert isinstance(e.value, FloatingPointError)
    report = e.value.report
    assert isinstance(report, Report) and not report.ok
    assert [b.name for b in report.bad] == ["0.weight", "2.bias", "1.running_var"]
    weight = report.bad[0]
    assert (weight.shape, weight.dtype, weight.device, weight.numel) == ((4, 3), "float32", "cpu", 12)
    assert (weight.nan, weight.posinf, weight.neginf, weight.nonfinite) == (1, 0, 0, 1)
    assert (report.bad[1].nan, report.bad[1].posinf, report.bad[1].neginf) == (0, 0, 1)
    assert (report.bad[2].nan, report.bad[2].posinf, report.bad[2].neginf) == (0, 1, 0)
    # The norm is that of the finite elements.
    assert math.isclose(weight.norm, reference_stats(model[0].weight.detach()).norm, rel_tol=1e-6)
    message = str(e.value)
    for name, counts in [("0.weight", "nan=1, +inf=0, -inf=0"), ("2.bias", "nan=0, +inf=0, -inf=1"),
                         ("1.running_var", "nan=0, +inf=1, -inf=0")]:
        assert f"{name} " in message and counts in message
    assert "3 of 8" in message


class MXLinear(torch.nn.Module):
    """A linear layer stored as MX does it: packed fp4 weights and one e8m0 scale per block of 32."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.register_buffer("weight", torch.randint(0, 256, (8, 16), generator=gen, dtype=torch.uint8).view(
            FLOAT4_E2M1FN_X2))  # 8 x 32 fp4 values
        self.register_buffer("weight_scale", torch.randint(100, 140, (8, 1), generator=gen, dtype=torch.uint8).view(
            FLOAT8_E8M0FNU))
        self.bias = torch.nn.Parameter(torch.zeros(8))


@pytest.mark.skipif(FLOAT4_E2M1FN_X2 is None, reason="torch has no MX dtypes (torch < 2.8)")
def test_mx_scale_and_packed_weight_buffers():
    model = MXLinear()
    report = check_all(model)
    assert report.ok and [e.name for e in report.entries] == ["bias", "weight", "weight_scale"]
    entries = {e.name: e for e in report.entries}
    assert (entries["weight"].numel, entries["weight"].dtype) == (128, "float4_e2m1fn_x2")  # bytes, as torch counts
    for name in ("weight", "weight_scale"):
        ref = reference_stats(getattr(model, name))
        assert math.isclose(entries[name].norm, ref.norm, rel_tol=1e-12) and entries[name].absmax == ref.absmax
    model.weight_scale.view(torch.uint8)[5, 0] = 0xFF  # e8m0's only NaN
    with pytest.raises(NonFiniteError) as e:
        check_all(model)
    [bad] = e.value.report.bad
    assert (bad.name, bad.dtype, bad.nan, bad.posinf, bad.neginf) == ("weight_scale", "float8_e8m0fnu", 1, 0, 0)
    assert "weight_scale" in str(e.value)


def test_raise_on_nonfinite_false_returns_the_report():
    model = small_model()
    with torch.no_grad():
        model[2].weight[0, 0] = math.nan
    report = check_all(model, raise_on_nonfinite=False)
    assert not report.ok and [b.name for b in report.bad] == ["2.weight"]


def test_gradients_skip_parameters_without_one():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 2)})
    model["used"](torch.randn(5, 3)).square().sum().backward()
    report = check_all(model, grads=True)
    assert [e.name for e in report.entries] == ["used.weight", "used.bias"]
    grads = [model["used"].weight.grad, model["used"].bias.grad]
    assert math.isclose(report.total_norm, manual_total_norm(grads), rel_tol=1e-6)
    model["used"].bias.grad[1] = math.inf
    with pytest.raises(NonFiniteError, match=r"used\.bias"):
        check_all(model, grads=True)
    check_all(model)  # the parameters themselves are still finite


def test_tensor_with_and_without_grad():
    t = torch.randn(3, requires_grad=True)
    assert [e.name for e in check_all(t).entries] == ["tensor"]
    try:  # without a .grad: nothing to check (as for a module's parameters), or an error that says so
        report = check_all(t, grads=True)
        assert report.num_tensors == 0
    except (ValueError, TypeError) as e:
        assert "grad" in str(e)
    (t * torch.tensor([1.0, math.inf, 1.0])).sum().backward()
    with pytest.raises(NonFiniteError) as e:
        check_all(t, grads=True)
    assert e.value.report.bad[0].posinf == 1


def test_state_dict():
    model = small_model()
    state = model.state_dict()
    report = check_all(state)
    assert [e.name for e in report.entries] == list(state)
    assert report.entries[list(state).index("1.num_batches_tracked")].dtype == "int64"
    state["1.running_mean"][0] = math.nan
    with pytest.raises(NonFiniteError, match=r"1\.running_mean"):
        check_all(state)


def test_optimizer_state_after_one_adam_step():
    model = small_model()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 3)).square().mean().backward()
    optimizer.step()
    report = check_all(optimizer)
    names = [e.name for e in report.entries]
    for i in range(len(list(model.parameters()))):
        assert f"state.{i}.exp_avg" in names and f"state.{i}.exp_avg_sq" in names
    assert report.ok
    first = next(iter(model.parameters()))
    optimizer.state[first]["exp_avg"].view(-1)[0] = math.inf
    with pytest.raises(NonFiniteError) as e:
        check_all(optimizer)
    assert [(b.name, b.posinf) for b in e.value.report.bad] == [("state.0.exp_avg", 1)]
    with pytest.raises(ValueError, match="grads=True"):
        check_all(optimizer, grads=True)


def test_nested_containers():
    a, b, c = torch.randn(2), torch.randn(3, 3), torch.tensor([math.nan])
    obj = {"model": {"w": a, "layers": [b, (c, 7)]}, "lr": 0.1, "step": 3, "name": "run-1", "sched": None}
    report = check_all(obj, raise_on_nonfinite=False)
    # A float is a value (checked, as float64); ints, strings and None hold none.
    assert [e.name for e in report.entries] == ["model.w", "model.layers.0", "model.layers.1.0", "lr"]
    assert [e.name for e in report.bad] == ["model.layers.1.0"]
    assert report.entries[-1].dtype == "float64" and report.entries[-1].norm == 0.1 and report.unchecked == ()


def test_iterables_of_tensors_and_of_pairs():
    a, b = torch.randn(4), torch.randn(2, 2)
    assert [e.name for e in check_all([a, b]).entries] == ["0", "1"]
    assert [e.name for e in check_all(iter([("first", a), ("second", b)])).entries] == ["first", "second"]
    assert [e.name for e in check_all((t for t in (a, b))).entries] == ["0", "1"]


# --- what containers hold: nothing lost, nothing falsely clean (issue 13) ---------------------------


def test_dataloader_style_list_of_input_target_pairs():
    """A (x, y) tuple used to be read as a (name, tensor) pair: x became a name, its NaN unchecked."""
    torch.manual_seed(0)
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    batches[1][0][2, 1] = math.nan
    with pytest.raises(NonFiniteError) as e:
        check_all(batches)
    report = e.value.report
    assert [x.name for x in report.entries] == ["0.0", "0.1", "1.0", "1.1", "2.0", "2.1"]
    assert [(b.name, b.nan) for b in report.bad] == [("1.0", 1)]
    # A pair names its value only when the name is a str.
    x, y = batches[0]
    assert [x.name for x in check_all([("image", x), ("label", y)]).entries] == ["image", "label"]


def test_list_of_namedtuple_batches():
    Batch = collections.namedtuple("Batch", ["image", "mask"])
    batches = [Batch(torch.ones(2, 2), torch.ones(2)), Batch(torch.tensor([[1.0, math.inf]]), torch.ones(1))]
    with pytest.raises(NonFiniteError) as e:
        check_all(batches)
    assert [x.name for x in e.value.report.entries] == ["0.image", "0.mask", "1.image", "1.mask"]
    assert [(b.name, b.posinf) for b in e.value.report.bad] == [("1.image", 1)]


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    targets: torch.Tensor
    meta: dict = dataclasses.field(default_factory=dict)


def test_dataclass_inside_a_mapping():
    """A dataclass inside a dict used to be dropped silently (and the report said ok)."""
    batch = Batch(torch.ones(3), torch.tensor([0.5, math.nan]), {"weights": torch.ones(2), "source": "a.txt"})
    with pytest.raises(NonFiniteError) as e:
        check_all({"batch": batch, "step": 4})
    assert [x.name for x in e.value.report.entries] == ["batch.tokens", "batch.targets", "batch.meta.weights"]
    assert [b.name for b in e.value.report.bad] == ["batch.targets"]
    assert [x.name for x in check_all(Batch(torch.ones(1), torch.ones(1))).entries] == ["tokens", "targets"]


def test_optimizer_state_dict_with_float_hyperparameters_and_a_nan_loss():
    """A checkpoint's Python floats (the learning rate, a stored loss) are values: a NaN one is found."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(8, 3)).square().mean().backward()
    optimizer.step()
    checkpoint = {"optimizer": optimizer.state_dict(), "epoch": 3, "loss": float("nan")}
    with pytest.raises(NonFiniteError) as e:
        check_all(checkpoint)
    report = e.value.report
    names = [x.name for x in report.entries]
    assert "optimizer.state.0.momentum_buffer" in names and "optimizer.param_groups.0.lr" in names
    assert report.entries[names.index("optimizer.param_groups.0.lr")].absmax == 0.01
    assert "optimizer.param_groups.0.params.0" not in names  # parameter indices are ints
    assert [(b.name, b.shape, b.dtype, b.nan) for b in report.bad] == [("loss", (), "float64", 1)]
    checkpoint["optimizer"]["param_groups"][0]["lr"] = math.inf
    checkpoint["loss"] = 0.25
    with pytest.raises(NonFiniteError, match=r"optimizer\.param_groups\.0\.lr"):
        check_all(checkpoint)


def test_numpy_arrays_in_a_dict():
    """numpy arrays used to be skipped silently; they are read (without a copy) like CPU tensors.
    One torch cannot read (dtype object) is listed as not checked."""
    np = pytest.importorskip("numpy")
    stats = np.array([1.0, np.nan, 3.0], dtype=np.float32)
    frozen = np.array([np.inf, 2.0])
    frozen.setflags(write=False)
    state = {"weight": torch.ones(2), "running": stats, "frozen": frozen, "counts": np.arange(3),
             "scale": np.float64(-np.inf), "swapped": np.array([np.nan], dtype=">f8"),
             "table": np.array([None, 1.0], dtype=object), "names": np.array(["a", "b"])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable array" warning
        report = check_all(state, raise_on_nonfinite=False)
    assert [(x.name, x.dtype) for x in report.entries] == [
        ("weight", "float32"), ("running", "float32"), ("frozen", "float64"), ("counts", "int64"),
        ("scale", "float64"), ("swapped", "float64")]
    assert [(b.name, b.nan, b.posinf, b.neginf) for b in report.bad] == [
        ("running", 1, 0, 0), ("frozen", 0, 1, 0), ("scale", 0, 0, 1), ("swapped", 1, 0, 0)]
    assert math.isclose(report.entries[1].norm, math.sqrt(10))
    assert report.unchecked == ("table",)


def test_objects_that_cannot_be_read_are_listed_not_called_clean():
    class Opaque:
        def __init__(self):
            self.hidden = torch.tensor([math.nan])

    report = check_all({"w": torch.ones(2), "extra": Opaque(), "more": [Opaque()]})
    assert report.ok and [x.name for x in report.entries] == ["w"]
    assert report.unchecked == ("extra", "more.0")
    assert "not checked" in report.summary() and "extra, more.0" in report.summary()
    assert "more.0" in str(report) and report.to_dict()["unchecked"] == ["extra", "more.0"]


def test_containers_that_hold_themselves():
    """A list in itself, a dict referencing itself: RecursionError before; each is walked once."""
    looped = [torch.ones(2), torch.tensor([math.nan])]
    looped.append(looped)
    state = {"w": torch.ones(3)}
    state["self"] = state
    state["inner"] = {"parent": state, "b": torch.tensor([-math.inf])}
    report = check_all({"list": looped, "state": state}, raise_on_nonfinite=False)
    assert [x.name for x in report.entries] == ["list.0", "list.1", "state.w", "state.inner.b"]
    assert [b.name for b in report.bad] == ["list.1", "state.inner.b"]
    shared = [torch.ones(1)]
    assert [x.name for x in check_all({"a": shared, "b": shared}).entries] == ["a.0", "b.0"]  # not a cycle


def test_tensors_in_sets_are_checked():
    """A set was a leaf: listed as not checked, its tensors' NaN not found; now walked as scan walks it."""
    report = check_all({"w": torch.ones(1), "group": {torch.tensor([math.nan])}}, raise_on_nonfinite=False)
    assert [x.name for x in report.bad] == ["group.0"] and report.unchecked == ()


def test_deeply_nested_containers():
    deep = torch.tensor([math.nan])
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(NonFiniteError) as e:
        check_all({"deep": deep})
    assert e.value.report.bad[0].name == "deep" + ".0" * 15 + "<4969-levels>" + ".0" * 16  # ends kept (test_tree.py)


def test_nested_tensor_entry():
    a, b = torch.tensor([[1.0, math.nan]]), torch.tensor([[2.0, 3.0], [4.0, 5.0]])
    report = check_all({"jagged": torch.nested.nested_tensor([a, b], layout=torch.jagged)}, raise_on_nonfinite=False)
    (entry,) = report.entries
    assert (entry.name, entry.shape, entry.numel, entry.nan) == ("jagged", (2, -1, 2), 6, 1)
    assert math.isclose(entry.norm, math.sqrt(1 + 4 + 9 + 16 + 25))


def test_empty_inputs():
    for obj in ([], {}, torch.nn.ReLU()):
        report = check_all(obj)
        assert report.ok and report.num_tensors == 0 and report.num_elements == 0 and report.total_norm == 0.0
        # nothing was looked at: the summary does not call it finite
        assert report.summary() == "no tensors found: nothing was checked"
    # the gradients of a model before its first backward: none to check, not "all finite"
    assert check_all(torch.nn.Linear(2, 2), grads=True).summary() == "no tensors found: nothing was checked"
    assert check_all(torch.ones(3)).summary() == "the 1 tensor is finite (3 elements)"


def many_bad_tensors():
    tensors = [(f"bad_{i:02d}", torch.tensor([1.0, math.nan, 2.0])) for i in range(25)]
    return tensors + [(f"good_{i}", torch.ones(2)) for i in range(5)]


def test_message_names_the_first_20_and_counts_the_rest():
    with pytest.raises(NonFiniteError) as e:
        check_all(many_bad_tensors())
    message = str(e.value)
    assert "25 of 30 tensors" in message
    for i in range(20):
        assert f"bad_{i:02d} [3] (nan=1, +inf=0, -inf=0)" in message
    for i in range(20, 25):
        assert f"bad_{i:02d}" not in message
    assert "and 5 more" in message and "good_" not in message
    assert len(e.value.report.bad) == 25


def test_report_str_and_to_dict():
    report = check_all(many_bad_tensors(), raise_on_nonfinite=False)
    text = str(report)
    for i in range(25):
        assert f"bad_{i:02d}" in text  # the table lists every bad tensor
    assert "good_0" not in text and "nan" in text and "+inf" in text
    decoded = json.loads(json.dumps(report.to_dict()))
    assert decoded["ok"] is False and decoded["num_tensors"] == 30 and decoded["num_elements"] == 25 * 3 + 5 * 2
    assert [b["name"] for b in decoded["bad"]] == [f"bad_{i:02d}" for i in range(25)]
    assert decoded["bad"][0]["shape"] == [3] and decoded["bad"][0]["nan"] == 1
    assert decoded["norms"] == report.norms and math.isclose(decoded["total_norm"], report.total_norm)
    assert math.isclose(report.total_norm, math.sqrt(25 * 5 + 5 * 2), rel_tol=1e-12)
    ok = check_all([torch.ones(2)] * 3)
    assert "all 3 tensors are finite" in str(ok) and json.loads(json.dumps(ok.to_dict()))["ok"] is True


def test_total_norm_of_float64_tensors_near_max():
    big = torch.full((2,), 1e307, dtype=torch.float64)
    report = check_all([big, big, big])
    assert math.isclose(report.total_norm, 1e307 * math.sqrt(6), rel_tol=1e-12)


# --- bad entries ----------------------------------------------------------------------------------


def test_non_tensor_entry():
    # A string in a list holds no values (as in a collated batch of file names): nothing to check.
    assert [e.name for e in check_all([torch.ones(2), "weights"]).entries] == ["0"]
    with pytest.raises(TypeError, match="cannot check a int"):
        check_all(3)
    with pytest.raises(TypeError, match="cannot check a object"):
        check_all(object())
    for path in ("model.pt", pathlib.Path("model.pt")):  # a checkpoint's path: scan reads files
        with pytest.raises(TypeError, match=r"cannot check a (str|\w*Path) \(for a checkpoint file: nanfast.scan.scan_file"):
            check_all(path)


def test_grads_of_a_container_is_an_error():
    """grads=True used to be ignored for a dict or a list: the values were checked, not gradients."""
    t = torch.ones(2, requires_grad=True)
    for obj in ({"w": t}, [t]):
        with pytest.raises(ValueError, match="grads=True"):
            check_all(obj, grads=True)


def test_sparse_gradients_and_optimizer_state_are_read_through_their_values():
    """check_all(model, grads=True) of an nn.Embedding(sparse=True), and check_all(optimizer) of its SGD's
    sparse momentum, raised "has layout torch.sparse_coo" although the watch and the scans read such
    tensors (a probe, session 50). A COO tensor is coalesced: its duplicate entries (one per occurrence
    of a token) are summed as its values are, so inf + -inf is the NaN it makes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([[1, 2, 2, 5]])).sum().backward()
    grad = model[0].weight.grad
    assert grad.layout == torch.sparse_coo and not grad.is_coalesced()  # token 2 twice: duplicates
    report = check_all(model, grads=True)
    dense = grad.to_dense().double()  # reference: the gradient as a dense float64 tensor
    assert report.entries[0].name == "0.weight" and report.entries[0].numel == 40
    assert report.norms["0.weight"] == pytest.approx(dense.norm().item(), rel=1e-6)
    optimizer.step()
    state = check_all(optimizer)
    assert state.ok and state.entries[0].name == "state.0.momentum_buffer"
    # inf and -inf at one token sum to NaN in the tensor: counted as it holds them.
    bad = torch.sparse_coo_tensor(torch.tensor([[3, 3, 7]]), torch.tensor([math.inf, -math.inf, 1.0]), (9,))
    entry = check_all({"g": bad}, raise_on_nonfinite=False).bad[0]
    assert (entry.nan, entry.posinf, entry.neginf, entry.numel) == (1, 0, 0, 9)
    csr = torch.eye(3).to_sparse_csr()
    csr.values()[1] = math.nan
    assert check_all({"csr": csr}, raise_on_nonfinite=False).bad[0].nan == 1
    with pytest.raises(ValueError, match=r"'m' has layout torch\._mkldnn"):
        check_all([("dense", torch.ones(2)), ("m", torch.ones(3).to_mkldnn())])


def test_meta_entry_is_named():
    with pytest.raises(ValueError, match=r"'head\.weight' is a meta tensor"):
        check_all({"body": torch.ones(2), "head": {"weight": torch.empty(2, device="meta")}})


def test_unsupported_dtype_entry_is_named():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        quantized = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    for bad in (unsupported_dtype_tensor(), quantized):
        with pytest.raises((ValueError, TypeError, RuntimeError)) as e:
            check_all([("a", torch.ones(2)), ("b", torch.ones(2)), ("scales", bad)])
        assert "scales" in str(e.value), str(e.value)


# --- host syncs -----------------------------------------------------------------------------------


def test_one_fused_pass_and_one_host_read_per_device(op_recorder, monkeypatch):
    """check_all reads its results back once per device. A device-to-host read is an
    aten._local_scalar_dense (item, bool, int, float), or tolist()/numpy(), which read memory without
    dispatching an op (on a GPU, .tolist() first copies to the host with aten._to_copy): count both."""
    host_reads = []
    for method in ("tolist", "numpy"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            host_reads.append((_method, str(self.device)))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
    with torch.no_grad():
        model[7].bias[3] = math.nan
    with op_recorder() as ops:
        report = check_all(model, raise_on_nonfinite=False)
    assert report.num_tensors == 40 and [b.name for b in report.bad] == ["7.bias"]
    assert ops.counts["nanfast.stats.default"] == 1
    assert ops.devices["nanfast.stats.default"] == [{"cpu"}]
    assert ops.host_syncs + len(host_reads) == 1, (ops.host_syncs, host_reads)
