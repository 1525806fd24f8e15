"""nanfast.check_all and its Report / NonFiniteError."""

from __future__ import annotations

import json
import math
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
    obj = {"model": {"w": a, "layers": [b, (c, 7)]}, "lr": 0.1, "step": 3}
    report = check_all(obj, raise_on_nonfinite=False)
    assert [e.name for e in report.entries] == ["model.w", "model.layers.0", "model.layers.1.0"]
    assert [e.name for e in report.bad] == ["model.layers.1.0"]


def test_iterables_of_tensors_and_of_pairs():
    a, b = torch.randn(4), torch.randn(2, 2)
    assert [e.name for e in check_all([a, b]).entries] == ["0", "1"]
    assert [e.name for e in check_all(iter([("first", a), ("second", b)])).entries] == ["first", "second"]
    assert [e.name for e in check_all((t for t in (a, b))).entries] == ["0", "1"]


def test_empty_inputs():
    for obj in ([], {}, torch.nn.ReLU()):
        report = check_all(obj)
        assert report.ok and report.num_tensors == 0 and report.num_elements == 0 and report.total_norm == 0.0


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
    with pytest.raises(TypeError, match="entry 1 is of type str"):
        check_all([torch.ones(2), "weights"])
    with pytest.raises(TypeError, match="cannot check a int"):
        check_all(3)


def test_sparse_entry_is_named():
    with pytest.raises(ValueError, match=r"'emb' has layout torch\.sparse_coo"):
        check_all([("dense", torch.ones(2)), ("emb", torch.ones(3).to_sparse())])


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
