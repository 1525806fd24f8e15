"""locate where autograd runs the user's code or backward inside a forward (session 44's probe): a module's
backward hooks, and a gradient penalty inside activation checkpointing."""

import sys

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


class _InvSqrt(torch.autograd.Function):
    """1/sqrt(x) with a hand-written backward: at x = 0 the backward divides by 0."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sqrt()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / (2 * x.sqrt())


def _hook_dividing(grad):
    return grad / torch.zeros_like(grad)


@pytest.mark.parametrize("kind", ["tensor_hook", "module_hook", "custom_backward", "builtin"])
def test_an_op_in_code_autograd_calls_is_placed_at_its_own_line(kind):
    """An op that a tensor hook or an autograd.Function's backward runs was placed at the node's forward
    line, and its hook's line was printed as the line that called backward."""
    lin = torch.nn.Linear(3, 3)
    x = torch.zeros(2, 3, requires_grad=True)
    if kind == "module_hook":
        lin.register_full_backward_pre_hook(lambda module, grad_out: (_hook_dividing(grad_out[0]),))
    with pytest.raises(nanfast.NonFiniteError) as raised, nanfast.locate():
        y = lin(x)
        if kind == "tensor_hook":
            y.register_hook(_hook_dividing)
        loss = (_InvSqrt.apply(x) if kind == "custom_backward" else x.sqrt() if kind == "builtin" else y).sum()
        called = sys._getframe().f_lineno + 1
        loss.backward()
    finding = raised.value.report
    assert finding.phase == "backward" and finding.op == "aten.div.Tensor"
    assert (finding.source.function, finding.source.lineno) == (sys._getframe().f_code.co_name, called)
    if kind == "builtin":  # torch's own formula (sqrt's): no Python ran it
        assert finding.backward_source is None and finding.where == finding.forward_source
        return
    function = "backward" if kind == "custom_backward" else "_hook_dividing"
    assert finding.where == finding.backward_source and finding.where.function == function
    assert finding.where.filename == __file__ and f"at {finding.where}" in str(finding)
    assert finding.to_dict()["backward_source"] == str(finding.where)


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


# Session 44's probe of locate's resource use: copies kept for held findings, fake tensors.

def test_held_findings_keep_one_copy_of_their_inputs_for_a_dump(tmp_path):
    """With dump=, each forward inf held off the gradient path kept a copy of its op's inputs until the
    region ended (100 x 4 MB), and a value kept past the region kept its copy through its storage."""
    import gc
    import warnings

    def copies():
        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # isinstance() on torch.distributed's deprecated names
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() == 100_000)

    w = torch.randn(4, requires_grad=True)
    with nanfast.locate(action="record", dump=str(tmp_path / "first.pt")) as region:
        (w * 2).sum()  # the region has a gradient path
        for _ in range(20):
            torch.log(torch.zeros(100_000))  # off the gradient path and dropped: held, then a note
        assert copies() <= 1
        kept = torch.log(torch.zeros(100_000))  # alive at the region's end: reported
    assert len(region.findings) == 1 and len(region.masked) == 20
    del region
    assert copies() == 1  # `kept` alone, not a copy of its op's inputs
    del kept


def test_fake_tensors_run_unchecked_inside_a_region():
    """FakeTensor hands an op back to the modes, and locate returned NotImplemented for it: shape
    inference under FakeTensorMode raised inside a region."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with nanfast.locate():
        with FakeTensorMode():
            assert (torch.randn(8, 16) @ torch.randn(16, 4)).log().shape == (8, 4)
    with FakeTensorMode():
        a, w = torch.randn(8, 16), torch.randn(16, 4)
        with nanfast.locate():
            assert (a @ w).relu().shape == (8, 4)
    with pytest.raises(nanfast.NonFiniteError, match="aten.log"), nanfast.locate():
        torch.zeros(3).log()  # real tensors are still checked


def test_finite_min_max_and_absmax_are_of_the_finite_values():
    """Reductions instead of a boolean index (a copy and an 8-byte index per element: 7x a 256 MB input
    for one finding); the values are those of a float64 reference."""
    from nanfast.locator.values import finite_absmax, finite_min_max

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = (torch.randn(1000) * 100).to(dtype)
        t[::7], t[3], t[5] = float("nan"), float("inf"), -float("inf")
        finite = t.double()[torch.isfinite(t)]
        assert finite_min_max(t) == (finite.min().item(), finite.max().item())
        assert finite_absmax(t) == finite.abs().max().item()
    assert finite_min_max(torch.full((3,), float("nan"))) == (None, None)
    assert finite_absmax(torch.full((3,), float("inf"))) is None
    assert finite_min_max(torch.tensor([3, -2, 7])) == (-2, 7)
