"""nanfast.integrations.lightning.NanfastCallback in the real Lightning Trainer: a small LightningModule
on CPU, a fault planted in one layer's output at a chosen forward; raise and skip behave as in a plain
loop (Lightning steps the optimizer with a closure), gradient accumulation works, the statistics reach
a real logger (CSVLogger's metrics file)."""

from __future__ import annotations

import csv
import importlib
import sys

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger

import nanfast
from nanfast.integrations.lightning import NanfastCallback
from training_state import clone, equal, hooks_of

LAYER = "net.2"


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


def plant_inf(module: LightningModule, at_forward: int) -> None:
    """Multiplies LAYER's output by inf in the `at_forward`-th training forward (1-based, counting
    microbatches)."""
    seen = {"forwards": 0}

    def hook(mod, args, output):
        if mod.training and torch.is_grad_enabled():
            seen["forwards"] += 1
            if seen["forwards"] == at_forward:
                return output * float("inf")

    module.get_submodule(LAYER).register_forward_hook(hook)


def trainer(tmp_path, callbacks, steps: int = 5, **kwargs) -> Trainer:
    return Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=CSVLogger(str(tmp_path), name="run"),
                   callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, log_every_n_steps=1, **kwargs)


class Snapshot(Callback):
    """Copies the parameters and optimizer state in on_before_optimizer_step of the `step`-th optimizer
    step (after its backward, before its update) and compares them at the end of that batch."""

    def __init__(self, step: int):
        self.step = step
        self.before = None
        self.unchanged = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            self.before = (clone(pl_module.state_dict()), clone(optimizer.state_dict()["state"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.before is not None and self.unchanged is None:
            self.unchanged = (equal(self.before[0], pl_module.state_dict())
                              and equal(self.before[1], trainer.optimizers[0].state_dict()["state"]))


def logged(trainer: Trainer) -> list[dict]:
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def test_raise_names_the_layer(tmp_path):
    module = Regression()
    plant_inf(module, at_forward=3)
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
    plant_inf(module, at_forward=3)
    before = hooks_of(module)
    snapshot, callback = Snapshot(step=2), NanfastCallback(action="skip")
    t = trainer(tmp_path, [snapshot, callback], gradient_clip_val=1.0)
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        t.fit(module)
    # Lightning clipped the NaN gradients (all NaN then); the watch took them away before the update.
    assert snapshot.unchanged is True
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
    plant_inf(module, at_forward=4)  # the second microbatch of the second step
    snapshot, callback = Snapshot(step=1), NanfastCallback(action="skip")
    t = trainer(tmp_path, [snapshot, callback], steps=3, accumulate_grad_batches=2)
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        t.fit(module)
    event = callback.watch.events[0]
    assert (event.step, event.name, event.first.microbatch) == (1, LAYER, 1)
    assert snapshot.unchanged is True
    assert t.global_step == 3 and callback.watch.step_count == 3
    assert len([r for r in logged(t) if "nanfast/grad_norm" in r]) == 3  # once per optimizer step


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
    plant_inf(module, at_forward=3)
    callback = NanfastCallback(action="skip")
    t = trainer(tmp_path, [callback], steps=6, val_check_interval=2, limit_val_batches=2, precision="bf16-mixed")
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        t.fit(module)
    assert t.global_step == 6 and callback.watch.skipped_steps == 1 and len(callback.watch.events) == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert any("val_loss" in r for r in logged(t))


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
    plant_inf(module, at_forward=2)
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
