"""nanfast.clip_grad_norm_ and Watch.clip_grad_norm_ against torch's (session 44's probe): gradients named
as intended infinities, the inf-norm of complex gradients, the norm a watch records after clipping a
sparse gradient."""

import math

import pytest
import torch

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
