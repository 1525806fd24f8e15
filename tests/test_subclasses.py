"""Tensor subclasses that hold their values in plain tensors (a DTensor's local shard, a wrapper such as
torch's TwoTensor or a quantized weight), and FakeTensors, which hold none: the watch and check_all read
the former through their plain tensors (NOTE: [Tensor subclasses read through their plain tensors] in
csrc/python/plain_parts.cpp) and refuse the latter by name; inside torch.func transforms, whose wrappers hold
no storage, the watch stands down. The DTensor activations of a tensor-parallel model are tested on two
real ranks in test_distributed.py."""

import inspect
import warnings

import pytest
import torch

import nanfast
from reference import reference_stats

two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
TwoTensor = two_tensor.TwoTensor
NAN, INF = float("nan"), float("inf")


class Split(torch.nn.Module):
    """Returns its input as a TwoTensor: every module after it computes on TwoTensors, and the gradients
    of the parameters behind it are TwoTensors too. `fault` divides the second half by zero."""

    def __init__(self):
        super().__init__()
        self.fault = False

    def forward(self, x):
        second = x / 0.0 if self.fault else x * 1.0
        return TwoTensor(x * 1.0, second)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.split = Split()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.split(x))


@pytest.mark.parametrize("fuse", [False, True])
def test_the_watch_reads_a_wrapper_subclass_through_its_plain_tensors(fuse):
    """Each record of a TwoTensor activation or gradient, and the pass over the TwoTensor gradients,
    raised "its data is not allocated yet" (the op's results were TwoTensors, which no read could turn
    into numbers): a healthy model stopped at its first step. Now healthy steps pass, and a fault in the
    second half of one is reported at its module and skipped."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    w = nanfast.watch(model, optimizer, action="skip", fuse=fuse)
    grad_types = []
    for step in range(3):
        model.split.fault = step == 1
        optimizer.zero_grad()
        out = model(torch.randn(2, 4))
        assert type(out) is TwoTensor
        w.loss(out.square().mean()).backward()  # a TwoTensor loss: its mean is read through its halves
        grad_types.append(type(model.fc.weight.grad).__name__)
        before = model.fc.weight.detach().clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the skip's warning
            optimizer.step()
        assert torch.equal(model.fc.weight, before) == (step == 1)
    assert grad_types == ["TwoTensor"] * 3
    assert [(e.step, e.phase, e.name) for e in w.events] == [(1, "forward", "split")]
    assert w.events[0].first.posinf == 4 and w.events[0].first.neginf == 4
    assert w.skipped_steps == 1
    assert [r.step for r in w.history if r.loss is not None and r.loss > 0] == [0, 2]


def test_check_all_reads_a_wrapper_subclass_through_its_plain_tensors():
    """check_all raised ".tolist() is not supported for tensor subclasses" (a probe, session 41): the op,
    dispatched to the TwoTensor, gave TwoTensor results. Now the entry's row counts and measures both of
    its plain tensors, as a float64 reference over them says."""
    torch.manual_seed(0)
    a, b = torch.randn(50), torch.randn(50) * 3
    b[[3, 7]] = torch.tensor([NAN, -INF])
    report = nanfast.check_all({"w": TwoTensor(a, b), "plain": torch.ones(2)}, raise_on_nonfinite=False)
    [entry, plain] = report.entries
    ref = reference_stats(torch.cat([a, b]))
    assert (entry.name, entry.shape, entry.numel) == ("w", (50,), 50)
    assert (entry.nan, entry.posinf, entry.neginf) == (1, 0, 1)
    assert entry.norm == pytest.approx(ref.norm, rel=1e-6) and entry.absmax == pytest.approx(ref.absmax)
    assert plain.norm == pytest.approx(2 ** 0.5) and [e.name for e in report.bad] == ["w"]


def test_stats_any_nonfinite_and_clip_read_a_wrapper_subclass_through_its_plain_tensors():
    """A TwoTensor's __torch_dispatch__ runs the op on each plain tensor and returns TwoTensor results,
    whose read takes the first one's: a NaN in the second was called clean by any_nonfinite and stats, and
    clip_grad_norm_ clipped by a finite norm instead of raising (a probe, session 42). They read it as
    check_all and the watch do, through its plain tensors."""
    torch.manual_seed(0)
    a, b = torch.randn(40), torch.randn(40) * 2
    b[5] = NAN
    ref = reference_stats(torch.cat([a, b]))
    s = nanfast.stats([torch.ones(3), TwoTensor(a, b)])
    assert type(s.counts) is torch.Tensor and s.nan.tolist() == [0, 1] and s.posinf.tolist() == [0, 0]
    assert s.norm[1].item() == pytest.approx(ref.norm, rel=1e-6) and s.absmax[1].item() == ref.absmax
    assert nanfast.any_nonfinite([torch.ones(3), TwoTensor(a, b)]).item() is True
    assert nanfast.any_nonfinite([TwoTensor(a, a)]).item() is False
    p = torch.nn.Parameter(torch.zeros(40))
    p.grad = TwoTensor(a, b)
    with pytest.raises(nanfast.NonFiniteError, match="nan=1"):
        nanfast.clip_grad_norm_([p], 1.0)


def test_a_fake_tensor_is_refused_by_name():
    """check_all on a FakeTensor raised torch's DataDependentOutputException, naming nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.randn(3)
    with pytest.raises(ValueError, match=r"^nanfast.check_all: 'x' is a FakeTensor .*no values to check"):
        nanfast.check_all({"ok": torch.ones(2), "x": fake})


class _PassThrough(torch.Tensor):
    """A wrapper whose values live in `.inner` and whose __torch_dispatch__ hands every op the wrapper
    itself, below the Python key: the kernels get a tensor whose storage claims bytes at no address."""

    @staticmethod
    def __new__(cls, inner):
        wrapper = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        wrapper.inner = inner
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
            return func(*args, **(kwargs or {}))


def test_an_unreadable_entry_beside_a_wrapper_subclass_is_refused_by_name():
    """A list holding a TwoTensor is read through every entry's plain parts: a MaskedTensor or a FakeTensor
    beside it got a row of zeros, and any_nonfinite said False of its NaN; a TwoTensor of sparse tensors
    was read as nothing. Alone, each is refused; beside a TwoTensor now too, naming the entry."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.masked import masked_tensor

    clean = TwoTensor(torch.ones(2), torch.ones(2))
    dirty = torch.tensor([NAN, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MaskedTensor's prototype warning
        masked = masked_tensor(dirty, torch.tensor([True, True]))
    fake = FakeTensorMode().from_tensor(dirty)
    for entry, name in [(masked, "MaskedTensor"), (fake, "FakeTensor")]:
        for op in (nanfast.stats, nanfast.any_nonfinite):
            with pytest.raises(TypeError, match=rf"entry 1 is a {name}, a tensor subclass whose values the kernels"):
                op([clean, entry])
    sparse_pair = TwoTensor(dirty.to_sparse(), dirty.to_sparse())
    for op in (nanfast.stats, nanfast.any_nonfinite):
        with pytest.raises((ValueError, RuntimeError), match=r"entry 0 has layout|tensors\[0\] has layout"):
            op([sparse_pair])
    # A wrapper that reaches the kernels as itself: refused, not read at its null address (a crash).
    with pytest.raises(RuntimeError, match=r"tensors\[0\] holds 2 elements at no address"):
        torch.ops.nanfast.stats([_PassThrough(dirty)])


def test_a_fake_tensor_beside_a_real_one_is_refused_by_name_by_the_ops():
    """nanfast.stats([real, fake]) raised fake mode's bare AssertionError ("Please convert all Tensors to
    FakeTensors first"), naming no entry (a probe, session 49)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode().from_tensor(torch.ones(3))
    for op in (nanfast.stats, nanfast.any_nonfinite):
        with pytest.raises(TypeError, match=r"entry 1 is a FakeTensor, a tensor subclass whose values the kernels"):
            op([torch.ones(2), fake])


def test_locate_checks_a_subclass_op_as_the_ops_on_its_plain_tensors():
    """Under locate, an op on a MaskedTensor raised from inside nanfast (the kernels were handed the
    subclass) though nothing was non-finite, and log of a TwoTensor holding -1 raised ".tolist() is not
    supported" instead of a finding (a probe, session 41). The mode now hands such an op to the subclass
    first and checks the plain ops it runs."""
    from torch.masked import masked_tensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The PyTorch API of MaskedTensors is in prototype stage"
        masked = masked_tensor(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, True, False]))
        with nanfast.locate() as healthy:
            torch.exp(masked)
    assert healthy.findings == []
    pair = TwoTensor(torch.tensor([1.0, -1.0]), torch.tensor([1.0, 2.0]))
    with pytest.raises(nanfast.NonFiniteError) as raised:
        with nanfast.locate():
            torch.log(pair)  # the half holding -1
    finding = raised.value.report
    assert (finding.kind, finding.op) == ("producer", "aten.log.default")
    source = inspect.getsource(test_locate_checks_a_subclass_op_as_the_ops_on_its_plain_tensors).splitlines()
    first = test_locate_checks_a_subclass_op_as_the_ops_on_its_plain_tensors.__code__.co_firstlineno
    marker = first + next(i for i, text in enumerate(source) if text.endswith("# the half holding -1"))
    assert (finding.where.filename, finding.where.lineno) == (__file__, marker)


def test_the_watch_stands_down_inside_torch_func_transforms():
    """Per-sample gradients (vmap(grad) over functional_call, as Opacus-style training computes them),
    torch.func.grad, jvp and vmap'd inference of a watched model raised ("Batching rule not implemented
    for nanfast::stats", "Cannot access data pointer of Tensor that doesn't have storage"; a probe,
    session 41). The hooks stand down inside a transform (NOTE: [The watch under torch.func]); the
    per-sample gradients' mean, put into .grad, is checked by the step's pass, and a plain step after it
    is watched as usual."""
    from torch.func import functional_call, grad, jvp, vmap

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    expected = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    w = nanfast.watch(model, optimizer, action="skip")
    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    assert all(torch.equal(per_sample[k], expected[k]) for k in expected)
    grad(loss)(params, x[0], y[0])
    jvp(model, (x,), (torch.ones_like(x),))
    with torch.no_grad():
        vmap(lambda xi: functional_call(model, params, (xi,)))(x[:, None])
    for p in model.parameters():  # the per-sample gradients' mean, one of them made inf
        p.grad = per_sample[[k for k, q in model.named_parameters() if q is p][0]].mean(0)
    model[2].bias.grad[0] = INF
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skip's warning
        optimizer.step()
    assert [(e.step, e.phase, e.name) for e in w.events] == [(0, "grad", "2.bias")] and w.skipped_steps == 1
    optimizer.zero_grad()
    model(x * NAN).sum().backward()  # a plain step after them is watched as usual
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        optimizer.step()
    assert [(e.step, e.phase) for e in w.events][1:] == [(1, "input")]
    w.remove()


def test_a_transformer_encoders_nested_fast_path_is_watched():
    """nn.TransformerEncoder in eval with a padding mask (enable_nested_tensor, its default) passes strided
    nested tensors between its layers: their checks raised "Could not run 'nanfast::stats' with arguments
    from the 'NestedTensorCPU' backend" (a probe, session 41). Each is read through its components: the
    output is as without the watch, and a NaN in an unpadded token is seen in the input, then in the
    first layer's attention (a nested tensor)."""
    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 2, 64, batch_first=True), 2)
    x = torch.randn(3, 10, 32)
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, 6:] = True
    encoder.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "nested tensors are in prototype stage"
        expected = encoder(x, src_key_padding_mask=pad)
        w = nanfast.watch(encoder, action="warn")
        assert torch.equal(encoder(x, src_key_padding_mask=pad), expected) and w.events == []
        x[0, 2, 5] = NAN
        with pytest.warns(RuntimeWarning, match="the input batch is dirty: src"):
            encoder(x, src_key_padding_mask=pad)
    [event] = w.events
    assert event.phase == "input" and event.later[0].name == "layers.0.self_attn" and event.later[0].nan > 0
    w.remove()



class Crop(torch.nn.Module):
    """Keeps the first `lengths[i]` rows of each sequence as a jagged nested tensor: a view whose values
    buffer is the whole padded batch, wider than its components."""

    def forward(self, x, lengths):
        starts = torch.zeros_like(lengths)
        return torch.nested.narrow(x, 1, starts, lengths, layout=torch.jagged)


def test_a_narrowed_jagged_tensor_is_read_through_its_components():
    """The watch skipped jagged nested tensors (their layout is not strided): a NaN in one passed unseen
    (session 42's review). They are read through their values buffer now, except a jagged tensor made by
    narrow(), whose buffer is the whole padded batch: NaN padding outside the kept rows must not stop a
    healthy forward. A NaN among the kept rows is seen, and counted as check_all counts it."""
    crop = Crop()
    x = torch.randn(3, 5, 4)
    x[:, 4] = NAN  # padding past every kept length
    lengths = torch.tensor([2, 3, 4])
    w = nanfast.watch(crop, action="warn", inputs=False)
    with torch.no_grad():
        out = crop(x, lengths)
    assert w.events == [] and nanfast.check_all(out).ok
    x[2, 3, 1] = NAN  # inside the third sequence's kept rows
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="output of <model>"):
        out = crop(x, lengths)
    [event] = w.events
    assert event.first.nan == nanfast.check_all(out, raise_on_nonfinite=False).entries[0].nan == 1
    w.remove()


@pytest.mark.parametrize("fuse", [False, True])
def test_a_jagged_batch_is_watched_in_training(fuse):
    """Variable-length sequences as one jagged nested tensor through Linear layers: a NaN in the batch is
    named as the input, not first at the parameters' gradients; healthy steps train as without the watch."""
    def train(watched, dirty):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        w = nanfast.watch(model, optimizer, action="warn", fuse=fuse) if watched else None
        for step in range(3):
            seqs = [torch.randn(2, 4), torch.randn(3, 4)]
            if dirty and step == 2:
                seqs[1][1, 2] = NAN
            optimizer.zero_grad()
            model(torch.nested.nested_tensor(seqs, layout=torch.jagged)).values().square().mean().backward()
            optimizer.step()
        return model, w

    expected, _ = train(watched=False, dirty=False)
    model, w = train(watched=True, dirty=False)
    assert w.events == [] and all(map(torch.equal, model.parameters(), expected.parameters()))
    w.remove()
    with pytest.warns(RuntimeWarning, match="the input batch is dirty"):
        _, w = train(watched=True, dirty=True)
    [event] = w.events
    assert (event.step, event.first.phase, event.first.nan) == (2, "input", 1)
    w.remove()


class Sqrt(torch.nn.Module):
    def forward(self, x):
        return x.sqrt()


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_jagged_gradient_is_checked_in_backward(layout):
    """The gradient leaving a module in backward is checked when it is a jagged nested tensor too (the
    gradient checks took strided and sparse ones only). sqrt at ReLU's zeros makes inf in backward that
    ReLU's backward turns to 0 again: only the check of the gradient leaving Sqrt can see it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), Sqrt(), torch.nn.Linear(8, 1))
    seqs = [torch.randn(2, 4), torch.randn(3, 4)]
    x = torch.nested.nested_tensor(seqs, layout=layout) if layout == torch.jagged else torch.cat(seqs)
    w = nanfast.watch(model, action="warn", inputs=False, activations=False)
    with pytest.warns(RuntimeWarning, match="backward"):
        out = model(x)
        (out.values() if out.is_nested else out).sum().backward()
        w.step()
    [event] = w.events
    assert (event.first.phase, event.first.name) == ("backward", "2") and event.first.posinf > 0
    w.remove()
