"""nanfast.integrations.lightning.NanfastCallback in the real Lightning Trainer: a small LightningModule
on CPU, a fault planted in one layer's output at a chosen forward; raise and skip behave as in a plain
loop (Lightning steps the optimizer with a closure), gradient accumulation works, the statistics reach
a real logger (CSVLogger's metrics file); parameters made non-finite between steps are rolled back
(action="rollback") and stop a skip."""

from __future__ import annotations

import contextlib
import csv
import importlib
import sys

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger

import nanfast
from nanfast.integrations.lightning import NanfastCallback
from training_state import FAULTS, break_parameters, equal, hooks_of, plant_inf, state_of

LAYER = "net.2"
WEIGHT = "net.2.weight"


class Regression(LightningModule):
    def __init__(self, optimizer: str = "adam"):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                       torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.optimizer = optimizer

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 4, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=4)


def trainer(tmp_path, callbacks, steps: int = 5, **kwargs) -> Trainer:
    return Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=CSVLogger(str(tmp_path), name="run"),
                   callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, log_every_n_steps=1, **kwargs)


class Snapshot(Callback):
    """Copies the parameters and the optimizer state when each optimizer step begins (`began`: its first
    microbatch's on_train_batch_start) and after its update (`stepped`: the next on_train_batch_end), by
    trainer.global_step at the step's start."""

    def __init__(self):
        self.began, self.stepped = {}, {}
        self._stepping = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step not in self.began:
            self.began[trainer.global_step] = state_of(pl_module, trainer.optimizers[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._stepping = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._stepping is not None:
            self.stepped[self._stepping] = state_of(pl_module, trainer.optimizers[0])
            self._stepping = None

    def unchanged(self, step: int) -> bool:
        """Whether the `step`-th optimizer step left parameters and optimizer state bit-identical."""
        return equal(self.began[step], self.stepped[step])


class BreakParameters(Callback):
    """Makes the parameters non-finite before optimizer step `at` begins (break_parameters): "huge_lr"
    in step at-1's update (its lr is put back after it), "nan_weight" after it."""

    def __init__(self, fault: str, at: int):
        self.fault, self.at = fault, at
        self._lrs = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.fault == "huge_lr" and trainer.global_step == self.at - 1:
            self._lrs = [group["lr"] for group in optimizer.param_groups]
            break_parameters(self.fault, pl_module, optimizer, WEIGHT)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._lrs is not None:
            for group, lr in zip(trainer.optimizers[0].param_groups, self._lrs):
                group["lr"] = lr
            self._lrs = None
        if self.fault == "nan_weight" and trainer.global_step == self.at:  # step at-1 was counted
            break_parameters(self.fault, pl_module, trainer.optimizers[0], WEIGHT)


def logged(trainer: Trainer) -> list[dict]:
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def test_raise_names_the_layer(tmp_path):
    module = Regression()
    plant_inf(module, LAYER, at_forward=3)
    before = hooks_of(module)
    callback = NanfastCallback(action="raise")
    t = trainer(tmp_path, [callback])
    with pytest.raises(nanfast.NonFiniteError) as caught:
        t.fit(module)
    event = caught.value.report
    assert (event.step, event.phase, event.name, event.module_class) == (2, "forward", LAYER, "Linear")
    assert t.global_step == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert hooks_of(module) == before and not t.optimizers[0]._optimizer_step_pre_hooks  # on_exception removed it


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_skip_leaves_the_step_unapplied_and_logs(tmp_path, optimizer):
    module = Regression(optimizer)
    plant_inf(module, LAYER, at_forward=3)
    before = hooks_of(module)
    snapshot, callback = Snapshot(), NanfastCallback(action="skip", params_every=1)
    t = trainer(tmp_path, [snapshot, callback], gradient_clip_val=1.0)
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        t.fit(module)
    # Lightning clipped the NaN gradients (all NaN then); the watch took them away before the update.
    assert snapshot.unchanged(2)
    assert t.global_step == 5 and callback.watch.step_count == 5
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert callback.watch.skipped_steps == 1 and callback.watch.events[0].name == LAYER
    assert hooks_of(module) == before and not t.optimizers[0]._optimizer_step_pre_hooks
    rows = [r for r in logged(t) if "nanfast/grad_norm" in r]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4]
    bad = rows[2]
    assert float(bad["nanfast/posinf"]) > 0 and float(bad["nanfast/nan"]) > 0
    assert float(bad["nanfast/skipped_steps"]) == 1 and float(rows[1]["nanfast/skipped_steps"]) == 0
    assert float(rows[3]["nanfast/param_norm"]) == float(bad["nanfast/param_norm"])  # nothing moved


def test_gradient_accumulation(tmp_path):
    module = Regression()
    plant_inf(module, LAYER, at_forward=4)  # the second microbatch of the second step
    snapshot, callback = Snapshot(), NanfastCallback(action="skip")
    t = trainer(tmp_path, [snapshot, callback], steps=3, accumulate_grad_batches=2)
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        t.fit(module)
    event = callback.watch.events[0]
    assert (event.step, event.name, event.first.microbatch) == (1, LAYER, 1)
    assert snapshot.unchanged(1)
    assert t.global_step == 3 and callback.watch.step_count == 3
    assert len([r for r in logged(t) if "nanfast/grad_norm" in r]) == 3  # once per optimizer step


@pytest.mark.parametrize("every, restored", [(1, 3), (2, 2)])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_rollback_puts_back_the_last_snapshot(tmp_path, optimizer, fault, every, restored):
    # Step 4 begins with non-finite parameters (NaN written into a weight after step 3, or step 3 applied
    # with lr=inf), which no skip can repair. The watch puts back the state its last snapshot holds: the
    # one step `restored` began with (rollback_every=1: step 3; 2: snapshots at steps 0 and 2).
    module = Regression(optimizer)
    snapshot, callback = Snapshot(), NanfastCallback(action="rollback", rollback_every=every, params_every=1)
    t = trainer(tmp_path, [snapshot, BreakParameters(fault, at=4), callback], steps=6, gradient_clip_val=1.0)
    with pytest.warns(RuntimeWarning, match=f"rolled back to the state step {restored} began with"):
        t.fit(module)
    w = callback.watch
    assert (w.rolled_back_steps, w.skipped_steps, w.last_rollback) == (1, 0, (4, restored))
    assert [(e.step, e.phase) for e in w.events] == [(4, "param")]
    assert fault != "nan_weight" or w.events[0].name == WEIGHT
    # After step 4's update: parameters and the optimizer's state as step `restored` began, bit for bit.
    assert equal(snapshot.stepped[4], snapshot.began[restored])
    assert t.global_step == 6 and w.step_count == 6
    assert all(torch.isfinite(p).all() for p in module.parameters())
    rows = {int(r["step"]): r for r in logged(t) if "nanfast/grad_norm" in r}
    assert sorted(rows) == [0, 1, 2, 3, 4, 5]
    bad = rows[4]
    assert float(bad["nanfast/nan"]) + float(bad["nanfast/posinf"]) + float(bad["nanfast/neginf"]) > 0
    assert float(bad["nanfast/rolled_back_steps"]) == 1 and float(bad["nanfast/skipped_steps"]) == 0
    assert float(rows[3]["nanfast/rolled_back_steps"]) == 0 and float(rows[3]["nanfast/nan"]) == 0
    # Step 5 began with the restored parameters: the norm that step `restored` read.
    assert rows[5]["nanfast/param_norm"] == rows[restored]["nanfast/param_norm"]


@pytest.mark.parametrize("fault", FAULTS)
def test_skip_cannot_repair_nonfinite_parameters(tmp_path, fault):
    module = Regression()
    callback = NanfastCallback(action="skip")
    t = trainer(tmp_path, [BreakParameters(fault, at=4), callback], steps=6)
    with pytest.raises(nanfast.NonFiniteError, match="cannot be skipped once the parameters are non-finite") as caught:
        t.fit(module)
    assert (caught.value.report.step, caught.value.report.phase) == (4, "param")
    assert t.global_step == 4 and callback.watch.skipped_steps == 0
    assert not t.optimizers[0]._optimizer_step_pre_hooks  # on_exception removed the hooks


def test_validation_and_bf16_during_fit(tmp_path):
    # Validation runs under inference_mode between training steps, with the watch on; bf16-mixed
    # autocasts and steps through the closure (no GradScaler).
    class WithValidation(Regression):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

        def val_dataloader(self):
            return self.train_dataloader()

    module = WithValidation()
    plant_inf(module, LAYER, at_forward=3)
    callback = NanfastCallback(action="skip")
    t = trainer(tmp_path, [callback], steps=6, val_check_interval=2, limit_val_batches=2, precision="bf16-mixed")
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        t.fit(module)
    assert t.global_step == 6 and callback.watch.skipped_steps == 1 and len(callback.watch.events) == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert any("val_loss" in r for r in logged(t))


class DirtyValidation(Regression):
    """Its second validation batch holds a NaN."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        self.log("val_loss", torch.nn.functional.mse_loss(self.validate(x), y))

    def validate(self, x):
        return self(x)

    def val_dataloader(self):
        return self.train_dataloader()


def test_a_dirty_validation_batch_skips_no_training_step(tmp_path):
    """Validation runs under inference_mode between optimizer steps. A NaN in a validation batch is that
    forward's own event (evaluation), read when it returns: it used to count into the next training
    step, which a skip watch then skipped though it was healthy (and a raise watch stopped at its
    optimizer step, naming its input batch)."""
    module = DirtyValidation()
    callback = NanfastCallback(action="skip")
    t = trainer(tmp_path, [callback], steps=6, val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0)
    with pytest.warns(RuntimeWarning, match="an evaluation forward, so no optimizer step to skip"):
        t.fit(module)
    w = callback.watch
    assert t.global_step == 6 and w.skipped_steps == 0 and w.step_count == 6
    assert w.events and all(e.evaluation and e.phase == "input" for e in w.events)
    assert [e.step for e in w.events] == [2, 4, 6]  # after steps 1, 3 and 5: before the next one began
    assert "(an evaluation: a forward in eval mode without gradients)" in w.events[0].summary()
    assert all(torch.isfinite(p).all() for p in module.parameters())


def fit_without_and_with_a_skip_watch(tmp_path, module_class, accumulate_grad_batches: int):
    """Six steps validating every third batch, on a module without the callback and on one with a skip
    watch (its warning that an evaluation has no step to skip expected): (plain, watched, the watch)."""
    options = dict(steps=6, accumulate_grad_batches=accumulate_grad_batches, val_check_interval=3,
                   limit_val_batches=2, num_sanity_val_steps=0)
    plain = module_class()
    trainer(tmp_path / "plain", [], **options).fit(plain)
    module, callback = module_class(), NanfastCallback(action="skip")
    with pytest.warns(RuntimeWarning, match="an evaluation forward, so no optimizer step to skip"):
        trainer(tmp_path / "watched", [callback], **options).fit(module)
    return plain, module, callback.watch


def test_a_dirty_validation_batch_inside_an_accumulation_window_skips_no_training_step(tmp_path):
    """With accumulate_grad_batches=2 and val_check_interval=3, Lightning validates between the two
    microbatches of an optimizer step. Its dirty batch was read with that step as "microbatch 2" of a
    step of two: a skip watch dropped two healthy steps (weights unlike a run without the callback), a
    raise watch stopped fit(); a clean step's own second microbatch was named "microbatch 3"."""
    plain, module, w = fit_without_and_with_a_skip_watch(tmp_path, DirtyValidation, accumulate_grad_batches=2)
    assert w.skipped_steps == 0 and w.step_count == 6 and w.events
    assert all(e.evaluation and e.phase == "input" and e.first.microbatch == 0 for e in w.events)
    assert [e.step for e in w.events] == [1, 3, 4, 6]  # 1 and 4: inside the window of steps 1 and 4
    for (name, a), b in zip(module.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name  # bit for bit: every training step was applied as without the watch


class DirtyValidationThroughSubmodule(DirtyValidation):
    """Validates through its submodule (self.net(x)), as many LightningModules do, and trains through its
    own forward, as the callback's docs recommend."""

    def validate(self, x):
        return self.net(x)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_dirty_validation_batch_through_a_submodule_skips_no_training_step(tmp_path, accumulate):
    """The model's own forward never ran in validation, so nothing told its checks from the training
    step's: the next, healthy step was skipped (a raise watch stopped fit()), without a word (a probe,
    session 41). The submodules' records are now that evaluation's (NOTE: [Submodules called outside
    the model's forward])."""
    plain, module, w = fit_without_and_with_a_skip_watch(tmp_path, DirtyValidationThroughSubmodule,
                                                         accumulate_grad_batches=accumulate)
    assert w.skipped_steps == 0 and w.step_count == 6 and w.events
    assert all(e.evaluation and e.phase == "forward" and e.name == "net.0" for e in w.events)
    for (name, a), b in zip(module.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_loss_goes_to_watch_loss(tmp_path):
    class NaNLoss(Regression):
        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            return torch.nn.functional.mse_loss(out[:0], y[:0])  # a mean over nothing: NaN, zero gradients

    callback = NanfastCallback()
    with pytest.raises(nanfast.NonFiniteError) as caught:
        trainer(tmp_path, [callback]).fit(NaNLoss())
    event = caught.value.report
    assert (event.phase, event.name) == ("loss_value", "loss")


def test_submodule(tmp_path):
    # training_step may call a submodule rather than the LightningModule's forward: watch that one.
    module = Regression()
    plant_inf(module, LAYER, at_forward=2)
    callback = NanfastCallback(module="net", action="raise", nan_only=True)
    with pytest.raises(nanfast.NonFiniteError) as caught:
        trainer(tmp_path, [callback], steps=2).fit(module)
    assert callback.watch.model is module.net and callback.watch.nan_only
    event = caught.value.report
    # nan_only: net.2's infinities pass; tanh(+/-inf) is finite; the first NaN is 0 * inf in backward.
    assert (event.step, event.phase, event.name) == (1, "backward", "2")


def test_missing_lightning_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # import lightning.pytorch raises ImportError
    monkeypatch.delitem(sys.modules, "nanfast.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'nanfast\[lightning\]'"):
        importlib.import_module("nanfast.integrations.lightning")


def test_refused_options_leave_no_hook(tmp_path):
    module = Regression()
    t = trainer(tmp_path, [NanfastCallback(action="skip", sync="lagged")])  # lagged skip needs a fused optimizer
    with pytest.raises(ValueError, match="sync='lagged'"):
        t.fit(module)
    assert not t.optimizers[0]._optimizer_step_pre_hooks and hooks_of(module) == 0  # on_exception removed them


def test_a_second_fit_on_the_same_trainer_numbers_its_steps_as_the_trainer_does(tmp_path):
    """fit() again with more steps continues the trainer's global step; the watch counted from 0 again."""
    module = Regression()
    callback = NanfastCallback(action="raise")
    t = trainer(tmp_path, [callback], steps=3)
    t.fit(module)
    plant_inf(module, LAYER, at_forward=2)  # the second fit's second step: global step 4 (0-based)
    t.fit_loop.epoch_loop.max_steps = 6
    with pytest.raises(nanfast.NonFiniteError) as caught:
        t.fit(module)
    assert (caught.value.report.step, t.global_step) == (4, 4)
    callback.remove()


class ManualClosure(Regression):
    """Manual optimization stepping with a closure, as Lightning's docs show: `loss = opt.step(closure=...)`."""

    def __init__(self):
        super().__init__(optimizer="sgd")
        self.automatic_optimization = False
        self.returned = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()

        def closure():
            loss = torch.nn.functional.mse_loss(self(x), y)
            optimizer.zero_grad()
            self.manual_backward(loss)
            return loss

        self.returned.append(optimizer.step(closure=closure))


@pytest.mark.parametrize("action", ["raise", "skip"])
def test_a_manual_step_with_a_closure_still_returns_its_loss(tmp_path, action):
    """The callback ran the closure before the watch's step pre-hook and handed step() no closure, so
    `opt.step(closure=closure)` returned None instead of the loss (a probe, session 41)."""
    runs = []
    for callbacks in ([], [NanfastCallback(action=action)]):
        module = ManualClosure()
        trainer(tmp_path, callbacks, steps=3).fit(module)
        runs.append(module)
    plain, watched = runs
    assert all(isinstance(loss, torch.Tensor) for loss in watched.returned) and len(watched.returned) == 3
    assert [float(loss) for loss in watched.returned] == [float(loss) for loss in plain.returned]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), watched.parameters()))


class ManualSkipWatch(Regression):
    """Manual optimization with a skip watch made in the module (as with several optimizers, which the
    callback refuses): `opt.step()` hands the torch optimizer a closure that runs no forward."""

    def __init__(self, watched: bool):
        super().__init__(optimizer="sgd")
        self.automatic_optimization = False
        self.watched = watched
        self.events = None

    def on_train_start(self):
        self.w = nanfast.watch(self.net, self.trainer.optimizers[0], action="skip") if self.watched else None

    def on_train_end(self):
        if self.w is not None:
            self.events = [(e.step, e.phase) for e in self.w.events]
            self.w.remove()

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 2:
            if not self.watched:
                return  # the reference never sees the dirty batch
            x = x.clone()
            x[0, 0] = float("nan")
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(torch.nn.functional.mse_loss(self(x), y))
        optimizer.step()


def test_a_skip_watch_made_in_a_manually_optimized_module(tmp_path):
    """It refused every step with a ValueError about optimizer.step(closure) (a probe, session 47): the
    watch now runs a torch optimizer's closure ahead of its check, as the callback does."""
    modules = []
    for watched in (True, False):
        module = ManualSkipWatch(watched)
        with pytest.warns(RuntimeWarning, match="skipped the optimizer step") if watched else contextlib.nullcontext():
            trainer(tmp_path, [], steps=-1, max_epochs=1).fit(module)
        modules.append(module)
    watched, plain = modules
    assert watched.events == [(2, "input")]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), watched.parameters()))


class MaskedPolicy(Regression):
    """A policy over 4 actions whose forward masks the illegal ones' logits with -inf (a REINFORCE-style
    loss on fixed returns): healthy, whatever the watch sees in its output."""

    def __init__(self):
        super().__init__()
        self.net[-1] = torch.nn.Linear(16, 4)

    def forward(self, x):
        legal = torch.ones(x.shape[0], 4, dtype=torch.bool)
        legal[:, 1:3] = x[:, :2] > 0  # actions 1 and 2 legal only for some states
        return self.net(x).masked_fill(~legal, float("-inf"))

    def training_step(self, batch, batch_idx):
        x, returns = batch
        dist = torch.distributions.Categorical(logits=self(x))
        return -(dist.log_prob(torch.zeros(x.shape[0], dtype=torch.long)) * returns[:, 0]).mean()


def test_a_policy_that_masks_its_logits_with_minus_inf_trains_with_one_notice(tmp_path):
    """In the real Trainer (the callback gives the watch the loss): the -inf in the policy's output did
    no harm (finite loss and gradients), so no step is stopped or skipped, and the watch says so once
    (NOTE: [-inf that did no harm]); it stopped the first step before."""
    callback = NanfastCallback(action="skip")
    model = MaskedPolicy()
    with pytest.warns(RuntimeWarning, match=r"only -inf, in output of <model> \(MaskedPolicy\)"):
        trainer(tmp_path, [callback], steps=6).fit(model)
    watch = callback.watch
    assert watch.step_count == 6 and watch.skipped_steps == 0
    assert [(e.kind, e.step) for e in watch.events] == [("absorbed", 0)]
    assert all(torch.isfinite(p).all() for p in model.parameters())
