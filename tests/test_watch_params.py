"""When the watch reads the parameters (NOTE: [Parameters read when they add information]): every
`params_every` checked steps, at every step whose forward output was not checked, at a due rollback
snapshot, in a lagged watch with a step whose records are not finite (or not known to be), and on an
eager watch's bad step to name them; a non-finite parameter is still found at the
step it would have been found at, named first, and the skip, raise and rollback actions see it."""

from __future__ import annotations

import pytest
import torch

import nanfast
from op_recorder import OpRecorder


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def step(model, opt, w, x=None):
    opt.zero_grad()
    x = torch.randn(4, 8) if x is None else x
    w.loss(model(x).square().mean()).backward()
    opt.step()


def param_reads(w) -> list[bool]:
    return [r.param_norm is not None for r in w.history]


def test_parameters_are_read_every_params_every_checked_steps():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = sum(p.numel() for p in model.parameters()) * 4
    with nanfast.watch(model, opt, params_every=3, profile=True) as w:
        passes = []
        for _ in range(7):
            before = w.costs()["pass_bytes"]
            step(model, opt, w)
            passes.append(w.costs()["pass_bytes"] - before)
    assert param_reads(w) == [True, False, False, True, False, False, True]
    # The pass reads the gradients at every step, the parameters only where they were read.
    assert passes == [2 * grads if read else grads for read in param_reads(w)]
    assert "param_norm" in w.stats()  # step 6 read them
    with nanfast.watch(model, opt, every=2, params_every=2) as w:  # counted in checked steps
        for _ in range(6):
            step(model, opt, w)
    assert [r.step for r in w.history] == [0, 2, 4] and param_reads(w) == [True, False, True]


@pytest.mark.parametrize("action", ["raise", "skip"])
def test_a_parameter_made_nonfinite_is_named_first_at_the_next_step(action):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action=action, params_every=1000) as w:
        for _ in range(3):
            step(model, opt, w)
        with torch.no_grad():
            model[2].weight[1, 4] = float("inf")  # as a bad update would leave it
        opt.zero_grad()
        w.loss(model(torch.randn(4, 8)).square().mean()).backward()
        with OpRecorder() as ops, pytest.raises(nanfast.NonFiniteError) as raised:
            opt.step()
    event = raised.value.report
    assert (event.step, event.phase, event.name, event.first.posinf) == (3, "param", "2.weight", 1)
    if action == "skip":
        assert "cannot be skipped once the parameters are non-finite" in str(raised.value)
    # The step's pass over the gradients, then the parameters read to name them: on a bad step only.
    assert ops.counts["nanfast.stats.default"] == 2 and ops.host_syncs == 1
    assert not torch.isfinite(model[2].weight).all()  # nothing was applied over it
    assert w.history[-1].posinf >= 1 and w.history[-1].param_norm is None


def test_a_clean_step_without_the_parameters_makes_one_read():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, params_every=1000) as w:
        step(model, opt, w)
        with OpRecorder() as ops:
            step(model, opt, w)
    assert ops.host_syncs == 1 and param_reads(w) == [True, False]


def test_an_embedding_row_no_step_looks_up_is_found_by_the_periodic_read():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model[0].weight[9] = float("nan")  # a row no batch below uses
    seen = []
    with nanfast.watch(model, opt, action=seen.append, params_every=4) as w:
        for _ in range(6):
            opt.zero_grad()
            w.loss(model(torch.randint(0, 9, (3, 2))).mean()).backward()
            opt.step()
    # Steps 1-3 did not read it and no checked value depended on it; step 4 read it.
    assert [(e.step, e.phase, e.name, e.first.nan) for e in seen] == [(0, "param", "0.weight", 4),
                                                                    (4, "param", "0.weight", 4)]


@pytest.mark.parametrize("options", [dict(loss=False), dict(ignore="*"), dict(sync="lagged", fuse=True)],
                         ids=["output-unchecked", "model-ignored", "lagged-records-deferred"])
def test_every_step_reads_them_when_no_checked_output_stands_for_them(options):
    # A lagged watch whose records are not numbers on the host yet (deferred to the pass) cannot tell.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, params_every=1000, **options) as w:
        for _ in range(3):
            step(model, opt, w)
    assert param_reads(w) == [True, True, True]


def test_a_lagged_cpu_watch_reads_them_with_a_step_whose_records_are_not_finite():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, sync="lagged", params_every=1000) as w:
        for _ in range(3):
            step(model, opt, w)
        with torch.no_grad():
            model[2].weight[1, 4] = float("inf")  # as a bad update would leave it
        step(model, opt, w)  # its verdict comes at the next read, after opt.step() moved the weights
        with pytest.raises(nanfast.NonFiniteError) as raised:
            w.flush()
    event = raised.value.report
    assert (event.step, event.phase, event.name, event.first.posinf) == (3, "param", "2.weight", 1)
    # The first read, then the healthy steps' gradients alone, then the bad step's parameters with it.
    assert param_reads(w) == [True, False, False, True]


def test_a_lagged_watch_names_a_gradient_without_reading_the_moved_parameters():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, sync="lagged", action="warn", params_every=1000) as w:
        step(model, opt, w)
        handle = model[0].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
        with pytest.warns(RuntimeWarning, match="non-finite"):
            step(model, opt, w)  # a finite forward; the SGD update makes the bias NaN
            handle.remove()
            w.flush()
    assert not torch.isfinite(model[0].bias).any()
    # Read again now, the parameters would be NaN and named first; the step found them finite.
    assert (w.last.step, w.last.phase, w.last.name) == (1, "grad", "0.bias")
    assert w.last.first.nan == 16 and not any(p.phase == "param" for p in w.last.places)


def test_a_lagged_watch_skipping_on_the_device_reads_them_again_at_the_verdict():
    """Its optimizer skips a bad step on the device, so the parameters are still as the bad step found
    them when the verdict comes a step later: read then, not at every step, even where its records are
    not known on the host (fuse=True defers them to the pass, as an accelerator's stay on the device)."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    w = nanfast.watch(model, opt, sync="lagged", action="skip", fuse=True, params_every=1000)
    for _ in range(3):
        step(model, opt, w)
    with torch.no_grad():
        model[2].weight[1, 4] = float("inf")  # as a bad update would leave it
    found = [p.detach().clone() for p in model.parameters()]
    step(model, opt, w)  # skipped on the device; its verdict comes with the next step's read
    assert all(torch.equal(p, f) for p, f in zip(model.parameters(), found))
    with pytest.raises(nanfast.NonFiniteError, match="cannot be skipped once the parameters are non-finite"):
        step(model, opt, w)  # (the watch is left on: its pending read of this bad step would raise too)
    event = w.events[0]
    assert (event.step, event.phase, event.name, event.first.posinf) == (3, "param", "2.weight", 1)
    assert param_reads(w)[:4] == [True, False, False, False]


def test_a_step_with_no_forward_through_the_model_reads_them():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, params_every=1000) as w:
        step(model, opt, w)
        opt.zero_grad()
        model[2].weight.grad = torch.ones_like(model[2].weight)  # a step with no forward
        opt.step()
    assert param_reads(w) == [True, True]


def test_a_due_rollback_snapshot_reads_them_and_a_rollback_restores_it():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="rolled back"):
        with nanfast.watch(model, opt, action="rollback", rollback_every=2, params_every=1000) as w:
            for _ in range(2):
                step(model, opt, w)
            good = [p.detach().clone() for p in model.parameters()]  # as step 2 begins: its snapshot
            step(model, opt, w)
            with torch.no_grad():
                model[0].bias[0] = float("nan")
            step(model, opt, w)
    assert param_reads(w)[:3] == [True, False, True]
    assert w.rolled_back_steps == 1 and w.last_rollback == (3, 2)
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), good))


def test_params_every_must_be_a_positive_int():
    model = mlp()
    for bad in (0, -1, 2.0, True, "10"):
        with pytest.raises(ValueError, match=r"params_every must be an int >= 1, got"):
            nanfast.watch(model, params_every=bad)


def test_several_parameters_read_together_are_not_said_to_propagate_to_each_other():
    """The parameters are read together at the step's start: two made NaN by the same update are both
    where the step began, in the optimizer's order, and only the places after them are propagation."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action=lambda event: None) as w:
        step(model, opt, w)
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
            model[2].weight[1, 1] = float("nan")
        step(model, opt, w)
    [event] = w.events
    assert [(p.phase, p.name) for p in event.places[:2]] == [("param", "0.weight"), ("param", "2.weight")]
    assert all(p.phase != "param" for p in event.places[2:]) and len(event.places) > 2
    text = event.summary()
    head, propagated = text.split("; then propagated to ")
    assert "non-finite values in parameter 0.weight (nan=1, +inf=0, -inf=0), parameter 2.weight (nan=1" in head
    listed = "; ".join(p.where() for p in event.places[2:10])
    assert propagated.startswith(f"{len(event.places) - 2} places: {listed}")


def test_gradients_that_overflow_where_nothing_else_does_are_named_as_read_together():
    """A float16 weight gradient sums over the batch: with finite inputs, outputs and output gradients it
    overflows alone (here 4096 rows of 16 x 16 = 1M > 65504, in the weight's and the bias's gradients).
    Those rows come from the one pass after backward, in the optimizer's order: the event names both,
    says that their order is unknown, and claims no propagation between them."""
    lin = torch.nn.Linear(4, 4).half()
    opt = torch.optim.SGD(lin.parameters(), lr=1e-6)
    x = torch.full((4096, 4), 16.0, dtype=torch.half)
    with nanfast.watch(lin, opt, action=lambda event: None) as w:
        opt.zero_grad()
        out = lin(x)
        (out.float() * 16).sum().backward()
        assert out.isfinite().all() and lin.weight.grad.isinf().all() and lin.bias.grad.isinf().all()
        opt.step()
    [event] = w.events
    assert [(p.phase, p.name, p.posinf) for p in event.places] == [("grad", "weight", 16), ("grad", "bias", 4)]
    assert event.summary() == (
        "nanfast.watch: step 0: non-finite values first appeared in the gradients of 2 parameters, read together "
        "after backward (which one backward made first is not known): gradient of parameter weight (nan=0, +inf=16, "
        "-inf=0), gradient of parameter bias (nan=0, +inf=4, -inf=0)")


@pytest.mark.parametrize("loaded", [False, True])
def test_a_parameter_nonfinite_at_the_watchs_first_step_is_not_blamed_on_an_optimizer_step(loaded, tmp_path):
    """At the watch's first step no optimizer step of its own came before: a NaN weight then was in the
    initial values or in a checkpoint loaded before training (here one saved by torch.save and loaded
    with load_state_dict); from the second step on, the update before is named."""
    model = mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    if loaded:
        torch.save(model.state_dict(), tmp_path / "ckpt.pt")
        model = mlp()
        model.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, action=lambda event: None) as w:
        step(model, opt, w)
    [event] = w.events
    assert (event.step, event.phase, event.name) == (0, "param", "2.weight")
    assert "already there when the watch began" in event.summary()
    assert "previous optimizer step" not in event.summary()


def test_one_place_after_the_producer_is_one_place():
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with nanfast.watch(model, action=lambda event: None) as w:
        model(torch.randn(3, 4)).sum().backward()
        w.step()
    [event] = w.events
    assert [p.phase for p in event.places] == ["param", "forward"]
    assert event.summary().endswith("then propagated to 1 place: output of <model> (Linear)")


def test_a_dirty_input_the_model_made_in_an_earlier_step_is_not_said_to_come_from_elsewhere():
    """A sampling loop feeds each output back as the next input (generation, diffusion): the step whose
    output overflowed is the producer; the next step's dirty input is then said not to come from the
    model *in that step*, which is true, where "the model did not produce it" was not."""
    model = torch.nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)  # each output is the sum of the inputs
    x = torch.ones(1, 8)
    with nanfast.watch(model, action=lambda event: None) as w, torch.no_grad():
        x = model(x)  # step 0: 8.0 each
        x = model(x * 1.25e37)  # step 1: finite inputs (1e38), sums of 8e38 overflow float32
        model(x)  # step 2: fed its own output back
    first, second = w.events
    assert (first.step, first.phase, first.posinf) == (1, "forward", 8)
    assert (second.step, second.phase) == (2, "input")
    assert "; the model did not produce it in this step" in second.summary()


def test_a_lagged_cpu_watch_names_a_parameter_reaching_the_loss_outside_the_forward():
    """An inf in an embedding row no batch looks up, with an L2 term written in the loop: the forward and
    every record stay finite, the row's gradient is inf. Eager names the parameter (its bad step reads
    them again); a lagged CPU watch, whose verdict comes after the update, read them at once when the
    pass's gradient counts showed it (a probe of session 39 found it named the gradient)."""

    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(100, 16), torch.nn.Linear(16, 3)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    found = {}
    for sync in ("eager", "lagged"):
        torch.manual_seed(0)
        model = Bag()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with pytest.warns(RuntimeWarning, match="non-finite"):
            with nanfast.watch(model, opt, sync=sync, action="warn", params_every=1000) as w:
                for i in range(4):
                    if i == 2:
                        with torch.no_grad():
                            model.emb.weight[99] = float("inf")  # batches look up ids < 50
                    ids, y = torch.randint(0, 50, (8, 10)), torch.randint(0, 3, (8,))
                    opt.zero_grad()
                    loss = torch.nn.functional.cross_entropy(model(ids), y)
                    (loss + 1e-4 * sum(p.square().sum() for p in model.parameters())).backward()
                    opt.step()
        event = w.events[0]
        found[sync] = (event.step, event.phase, event.name, [(p.phase, p.name) for p in event.later])
    assert found["eager"] == found["lagged"] == (2, "param", "emb.weight", [("grad", "emb.weight")])


def test_with_every_n_a_non_finite_parameter_is_said_to_come_from_the_unchecked_steps():
    """every=3: a dirty batch at unchecked step 4 writes NaN into the parameters; the next checked step,
    6, said they were "made by the previous optimizer step" (step 5, which only carried them on). Any
    step since the last checked one may have (a probe, session 49)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanfast.NonFiniteError, match=r"step 6 began with non-finite values in parameter 0.weight .*: "
                                                     r"made by one of the optimizer steps 3 to 5 \(or whatever last "
                                                     r"wrote the parameters\): with every=3, the steps after 3 were "
                                                     r"not checked"):
        with nanfast.watch(model, opt, action="skip", every=3) as w:
            for i in range(8):
                x = torch.randn(6, 8)
                if i == 4:
                    x[1, 3] = float("nan")
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), torch.randn(6, 4)).backward()
                opt.step()
    assert w.last.every == 3 and w.last.step == 6
