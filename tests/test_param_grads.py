"""_C.ParamGrads: the watch's step-end pass lists the optimizer's parameters, their names and gradients
in C++ (NOTE: [The pass's parameters in C++]); the same lists as the Python it replaced, and the name
tuples handed out again only while nothing they describe changed."""

import pytest
import torch

import nanfast
from nanfast import _C


def python_gather(params, names):
    """What the watch's Python did before: the reference."""
    named = tuple(names.get(id(p)) or f"param[{i}]" for i, p in enumerate(params))
    with_grad = [(n, p.grad) for n, p in zip(named, params) if p.grad is not None]
    grads = [g._values() if g.layout == torch.sparse_coo else g if g.layout == torch.strided else g.values()
             for _, g in with_grad]
    return params, named, grads, tuple(n for n, _ in with_grad)


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 3))
    extra = torch.nn.Parameter(torch.randn(2))  # not in the model: named param[i]
    opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [extra]}], lr=0.1)
    return model, opt, extra


def test_gather_matches_the_python_lists_and_keeps_its_tuples_while_nothing_changes():
    model, opt, extra = model_and_optimizer()
    names = {id(p): name for name, p in model.named_parameters()}
    pg = _C.ParamGrads(lambda: names)
    params = [p for g in opt.param_groups for p in g["params"]]

    first = pg.gather(opt.param_groups, groups=True)
    assert first[0] == params and first[1] == ("0.weight", "1.weight", "1.bias", "param[3]") and first[2:] == ([], ())

    model(torch.tensor([[1, 2, 3]])).sum().backward()  # a sparse gradient for the embedding; none for extra
    got = pg.gather(opt.param_groups, groups=True)
    want = python_gather(params, names)
    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3] == ("0.weight", "1.weight", "1.bias")
    assert len(got[2]) == 3 and got[2][1] is model[1].weight.grad and got[2][2] is model[1].bias.grad
    # The sparse gradient's values (a new view at each call), not the sparse tensor.
    assert got[2][0].layout == torch.strided and torch.equal(got[2][0], want[2][0])
    assert got[2][0].data_ptr() == model[0].weight.grad._values().data_ptr()
    assert got[1] is first[1]  # same parameters: the same names tuple

    again = pg.gather(opt.param_groups, groups=True)
    assert again[1] is got[1] and again[3] is got[3]  # nothing changed: the same objects

    extra.grad = torch.ones(2)
    now = pg.gather(opt.param_groups, groups=True)
    assert now[3] == ("0.weight", "1.weight", "1.bias", "param[3]") and now[3] is not got[3]
    assert now[2][-1] is extra.grad

    opt.param_groups[1]["params"][0] = other = torch.nn.Parameter(torch.zeros(2))  # replaced in place
    replaced = pg.gather(opt.param_groups, groups=True)
    assert replaced[0][-1] is other and replaced[1] is not now[1] and replaced[3] == ("0.weight", "1.weight", "1.bias")

    plain = pg.gather(list(model.parameters()), groups=False)
    assert plain[1] == ("0.weight", "1.weight", "1.bias")

    with pytest.raises(RuntimeError, match=r"parameter 1 of the optimizer's param_groups is a str, not a torch.Tensor"):
        pg.gather([{"params": [extra, "w"]}], groups=True)


def test_gather_of_a_long_mixed_list_matches_the_python_lists():
    # Long enough for every prefetch stage (NOTE: [Each parameter's gradient, prefetched]) to look ahead
    # at each kind of entry: with and without a gradient, sparse and non-contiguous gradients, plain tensors with
    # no autograd metadata, and a non-tensor entry that the prefetches meet before the check names it.
    torch.manual_seed(0)
    params = []
    for i in range(60):
        kind = i % 6
        if kind == 5:
            params.append(torch.randn(3))  # no autograd metadata, no gradient
            continue
        p = torch.nn.Parameter(torch.randn(4, 3))
        if kind == 1:
            p.grad = torch.randn(4, 3)
        elif kind == 2:
            p.grad = torch.randn(4, 3).to_sparse()
        elif kind == 4:
            p.grad = torch.randn(4, 3).t().contiguous().t()  # strided, not contiguous
        params.append(p)
    names = {id(p): f"p{i}" for i, p in enumerate(params) if i % 7}
    pg = _C.ParamGrads(lambda: names)
    for source, groups in ((params, False), ([{"params": params[:25]}, {"params": params[25:]}], True)):
        got = pg.gather(source, groups=groups)
        want = python_gather(params, names)
        assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3]
        assert len(got[2]) == len(want[2]) == 30
        assert all(a.layout == torch.strided and torch.equal(a, b) for a, b in zip(got[2], want[2]))
    with pytest.raises(RuntimeError, match=r"parameter 50 of the model is a int, not a torch.Tensor"):
        pg.gather(params[:50] + [7] + params[50:], groups=False)


def test_a_watch_names_a_gradient_outside_the_model_by_position():
    model, opt, extra = model_and_optimizer()
    opt.zero_grad()
    with nanfast.watch(model, opt, action="warn") as w:
        model(torch.tensor([[1, 2]])).sum().backward()
        extra.grad = torch.tensor([float("nan"), 0.0])
        with pytest.warns(RuntimeWarning, match=r"param\[3\]"):
            opt.step()
    assert [(p.phase, p.name) for p in w.last.places] == [("grad", "param[3]")]


def test_names_come_from_the_model_as_it_is_when_the_parameters_change():
    """A head replaced after watch() is named by its place in the model, and a new parameter that takes
    the address a dropped one left does not take its name (the map is the model's at that moment); the
    new module is hooked (NOTE: [A model changed after watch()])."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    calls = []
    pg = _C.ParamGrads(lambda: calls.append(1) or {id(p): name for name, p in model.named_parameters()})
    pg.gather(list(model.parameters()), groups=False)
    pg.gather(list(model.parameters()), groups=False)
    assert len(calls) == 1  # asked again only when the list changes
    model[2] = torch.nn.Linear(4, 3)
    assert pg.gather(list(model.parameters()), groups=False)[1] == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert len(calls) == 2

    with nanfast.watch(model, action="warn") as w:
        model[0] = torch.nn.Linear(4, 4)  # replaced after watch(): a new weight, unhooked module
        with torch.no_grad():
            model[0].bias[1] = float("inf")
        model(torch.randn(3, 4)).sum().backward()
        with pytest.warns(RuntimeWarning, match=r"parameter 0\.bias "):
            w.step()
    assert w.last.first.name == "0.bias"
    assert w.last.later[0].where() == "output of 0 (Linear)"  # the new module is hooked at the next step's start


def test_a_parametrization_added_after_watch_renames_its_parameter():
    """torch.nn.utils.parametrize moves a weight to `parametrizations.weight.original` (the same Parameter,
    so the optimizer's list does not change): the watch names it as the model now does."""
    from torch.nn.utils import parametrize

    class Symmetric(torch.nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(-1, -2)

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action="warn") as w:
        opt.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        parametrize.register_parametrization(model[0], "weight", Symmetric())
        with torch.no_grad():
            model[0].parametrizations.weight.original[0, 0] = float("nan")
        opt.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
        with pytest.warns(RuntimeWarning, match=r"parameter 0\.parametrizations\.weight\.original "):
            opt.step()
    assert w.last.first.name == "0.parametrizations.weight.original"
