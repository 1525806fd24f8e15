"""locate on what probing found in sessions 37, 38 and 41: a training-mode BatchNorm, whose running
statistics aten.native_batch_norm updates in place without its schema saying so (forward, and in
backward a real ResNet), a backward fault under torch.func (per-sample gradients with vmap(grad),
jacrev), a backward node judged whatever hooks it has, a buffer written row by row, non-finite
exponents, complex32, and a dump path that cannot be written."""

import copy
import inspect
import warnings

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


def test_a_nan_weight_in_a_resnet_is_one_finding_through_backward():
    """Session 41's probe: forward and backward of torchvision's ResNet-18 with one NaN conv weight gave
    ten findings: the right one (the convolution consuming the weight) and nine false `input` findings
    at native_batch_norm_backward, which read running statistics that the forward's BatchNorms had
    updated with NaN without returning them (so no write of theirs was recorded)."""
    tvm = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    model = tvm.resnet18(num_classes=10)
    with torch.no_grad():
        model.layer3[0].conv1.weight[0, 0, 0, 0] = float("nan")
    finder = run(lambda: model(torch.randn(2, 3, 32, 32)).sum().backward())
    [finding] = finder.findings
    assert (finding.kind, finding.op, finding.phase) == ("input", "aten.convolution.default", "forward")
    [dirty] = [i for i in finding.inputs if i.nonfinite]
    assert dirty.name == "weight" and dirty.nan == 1


def test_finite_rows_written_into_a_buffer_keep_an_earlier_findings_taint():
    """Session 41's probe: a preallocated output buffer filled row by row (an RNN's outputs), row 0 an
    inf from exp, then finite rows: the last write's flag replaced the storage's, so the softmax over
    the buffer was taken for a second producer. torch.stack of the same rows gave one finding."""
    x = torch.tensor([100.0, 1.0])

    def fill():
        outs = torch.empty(3, 2)
        outs[0] = torch.exp(x)  # exp(100) overflows
        outs[1] = x
        outs[2] = x
        torch.softmax(outs, 0)

    finder = run(fill)
    assert [(f.kind, f.op, f.where.lineno) for f in finder.findings] == [
        ("producer", "aten.exp.default", line_of("# exp(100) overflows"))]


@pytest.mark.parametrize("exponent", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_exponent_is_a_scalar_finding(exponent):
    """pow's diagnosis took int() of the exponent: ValueError or OverflowError from inside locate."""
    x = torch.tensor([0.5, 2.0])
    finding = run(lambda: x ** exponent, action="raise").finding
    assert (finding.kind, finding.op) == ("scalar", "aten.pow.Tensor_Scalar")


def test_an_inf_times_zero_in_a_half_matmul_is_not_called_an_overflow():
    a = torch.tensor([[float("inf"), 1.0]], dtype=torch.float16)  # from outside: an allowed inf
    b = torch.tensor([[0.0], [1.0]], dtype=torch.float16)
    finding = run(lambda: a @ b, action="raise").finding
    assert (finding.kind, finding.op) == ("producer", "aten.mm.default")
    assert finding.diagnosis == "mm of infinite values: 1 of 2 elements of `self` is infinite"  # no overflow


def test_a_complex32_overflow_is_found_where_it_happens():
    """complex32 was missing from locate's dtypes: the cast's inf went unseen and the next op was blamed."""
    x = torch.tensor([1e5 + 0j])

    def cast():
        y = x.to(torch.complex32)  # complex32 holds at most 65504
        y * 2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "ComplexHalf support is experimental"
        finding = run(cast, action="raise").finding
    assert (finding.kind, finding.op, finding.where.lineno) == ("producer", "aten._to_copy.default",
                                                                 line_of("# complex32 holds"))


def test_a_dump_path_in_no_directory_is_refused_before_the_region():
    """It was accepted, then torch.save raised from inside the user's op at the first finding, and the
    finding was lost (findings empty, nothing raised as NonFiniteError)."""
    with pytest.raises(ValueError, match=r"dump='no/such/dir/repro.pt': its directory does not exist"):
        locate(dump="no/such/dir/repro.pt")


class ReassignedStatistic(torch.nn.Module):
    """Updates a running statistic by re-assigning its buffer (self.ema = 0.9 * self.ema + ...), not in
    place: the step state's captured tensor is then no longer the module's."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        return torch.log(self.lin(x - self.ema))  # negative values: NaN


def test_locate_step_puts_back_a_reassigned_buffer_and_the_gradient_tensors():
    """locate_step copied the step's state back into the tensors it had captured: a buffer the re-run
    re-assigned kept the re-run's value (the statistic advanced twice), and every .grad was replaced by a
    new tensor (a probe, session 41)."""
    from nanfast.locator import StepState, locate_step

    torch.manual_seed(0)
    model, x = ReassignedStatistic(), torch.randn(8, 4)
    state = StepState.capture(model)
    model(x).sum().backward()  # the bad step, as a watch that skipped it leaves it
    ema, grads = model.ema.clone(), [p.grad for p in model.parameters()]
    values = [g.clone() for g in grads]
    finding = locate_step(lambda: model(x).sum().backward(), state)
    assert (finding.kind, finding.op) == ("producer", "aten.log.default")
    assert torch.equal(model.ema, ema)
    assert all(p.grad is g and torch.equal(g, v) for p, g, v in zip(model.parameters(), grads, values))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_an_infinite_loss_made_of_a_masks_infinities_is_reported_at_the_op_that_made_it(smoothing):
    """cross_entropy with label smoothing sums log_softmax over every class, the masked ones too: the loss
    of -inf-masked logits is +inf (candle-org/MindAct#1633), its gradients finite. The mask's -inf are
    allowed and the ops after it propagate them: locate reported nothing, as detect_anomaly."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 6)

    def step():
        logits = lin(torch.randn(3, 4)).masked_fill(torch.tensor([False] * 4 + [True] * 2), float("-inf"))
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2]), label_smoothing=smoothing)  # <ls-loss>
        loss.backward()

    findings = run(step).findings
    if not smoothing:  # a finite loss: the mask's -inf stay allowed
        assert findings == []
        # nor does a Jacobian of masked outputs call each -inf row a loss (autograd.grad of each element)
        x = torch.randn(3, requires_grad=True)
        jacobian = run(lambda: torch.autograd.functional.jacobian(
            lambda v: v.masked_fill(torch.tensor([True, False, False]), float("-inf")), x))
        assert jacobian.findings == []
        return
    (finding,) = findings
    assert (finding.kind, finding.phase, finding.source.lineno) == ("producer", "forward", line_of("<ls-loss>"))
    assert finding.outputs[0].posinf == 1 and "backward() was called on" in finding.reason
    assert torch.isfinite(lin.weight.grad).all()  # why the backward ops saw nothing
    # Raised when that backward ends, before an optimizer step (it came at the region's end, after it).
    optimizer = torch.optim.SGD(lin.parameters(), lr=0.1)
    before = lin.weight.detach().clone()
    with pytest.raises(Exception) as raised, locate():
        step()
        optimizer.step()
    assert "backward() was called on" in str(raised.value) and torch.equal(lin.weight, before)


@pytest.mark.parametrize("stale", [1.0, float("nan")])
def test_eighs_backward_at_equal_eigenvalues_is_found_beside_a_stale_nan_gradient(stale):
    """linalg.eigh's backward divides by the differences of the eigenvalues: NaN where two are equal
    (pytorch/pytorch#47599). Accumulated into a .grad that already held NaN (a parameter left out of the
    optimizer, never zeroed), the gradient was taken as that input's NaN, and eigh's finding, its own
    gradient freed, was noted as masked (a probe, session 48): now both are reported."""
    torch.manual_seed(0)
    feat = torch.zeros(3, 4, requires_grad=True)
    feat.grad = torch.full((3, 4), stale)
    w = torch.randn(4, 4)

    def step():
        _, vectors = torch.linalg.eigh(feat.T @ feat + torch.eye(4))  # equal eigenvalues
        (vectors[:, -1] @ w).pow(2).sum().backward()

    finder = run(step)
    eigh = ("producer", "LinalgEighBackward0", line_of("# equal eigenvalues"))
    found = [(f.kind, f.node, f.where.lineno) for f in finder.findings]
    if stale == stale:  # a finite stale gradient: eigh's finding alone
        assert found == [eigh] and finder.masked == []
    else:  # the stale NaN is reported where it is consumed, and eigh's stands beside it
        assert found == [("input", "AccumulateGrad", line_of("# equal eigenvalues")), eigh]
        assert finder.masked == []


def test_a_sparse_input_is_read_not_taken_for_finite():
    """Sparse tensors were not read: sparse.mm fed a NaN in its sparse operand was said to make "NaN from
    inputs without NaN", and an op on a sparse tensor making -inf was not seen, its -inf then blamed on
    the to_dense() that read it "from finite inputs" (a check of this session, 50). Their stored values
    are read; a finding names them `.values()`."""
    torch.manual_seed(0)
    weight = torch.randn(3, 2, requires_grad=True)
    dirty = torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 1]]), torch.tensor([float("nan"), 2.0]), (3, 3))
    finder = run(lambda: torch.sparse.mm(dirty, weight).sum().backward())
    finding = finder.findings[0]  # backward's mm reads a transposed copy: another storage, another finding
    assert finding.kind == "input" and finding.op == "aten._sparse_addmm.default"
    assert all(f.kind == "input" for f in finder.findings)
    assert [(i.name, i.nan) for i in finding.inputs if i.nan] == [("mat1.values()", 1)]
    counts = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([-1.0, 3.0]), (4,))

    def step():
        logs = torch.log1p(counts)  # the sparse fault: log1p(-1) = -inf
        return logs.to_dense() * 2

    finder = run(step)
    assert [(f.kind, f.op, f.where.lineno) for f in finder.findings] == [
        ("producer", "aten.log1p.default", line_of("# the sparse fault"))]
    assert [(o.name, o.neginf) for o in finder.findings[0].outputs] == [("out.values()", 1)]
    # Said in words, as of a dense log1p, of the values the sparse tensor holds (it had no diagnosis).
    assert finder.findings[0].diagnosis == ("log1p at the edge of its domain: 1 of 2 elements of `self.values()` "
                                            "is <= -1 (min -1, max -1)")


def test_a_running_variance_past_float16s_max_is_found_where_batch_norm_writes_it():
    """pytorch/pytorch#115500: a float16 batch whose variance passes 65504 makes BatchNorm's running_var
    +inf while its output, the loss and the gradients stay finite. locate checked only what ops return,
    and a training batch norm writes its running statistics without returning them: nothing was found."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.BatchNorm1d(10)).half()
    fresh = copy.deepcopy(model)
    x = (torch.rand(8, 10, generator=torch.Generator().manual_seed(1)) * 60000.0).half()
    finder = run(lambda: model(x).float().pow(2).mean().backward())  # the statistics' overflow
    (finding,) = finder.findings
    assert (finding.kind, finding.op, finding.where.lineno) == (
        "producer", "aten.native_batch_norm.default", line_of("# the statistics' overflow"))
    assert [(o.name, o.posinf) for o in finding.outputs if o.posinf] == [("running_var", 10)]
    assert finding.diagnosis.startswith("the batch's variance (largest ")
    assert finding.diagnosis.endswith("passes float16's largest finite value 65504: 10 of 10 elements of "
                                      "`running_var` are +inf")
    assert run(lambda: fresh(x / 100).float().pow(2).mean().backward()).findings == []  # a healthy batch
    assert torch.isfinite(fresh[1].running_var).all()


def _masked_log_softmax(vector, mask):
    """AllenNLP's masked_log_softmax: an additive mask made as log(mask), -inf where the mask is 0."""
    vector = vector + mask.float().log()
    return torch.nn.functional.log_softmax(vector, dim=-1)  # the row masked whole


def test_the_log_of_a_mask_is_intended_and_a_row_masked_whole_is_found_at_its_softmax():
    """allenai/allennlp#890: masked_log_softmax gives NaN for a row whose mask is all 0. locate blamed
    log(0) of the mask, on healthy batches too, and took the log_softmax's NaN for propagation."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 1)
    x = torch.randn(4, 6, 5)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, 4:] = False  # padding
    targets = torch.zeros(4, dtype=torch.long)

    def step(mask):
        torch.nn.functional.nll_loss(_masked_log_softmax(lin(x).squeeze(-1), mask), targets).backward()

    assert run(lambda: step(mask)).findings == []  # a healthy batch
    empty = mask.clone()
    empty[2] = False  # an empty passage: every candidate masked
    finding = run(lambda: step(empty)).findings[0]
    assert (finding.kind, finding.op, finding.where.lineno) == (
        "producer", "aten._log_softmax.default", line_of("# the row masked whole"))
    assert finding.diagnosis == "row 2 of 4 along dim 1 is fully masked (every entry -inf): softmax of it is 0/0"
    # 0s and 1s an op computed are no mask: the log of a softmax saturated to one-hot is the producer.
    saturated = run(lambda: torch.softmax(torch.tensor([[1000.0, 0.0, 0.0]]), -1).log()).findings
    assert [(f.kind, f.op) for f in saturated] == [("producer", "aten.log.default")]
