"""A skip with training mechanics that write buffers in ways a version counter does not show (session 44's
probe): quantization-aware training's fused observers, and torch.func.functional_call with buffers of
the caller's."""

import warnings

import pytest
import torch

import nanfast

NAN = float("nan")


def _qat_model():
    import torch.ao.quantization as Q

    torch.manual_seed(0)
    model = torch.nn.Sequential(Q.QuantStub(), torch.nn.Linear(4, 3), Q.DeQuantStub()).train()
    model.qconfig = Q.get_default_qat_qconfig("fbgemm")  # FusedMovingAvgObsFakeQuantize, per-channel weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        Q.prepare_qat(model, inplace=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _state(model, optimizer):
    return {**{f"model.{k}": v.clone() for k, v in model.state_dict().items()},
            **{f"opt.{k}": v.clone() for k, v in optimizer.state_dict()["state"].get(0, {}).items()}}


def _differ(a, b):
    return [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("action", ["skip", "raise"])
def test_a_bad_first_qat_step_puts_back_the_observers_it_resized(action):
    """The per-channel observer resizes min_val, max_val, scale and zero_point in its first forward, in
    the fused kernel (no version bump): the skip crashed copying the old shapes back, left them resized."""
    model, opt = _qat_model()
    before = _state(model, opt)
    x = torch.randn(8, 4)
    x[0, 0] = NAN
    with nanfast.watch(model, opt, action=action) as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "skipped"
        opt.zero_grad()
        model(x).sum().backward()
        if action == "raise":
            with pytest.raises(nanfast.NonFiniteError, match="input batch is dirty"):
                opt.step()
        else:
            opt.step()
            assert w.skipped_steps == 1
        assert _differ(before, _state(model, opt)) == []
        for _ in range(2):  # and the run goes on, the observers resized again by healthy steps
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
        assert len(w.events) == 1


def test_a_skipped_qat_step_puts_back_the_zero_point_its_fused_kernel_wrote():
    """fused_moving_avg_obs_fake_quant writes the int32 zero_point without a version bump: it was never
    copied, and a skip left the bad batch's (INT_MIN for a NaN input) beside the restored scale."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(4)]
    x, y = batches[3]
    batches[3] = (x * 5 + 3, y.clone())
    batches[3][0][0, 0] = NAN

    def train(watch):
        model, opt = _qat_model()
        with (nanfast.watch(model, opt, action="skip") if watch else warnings.catch_warnings()) as w:
            warnings.simplefilter("ignore", RuntimeWarning)
            for i, (x, y) in enumerate(batches):
                if i == 3 and not watch:
                    continue  # the reference never sees the bad batch
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
            assert not watch or w.skipped_steps == 1
        return _state(model, opt)

    assert _differ(train(True), train(False)) == []


def test_a_skip_leaves_the_models_buffers_when_functional_call_swapped_in_others():
    """functional_call(model, (params, buffers), x) installs the caller's buffers for the forward: the
    skip then made them the model's own for good, and left the model's statistics as the caller's."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    domain = {"1.running_mean": torch.zeros(6), "1.running_var": torch.ones(6),
              "1.num_batches_tracked": torch.tensor(0)}
    own = {k: (v, v.clone()) for k, v in model.named_buffers()}
    with nanfast.watch(model, opt, action="skip") as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(3):
            x, y = torch.randn(5, 4), torch.randn(5, 2)
            if step == 1:
                x[0, 0] = NAN
                domain_before = {k: v.clone() for k, v in domain.items()}
            opt.zero_grad()
            out = functional_call(model, (dict(model.named_parameters()), domain), (x,))
            ((out - y) ** 2).mean().backward()
            opt.step()
            if step == 1:
                assert w.skipped_steps == 1
                assert _differ(domain_before, domain) == []  # the caller's statistics put back
        for name, buffer in model.named_buffers():
            assert buffer is own[name][0] and torch.equal(buffer, own[name][1])


def test_rollback_snapshots_the_sparse_momentum_of_a_sparse_embedding():
    """SGD's momentum for a sparse gradient is a sparse tensor: the snapshot copied it into a dense twin,
    and a healthy run crashed at its first snapshot with optimizer state."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.01, momentum=0.9)
    with nanfast.watch(emb, opt, action="rollback", rollback_every=1) as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the rollback's own
        for step in range(4):
            if step == 2:  # the state the last snapshot holds, as step 2 began
                weight = emb.weight.detach().clone()
                momentum = opt.state[emb.weight]["momentum_buffer"].to_dense()
            if step == 3:
                with torch.no_grad():
                    emb.weight[0, 0] = NAN
            opt.zero_grad()
            emb(torch.tensor([1, 2, 3])).sum().backward()
            opt.step()
        assert w.last_rollback == (3, 2) and w.events[-1].kind == "nonfinite"
        assert torch.equal(emb.weight, weight)
        assert torch.equal(opt.state[emb.weight]["momentum_buffer"].to_dense(), momentum)
