"""locate where autograd runs the user's code or backward inside a forward (session 44's probe): a module's
backward hooks, and a gradient penalty inside activation checkpointing."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import nanfast


@pytest.mark.parametrize("kind", ["hook", "pre_hook"])
def test_a_nan_a_modules_backward_hook_makes_is_found_there(kind):
    """torch runs module backward hooks as post hooks of BackwardHookFunctionBackward, where the hook
    locate added to judge the node never ran: the hook's 0/0 was noted as masked, nothing raised, and
    the first layer's gradient was NaN unreported (detect_anomaly names BackwardHookFunctionBackward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    normalize = lambda grads: tuple(g / g.abs().max() for g in grads)  # 0/0 for a gradient all zero
    if kind == "hook":
        model[2].register_full_backward_hook(lambda module, grad_in, grad_out: normalize(grad_in))
    else:
        model[2].register_full_backward_pre_hook(lambda module, grad_out: normalize(grad_out))
    with pytest.raises(nanfast.NonFiniteError) as raised, nanfast.locate():
        (model(torch.randn(2, 3)) * 0).sum().backward()
    finding = raised.value.report
    assert finding.op == "aten.div.Tensor" and finding.kind == "producer"
    assert "BackwardHookFunctionBackward" in str(finding.node)


def _penalized(lin, x):
    """A loss with a gradient penalty (autograd.grad with create_graph=True) whose graph holds the norm
    of a zero row: its backward makes 0/0 and masks it, healthy. With lin's weight 0 the penalty's own
    norm is 0, a real fault: sqrt's gradient at 0 is inf."""
    u = torch.zeros(2, 3, requires_grad=True)
    y = u.norm(dim=1).sum() + lin(x).sum()
    gx, _ = torch.autograd.grad(y, [x, u], create_graph=True)
    return gx.pow(2).sum(dim=1).sqrt().sum()


@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_a_gradient_penalty_inside_activation_checkpointing_is_judged_as_backward(use_checkpoint):
    """Under a non-reentrant checkpoint, the penalty's backward ran with checkpoint's saved-tensor hooks
    innermost and was taken for a recomputation, judged op by op: the masked 0/0 raised on a healthy step."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    x = torch.randn(2, 3, requires_grad=True)
    run = (lambda f, *a: checkpoint(f, *a, use_reentrant=False)) if use_checkpoint else (lambda f, *a: f(*a))
    with nanfast.locate():
        run(lambda x: _penalized(lin, x), x).backward()
    assert torch.isfinite(lin.weight.grad).all()
    lin.weight.data.zero_()  # the penalty's gradient norm is 0: sqrt's backward divides by it
    with pytest.raises(nanfast.NonFiniteError) as raised, nanfast.locate():
        run(lambda x: _penalized(lin, x), x).backward()
    assert "SqrtBackward0" in str(raised.value.report.node)
