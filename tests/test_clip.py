"""nanfast.clip_grad_norm_ and Watch.clip_grad_norm_ against torch's (session 44's probe): gradients named
as intended infinities, the inf-norm of complex gradients, the norm a watch records after clipping a
sparse gradient; the ops the watch's clip launches, and float64 norms past the range of their squares."""

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nanfast

INF = float("inf")


@pytest.mark.parametrize("name, grad", [("attn_mask", torch.tensor([[0.0, -INF]])), ("best_loss", torch.tensor([INF]))],
                         ids=["mask", "sentinel"])
def test_a_non_finite_gradient_raises_whatever_its_parameter_is_named(name, grad):
    """check_all's exemptions for additive masks and best-score sentinels applied to the gradients: the
    inf gradient stayed, the others were clipped around it, and nothing was raised."""
    p, q = torch.nn.Parameter(torch.zeros_like(grad)), torch.nn.Parameter(torch.zeros(4))
    p.grad, q.grad = grad.clone(), torch.ones(4)
    with pytest.raises(nanfast.NonFiniteError, match=rf"{name} "):
        nanfast.clip_grad_norm_([(name, p), ("lin.weight", q)], 1.0)
    assert torch.equal(q.grad, torch.ones(4))  # raised before the gradients were touched


def test_the_inf_norm_of_complex_gradients_is_of_their_moduli():
    """The kernels' max |x| of a complex tensor is of its parts: 3+4j gave 4, not torch's 5, and left the
    gradient at 1.25 > max_norm."""
    torch.manual_seed(0)
    grads = [torch.randn(50, dtype=torch.complex64), torch.tensor([3 + 4j], dtype=torch.complex64), torch.randn(7)]
    ours, theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads], [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, q, g in zip(ours, theirs, grads):
        p.grad, q.grad = g.clone(), g.clone()
    total = nanfast.clip_grad_norm_(ours, 1.0, math.inf)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, math.inf)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6) and total.item() == pytest.approx(5.0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad)
    model = torch.nn.Linear(1, 1, bias=False, dtype=torch.complex64)
    with nanfast.watch(model, torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        model.weight.grad = torch.tensor([[3 + 4j]], dtype=torch.complex64)
        assert w.clip_grad_norm_(1.0, math.inf).item() == pytest.approx(5.0)
        assert model.weight.grad.abs().item() == pytest.approx(1.0)


def test_the_watch_records_the_norm_before_clipping_a_sparse_gradient():
    """A sparse gradient is gathered as a new view of its values at each gather: the step took its pass as
    stale and read the clipped gradients again, recording 1.0, the norm after clipping."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt) as w:
        (model(torch.tensor([1, 2, 5])) * 100).sum().backward()
        returned = w.clip_grad_norm_(1.0)
        opt.step()
        assert returned.item() > 100
        assert w.stats()["grad_norm"] == pytest.approx(returned.item(), rel=1e-6)
        assert w.history[-1].grad_norm == pytest.approx(returned.item(), rel=1e-6)


def _mixed_params(g16: torch.Tensor, g32: torch.Tensor) -> list[torch.nn.Parameter]:
    a, b = torch.nn.Parameter(torch.zeros_like(g16)), torch.nn.Parameter(torch.zeros_like(g32))
    a.grad, b.grad = g16.clone(), g32.clone()
    return [a, b]


@pytest.mark.parametrize("watched", [False, True], ids=["function", "watch"])
@pytest.mark.parametrize("f32_scale", [1e4, 1e5])
def test_float16_gradients_beside_float32_ones_are_one_rounding_from_exact(f32_scale, watched):
    """The coefficient max_norm / norm (3e-6 and 3e-7 here) was rounded to float16 before scaling the
    float16 gradients: below float16's smallest normal it kept a few bits, and the clipped gradients were
    0.6% and 3% off, where torch's are within one float16 rounding (a probe, session 51)."""
    torch.manual_seed(0)
    g16 = (torch.randn(1000, dtype=torch.float64) * 1e3).half()
    g32 = (torch.randn(1000, dtype=torch.float64) * f32_scale).float()
    params = _mixed_params(g16, g32)
    if watched:
        model = torch.nn.Module()
        model.a, model.b = params
        with nanfast.watch(model, torch.optim.SGD(params, lr=0.0)) as w:
            w.clip_grad_norm_(1.0)
    else:
        nanfast.clip_grad_norm_(params, 1.0)
    coef = 1.0 / (torch.cat([g16.double(), g32.double()]).norm() + 1e-6)
    exact16, exact32 = g16.double() * coef, g32.double() * coef
    normal = exact16.abs() >= torch.finfo(torch.float16).tiny  # one rounding is relative only there
    assert ((params[0].grad.double() - exact16).abs() / exact16.abs())[normal].max().item() <= 2.0 ** -11
    # float32: the coefficient's rounding and the product's
    assert ((params[1].grad.double() - exact32).abs() / exact32.abs()).max().item() <= 2.0 ** -23


def test_a_one_element_tensor_max_norm_is_its_value_as_in_torch():
    """torch takes float(max_norm); nanfast raised from _foreach_mul_ ("scalar tensor expected to be 0 dim")
    with the gradients untouched (a probe, session 51)."""
    torch.manual_seed(0)
    ours, theirs = (torch.nn.Parameter(torch.zeros(8)) for _ in range(2))
    ours.grad = torch.randn(8) * 10
    theirs.grad = ours.grad.clone()
    total = nanfast.clip_grad_norm_([ours], torch.tensor([1.0]))
    assert torch.equal(total, torch.nn.utils.clip_grad_norm_([theirs], torch.tensor([1.0])))
    assert torch.allclose(ours.grad, theirs.grad, rtol=1e-6)


class _Launches(TorchDispatchMode):
    """The ops a code would launch on a GPU, by name: all but views and dtype queries."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        if not view and func is not torch.ops.aten.promote_types.default:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_watchs_clip_launches_no_more_than_torchs_beside_the_check():
    """Each op is a launch on a GPU: the watch's clip combined the gradients' norms in seven ops (overflow-
    safe scaling) where torch's clip makes two, eight launches more than torch's clip beside the step's
    check. Gradients of 32 bits or fewer cannot reach that overflow: their norms take one vector norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8) * 10
    with nanfast.watch(model, torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        model(x).sum().backward()
        with _Launches() as ours:
            total = w.clip_grad_norm_(1.0)
    reference(x).sum().backward()
    with _Launches() as theirs:
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    assert ours.ops.count("nanfast.stats.default") == 1  # the step's check, which the clip reuses
    assert len(ours.ops) <= len(theirs.ops) + 1, (ours.ops, theirs.ops)
    assert total.dtype == expected.dtype and torch.allclose(total, expected, rtol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("watched", [False, True], ids=["function", "watch"])
def test_float64_gradients_past_the_range_of_their_squares_keep_their_norm(watched):
    """A float64 gradient's norm can pass 1e154, whose square overflows: those norms are still combined
    relative to the largest (NOTE: [Combining norms])."""
    p, q = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    p.grad, q.grad = torch.tensor([3e200, 4e200, 0.0], dtype=torch.float64), torch.tensor([12e200], dtype=torch.float64)
    if watched:
        model = torch.nn.Module()
        model.p, model.q = p, q
        with nanfast.watch(model, torch.optim.SGD([p, q], lr=0.0)) as w:
            total = w.clip_grad_norm_(1.0)
    else:
        total = nanfast.clip_grad_norm_([p, q], 1.0)
    assert total.item() == pytest.approx(13e200, rel=1e-12)
    torch.testing.assert_close(torch.cat([p.grad, q.grad]), torch.tensor([3, 4, 0, 12], dtype=torch.float64) / 13)
