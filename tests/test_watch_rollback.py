"""watch(action="rollback"): a step whose parameters are non-finite puts back, in place and bit for bit,
the last snapshot proven finite (parameters, optimizer state, module buffers), and training goes on as
if it had resumed from there; a bad step with finite parameters is skipped as action="skip" does; no
host read is added."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast
from op_recorder import OpRecorder
from test_watch_skip import _CASES, BNNet, assert_same_state, batch, dirty, full_state, make_optimizer, train_step

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _one_thread(restore_num_threads):
    torch.set_num_threads(1)  # tiny models (see test_watch_skip.py)


_OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam-forloop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-momentum-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
}
_LAGGED = ["adam-fused", "adamw-fused", "sgd-momentum-fused"]


def train(make_model, make_opt, batches):
    """The reference: plain training, no watch."""
    torch.manual_seed(0)
    model = make_model()
    opt = make_opt(model.parameters())
    for x, y in batches:
        train_step(model, opt, x, y)
    return full_state(model, opt)


def tensors_of(opt):
    """The parameters and the optimizer state's tensors: the objects a rollback must keep."""
    params = [p for group in opt.param_groups for p in group["params"]]
    return params + [v for p in params for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


def faulty_run(make_model, make_opt, batches, bad, fault, **options):
    """Trains under a rolling-back watch; the parameters step `bad` begins with are non-finite: NaN written
    into a weight ("nan-write") or an update with an infinite learning rate at the step before ("inf-lr").
    Returns the watch, the state right after the step that rolled back, and the final state."""
    torch.manual_seed(0)
    model = make_model()
    opt = make_opt(model.parameters())
    w = nanfast.watch(model, opt, action="rollback", **options)
    after, objects = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(batches):
            if i == bad:
                objects = tensors_of(opt)
                if fault == "nan-write":
                    with torch.no_grad():
                        model.l1.weight[2, 3] = NAN
            lr = opt.param_groups[0]["lr"]
            if i == bad - 1 and fault == "inf-lr":
                opt.param_groups[0]["lr"] = INF
            train_step(model, opt, x, y)
            opt.param_groups[0]["lr"] = lr
            if w.rolled_back_steps and after is None:
                after = full_state(model, opt)
                kept = tensors_of(opt)
                if len(kept) == len(objects):  # the snapshot had optimizer state: same objects, filled in place
                    assert all(a is b for a, b in zip(kept, objects))
        w.flush()
        w.remove()
    assert sum("rolled back to the state step" in str(c.message) for c in caught) == 1
    return w, after, full_state(model, opt)


def check_rollback(make_opt, bad, restored, fault="nan-write", n=9, **options):
    """The state after the rollback is the reference's after `restored` steps, bit for bit; training then
    ends as a reference that resumed from there, having lost the steps in between (eager: up to the bad
    step; lagged: one more, read from the bad parameters)."""
    batches = [batch(s) for s in range(n)]
    w, after, final = faulty_run(BNNet, make_opt, batches, bad, fault, **options)
    assert w.last_rollback == (bad, restored) and w.rolled_back_steps == 1, w.last_rollback
    assert len(w.events) == 1 and w.events[0].phase == "param" and w.skipped_steps == 0, w.events
    assert_same_state(after, train(BNNet, make_opt, batches[:restored]))
    resume = bad + (2 if options.get("sync") == "lagged" else 1)
    assert_same_state(final, train(BNNet, make_opt, batches[:restored] + batches[resume:]))
    assert all(torch.isfinite(p).all() for p in final[0].values())


@pytest.mark.parametrize("fault", ["nan-write", "inf-lr"])
@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_rollback_restores_parameters_optimizer_state_and_buffers_bit_exactly(name, fault):
    check_rollback(_OPTIMIZERS[name], bad=4, restored=3, fault=fault, rollback_every=1)


@pytest.mark.parametrize("name,impl", _CASES, ids=[f"{n}-{i}" for n, i in _CASES])
def test_rollback_is_bit_exact_for_every_optimizer(name, impl):
    """Every torch optimizer of the skip tests, each implementation: whatever state it keeps (moments,
    step counts, Rprop's step sizes, ASGD's averages, Adafactor's factored rows) is put back."""
    check_rollback(make_optimizer(name, impl), bad=4, restored=3, rollback_every=1)


@pytest.mark.parametrize("name", ["sgd-momentum", "adam-fused"])
def test_rollback_every_n_restores_the_older_snapshot(name):
    check_rollback(_OPTIMIZERS[name], bad=5, restored=3, rollback_every=3)  # snapshots at steps 0 and 3


@pytest.mark.parametrize("name", ["sgd-momentum", "adam-foreach", "adam-fused"])
def test_rollback_to_the_first_step_drops_the_optimizer_state_made_since(name):
    check_rollback(_OPTIMIZERS[name], bad=3, restored=0)  # default rollback_every: the only snapshot is step 0's


@pytest.mark.parametrize("fault", ["nan-write", "inf-lr"])
@pytest.mark.parametrize("name", _LAGGED)
def test_lagged_rollback_restores_the_last_confirmed_snapshot(name, fault):
    """Read one step late: the pending snapshot of the bad step is dropped, the one before it restored,
    and the step in flight (computed from the bad parameters) skipped without a second event."""
    check_rollback(_OPTIMIZERS[name], bad=4, restored=3, fault=fault, sync="lagged", rollback_every=1)


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_rollback_when_the_watch_checks_one_step_in_two(sync):
    """every=2: the NaN written before step 3 (not checked) is found by step 4's read; the snapshot of
    step 2, the last checked step, is put back (lagged: at step 5, which is skipped too)."""
    make_opt = _OPTIMIZERS["adamw-fused"]
    batches = [batch(s) for s in range(9)]
    w, after, final = faulty_run(BNNet, make_opt, batches, 3, "nan-write", sync=sync, every=2, rollback_every=1)
    assert w.last_rollback == (4, 2) and w.rolled_back_steps == 1 and len(w.events) == 1
    assert_same_state(after, train(BNNet, make_opt, batches[:2]))
    resume = 5 if sync == "eager" else 6
    assert_same_state(final, train(BNNet, make_opt, batches[:2] + batches[resume:]))


def test_lagged_rollback_found_by_flush_restores_at_once():
    make_opt = _OPTIMIZERS["adamw-fused"]
    batches = [batch(s) for s in range(4)]
    torch.manual_seed(0)
    model = BNNet()
    opt = make_opt(model.parameters())
    with nanfast.watch(model, opt, action="rollback", sync="lagged", rollback_every=1) as w:
        for i, (x, y) in enumerate(batches):
            if i == 3:
                with torch.no_grad():
                    model.l1.weight[0, 0] = NAN
            train_step(model, opt, x, y)
        assert w.rolled_back_steps == 0  # step 3's read is in flight
        with pytest.warns(RuntimeWarning, match="rolled back to the state step 2 began with"):
            w.flush()
    assert w.last_rollback == (3, 2)
    assert_same_state(full_state(model, opt), train(BNNet, make_opt, batches[:2]))


def test_a_step_without_a_forward_takes_no_snapshot():
    """A step that never ran the model (a penalty on the weights alone) began no copy of the buffers, so
    their values at its start are not known: no snapshot there; the one before it is restored."""
    torch.manual_seed(0)
    model = BNNet()
    opt = _OPTIMIZERS["sgd-momentum"](model.parameters())
    starts = []
    with nanfast.watch(model, opt, action="rollback", rollback_every=1) as w:
        for i in range(4):
            starts.append(full_state(model, opt))
            if i == 2:
                opt.zero_grad()
                model.l1.weight.pow(2).sum().backward()
                opt.step()
                continue
            if i == 3:
                with torch.no_grad():
                    model.l1.weight[0, 0] = NAN
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                train_step(model, opt, *batch(i))
    assert w.last_rollback == (3, 1)
    assert_same_state(full_state(model, opt), starts[1])


def test_a_bad_step_with_finite_parameters_is_skipped_as_skip_does():
    make_opt = _OPTIMIZERS["adam-foreach"]
    good = [batch(s) for s in range(4)]
    torch.manual_seed(0)
    model = BNNet()
    opt = make_opt(model.parameters())
    with nanfast.watch(model, opt, action="rollback", rollback_every=1) as w:
        for i, (x, y) in enumerate(good[:2] + [dirty(9)] + good[2:]):
            if i == 2:
                with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
                    train_step(model, opt, x, y)
            else:
                train_step(model, opt, x, y)
    assert w.skipped_steps == 1 and w.rolled_back_steps == 0 and w.last_rollback is None
    assert_same_state(full_state(model, opt), train(BNNet, make_opt, good))


def test_rollback_on_a_transformer():
    """A real model: embeddings, two TransformerEncoderLayers (attention, layer norms), AdamW; an update
    with an infinite learning rate makes the parameters non-finite; rolled back to the snapshot two steps
    apart, training goes on bit-identically to a run resumed from it."""

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 32)
            layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(32, 50)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)))

    def step(model, opt, tokens):
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1)).backward()
        opt.step()

    def run(batches, bad=None):
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        w = nanfast.watch(model, opt, action="rollback", rollback_every=2) if bad is not None else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, tokens in enumerate(batches):
                opt.param_groups[0]["lr"] = INF if i == bad else 1e-3
                step(model, opt, tokens)
                if w is not None and i == bad + 1:
                    assert w.last_rollback == (bad + 1, 2)  # snapshots at steps 0 and 2
                    assert_same_state(full_state(model, opt), run(batches[:2]))
        if w is not None:
            w.remove()
        return full_state(model, opt)

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 50, (4, 12), generator=g) for _ in range(8)]
    final = run(batches, bad=3)  # the update of step 3 makes the parameters non-finite
    assert all(torch.isfinite(p).all() for p in final[0].values())
    assert_same_state(final, run(batches[:2] + batches[5:]))


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "sgd-fused"])
def test_gradscaler_skips_are_not_rollbacks(fused):
    """AMP (bfloat16 autocast on CPU) with a GradScaler: a step whose scaled gradients overflow is the
    scaler's to skip (no event, no rollback); non-finite parameters later are rolled back as usual."""
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)
    w = nanfast.watch(model, opt, action="rollback", scaler=scaler, rollback_every=1)
    starts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(6):
            x, y = batch(i)
            if i == 2:
                y = y * 1e10  # finite loss and gradients (~1e10); scaled by 2^100, the gradients overflow
            if i == 4:
                with torch.no_grad():
                    model.l2.weight[0, 0] = NAN
            starts.append(full_state(model, opt))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
            if i == 2:
                assert w.rolled_back_steps == 0 and not w.events and scaler.get_scale() == 2.0 ** 99
            if i == 4:
                assert w.last_rollback == (4, 3)
                assert_same_state(full_state(model, opt), starts[3])
    w.remove()
    assert w.rolled_back_steps == 1 and len(w.events) == 1 and w.scaler_skipped_steps == 2  # steps 2 and 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_rollback_adds_no_host_read(sync):
    """Snapshots at every step, copied without a host read: the same reads per step as action="skip"."""
    syncs = {}
    for action in ("skip", "rollback"):
        torch.manual_seed(0)
        model = BNNet()
        opt = _OPTIMIZERS["adam-fused"](model.parameters())
        options = dict(rollback_every=1) if action == "rollback" else {}
        with nanfast.watch(model, opt, action=action, sync=sync, **options) as w:
            syncs[action] = []
            for s in range(5):
                with OpRecorder() as ops:
                    train_step(model, opt, *batch(s))
                syncs[action].append(ops.host_syncs)
            if action == "rollback":
                assert w._rollback._confirmed.step == (4 if sync == "eager" else 3)  # taken at every step
    assert syncs["rollback"] == syncs["skip"] == ([1] * 5 if sync == "eager" else [1, 0, 0, 0, 0])


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_snapshots_hold_one_copy_eager_two_lagged(sync):
    torch.manual_seed(0)
    model = BNNet()
    opt = _OPTIMIZERS["adam-fused"](model.parameters())
    with nanfast.watch(model, opt, action="rollback", sync=sync, rollback_every=1) as w:
        for s in range(4):
            train_step(model, opt, *batch(s))
        one = sum(t.numel() * t.element_size() for t in tensors_of(opt) + list(model.buffers()))
        assert w._rollback.nbytes == one * (1 if sync == "eager" else 2)
        assert w._rollback._confirmed.twins.groups[0][1].device.type == "cpu"
    assert w._rollback is None  # removing the watch lets its snapshots go


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_no_snapshot_yet_is_a_clear_error(sync):
    torch.manual_seed(0)
    model = BNNet()
    opt = _OPTIMIZERS["adam-fused"](model.parameters())
    with torch.no_grad():
        model.l1.weight[0, 0] = NAN  # before the first step: no good state was ever seen
    w = nanfast.watch(model, opt, action="rollback", sync=sync)
    no_snapshot = r"parameter l1.weight .*cannot roll back: no snapshot was taken yet"
    with pytest.raises(nanfast.NonFiniteError, match=no_snapshot):
        train_step(model, opt, *batch(0))
    assert w.rolled_back_steps == 0
    w.remove()


def test_bad_rollback_options_are_clear_errors():
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for every in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=r"rollback_every must be an int >= 1, got"):
            nanfast.watch(model, opt, action="rollback", rollback_every=every)
    for device in ("bogus", 1.5, "cuda:99" if torch.cuda.is_available() else "cuda"):
        with pytest.raises(ValueError, match=r"rollback_device must be a device this process can allocate on"):
            nanfast.watch(model, opt, action="rollback", rollback_device=device)
    with pytest.raises(ValueError, match="rollback_device='meta' holds no values"):
        nanfast.watch(model, opt, action="rollback", rollback_device="meta")
    with pytest.raises(ValueError, match=r"rollback_every= is an option of action='rollback' \(got action='skip'\)"):
        nanfast.watch(model, opt, action="skip", rollback_every=10)
    with pytest.raises(ValueError, match=r"rollback_device= is an option of action='rollback'"):
        nanfast.watch(model, opt, rollback_device="cpu")
    with pytest.raises(ValueError, match="action='rollback' needs the optimizer"):
        nanfast.watch(model, action="rollback")
    with pytest.raises(ValueError, match="action='rollback' needs params=True"):
        nanfast.watch(model, opt, action="rollback", params=False)
    with pytest.raises(ValueError, match="action='rollback' cannot skip LBFGS steps"):
        nanfast.watch(model, torch.optim.LBFGS(model.parameters()), action="rollback")
    with pytest.raises(ValueError, match="action='rollback' with sync='lagged' needs an optimizer that skips on the"):
        nanfast.watch(model, opt, action="rollback", sync="lagged")
    assert not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks  # nothing was installed
    with nanfast.watch(model, opt, action="rollback", rollback_every=7, rollback_device=torch.device("cpu")) as w:
        assert w._rollback.every == 7 and w._rollback.device == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_rollback_on_cuda_copies_without_a_host_read(where):
    """On a GPU: the snapshots go to pinned host memory (or stay on the GPU) with non-blocking copies
    ordered before the optimizer's update: good steps keep their one read, and the rollback is exact."""

    def run(batches, bad=None):
        torch.manual_seed(0)
        model = BNNet().cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        w = nanfast.watch(model, opt, action="rollback", rollback_every=1, rollback_device=where) if bad else None
        syncs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, (x, y) in enumerate(batches):
                if i == bad:
                    with torch.no_grad():
                        model.l1.weight[0, 0] = NAN
                with OpRecorder() as ops:
                    train_step(model, opt, x.cuda(), y.cuda())
                syncs.append(ops.host_syncs)
        if w is not None:
            flats = [flat for _, flat, _ in w._rollback._confirmed.twins.groups]
            assert all(f.device.type == where and (f.is_pinned() or where == "cuda") for f in flats)
            w.remove()
        return full_state(model, opt), w, syncs

    batches = [batch(s) for s in range(7)]
    state, w, syncs = run(batches, bad=4)
    assert w.last_rollback == (4, 3) and syncs[:4] == [1, 1, 1, 1]
    assert_same_state(state, run(batches[:3] + batches[5:])[0])


class _Headed(torch.nn.Module):
    """BNNet with a head attached during training (fine-tuning: a new head, its own parameter group)."""

    def __init__(self):
        super().__init__()
        self.body = BNNet()
        self.head = None

    def forward(self, x):
        h = self.body(x)
        return h if self.head is None else self.head(h)


def _headed_run(nan_at: int, sync: str):
    """Trains _Headed under a rolling-back watch; a head joins the optimizer at step 3 and NaN is written
    into its weight before step `nan_at`. Returns the watch, the state step 3 began with, the state after
    the rollback (None if none) and the error raised (None if none)."""
    torch.manual_seed(0)
    model = _Headed()
    opt = _OPTIMIZERS["adam-fused"](model.parameters())
    w = nanfast.watch(model, opt, action="rollback", sync=sync)
    began, after = None, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(8):
            if i == 3:
                model.head = torch.nn.Linear(4, 4)
                opt.add_param_group({"params": model.head.parameters()})
                began = full_state(model, opt)
            if i == nan_at:
                with torch.no_grad():
                    model.head.weight[1, 2] = NAN
            try:
                train_step(model, opt, *batch(i))
            except nanfast.NonFiniteError as e:
                return w, began, after, e
            if w.rolled_back_steps and after is None:
                after = full_state(model, opt)
        w.flush()
    return w, began, after, None


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_a_parameter_group_added_later_is_in_the_next_snapshot(sync):
    """A head added with add_param_group after the last snapshot, then made NaN: the rollback restored the
    body from the older snapshot and left the head NaN, rolling back again at every step, forever, each
    time saying it had restored the state. The changed parameter list now makes a snapshot due at once."""
    w, began, after, error = _headed_run(nan_at=4, sync=sync)
    assert error is None and w.rolled_back_steps == 1 and w.last_rollback[1] == 3, w.last_rollback
    assert_same_state(after, began)  # head included: the state step 3 began with, bit for bit
    assert all(torch.isfinite(p).all() for p in w.model.parameters())
    w.remove()


def test_a_rollback_to_a_snapshot_without_a_parameter_is_refused():
    """The head is NaN in the first step it is in the optimizer: the only snapshot predates it, so no state
    holds a value for it; refused, nothing put back."""
    w, began, after, error = _headed_run(nan_at=3, sync="eager")
    assert isinstance(error, nanfast.NonFiniteError) and after is None and w.rolled_back_steps == 0
    assert "cannot roll back: the optimizer's parameters head.weight, head.bias were added after the last " \
           "snapshot (step 0)" in str(error), str(error)
    params, buffers, _ = full_state(w.model, w.optimizer)
    assert torch.equal(params["body.l1.weight"], began[0]["body.l1.weight"])  # the body was not rolled back
    w.remove()


def test_a_lagged_rollback_leaves_a_record_for_the_step_it_skipped():
    """A lagged rollback happens at the next optimizer.step(), whose update (computed from the bad
    parameters) is skipped and its read dropped: that step had no record at all, the timeline going from
    step 5 to 7 (a probe, session 49); it is part of the rollback w.rolled_back_steps counts. Eager leaves
    no such step."""
    histories = {}
    for sync in ("eager", "lagged"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the rollback's own
            with nanfast.watch(model, opt, action="rollback", rollback_every=2, sync=sync) as w:
                for i in range(9):
                    if i == 5:
                        with torch.no_grad():
                            model[0].weight[0, 0] = float("nan")
                    opt.zero_grad()
                    F.mse_loss(model(torch.randn(6, 8)), torch.randn(6, 4)).backward()
                    opt.step()
        assert w.rolled_back_steps == 1 and w.last_rollback == (5, 4)
        histories[sync] = [(r.step, r.skipped, r.rolled_back) for r in w.history]
        skipped = w.skipped_steps
    assert [s for s, _, _ in histories["lagged"]] == list(range(9)) == [s for s, _, _ in histories["eager"]]
    assert histories["lagged"][5:7] == [(5, False, True), (6, True, False)] and skipped == 0
    assert histories["eager"][5:7] == [(5, False, True), (6, False, False)]
