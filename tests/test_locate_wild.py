"""locate on what probing found in sessions 37 and 38: a training-mode BatchNorm, whose running statistics
aten.native_batch_norm updates in place without its schema saying so, a backward fault under
torch.func (per-sample gradients with vmap(grad), jacrev), and a backward node judged whatever hooks it
has."""

import inspect

import pytest
import torch

from nanfast.locator import locate


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(inspect.getsource(inspect.getmodule(line_of)).splitlines(), 1)
                if marker in text and "line_of" not in text)


def run(fn, action="record"):
    finder = locate(action=action)
    try:
        with finder:
            fn()
    except Exception:  # noqa: BLE001  (action="raise": the finding is on the finder)
        pass
    return finder


def test_a_nan_into_a_training_batchnorm_is_one_finding_at_its_producer():
    """The running statistics were read after the op had updated them with NaN, and called dirty data
    from outside: a second, false finding at native_batch_norm."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4)
    x = torch.rand(6, 4)

    def step():
        h = torch.log(x - 0.5)  # the fault
        bn(h).sum()

    finder = run(step)
    assert [(f.kind, f.op, f.where.lineno) for f in finder.findings] == [
        ("producer", "aten.log.default", line_of("# the fault"))]


def test_an_inf_into_a_training_batchnorm_is_its_producer_with_the_statistics_as_they_were():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4)
    x = torch.rand(6, 4)
    x[0, 0] = float("inf")
    finder = run(lambda: bn(x).sum(), action="raise")
    f = finder.finding
    assert (f.kind, f.op) == ("producer", "aten.native_batch_norm.default")
    shown = str(f)
    assert "running_mean: [4] float32 nan=0 +inf=0 -inf=0 min=0 max=0" in shown
    assert "running_var: [4] float32 nan=0 +inf=0 -inf=0 min=1 max=1" in shown


def test_a_backward_fault_under_vmap_of_grad_is_located():
    """Per-sample gradients: the backward node's hook got vmap's batched tensors and the kernels, which
    have no batching rule, raised; the user's own call failed with no finding."""
    def loss(w, x):
        return torch.sqrt(w * x).sum()  # sqrt at 0: an inf gradient

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))
    w = torch.tensor([0.0, 1.0, 2.0])
    healthy = run(lambda: per_sample(w + 1.0, torch.ones(5, 3)))
    assert healthy.findings == []
    finder = run(lambda: per_sample(w, torch.ones(5, 3)))
    assert [(f.kind, f.op, f.node, f.where.lineno) for f in finder.findings] == [
        ("producer", "aten.div.Tensor", "SqrtBackward0", line_of("# sqrt at 0"))]


@pytest.mark.parametrize("users_hook", [False, True])
def test_a_backward_node_is_judged_the_same_whatever_hooks_it_has(users_hook):
    """A node's held finding stood only if the gradients it received were finite, asked of a post hook
    added while the node ran: torch hands such a hook those gradients only when the node had a post hook
    before, so a user's hook on the same node turned the finding into a masked note and locate found
    nothing though the weight's gradient was NaN. An inf weight (from outside: allowed, as a mask is)
    makes inf - inf in the weight's gradient, a producer as in forward."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    with torch.no_grad():
        lin.weight[0, 0] = float("inf")
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with locate(action="record") as found:
        out = lin(x)
        if users_hook:
            out.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
        torch.nn.functional.mse_loss(out, y).backward()
    assert lin.weight.grad.isnan().any()
    assert [(f.op, f.node) for f in found.findings] == [("aten.mm.default", "AddmmBackward0")]
