"""nanfast.integrations.transformers.NanfastCallback in the real HF Trainer: a tiny random-initialised
GPT-2 on CPU, a fault planted in one block's output at a chosen forward; raise and skip behave as in a
plain loop, gradient accumulation works, the statistics reach the logs. Offline: nothing is downloaded
(the model is built from a config, no tokenizer), and the tests refuse any network connection."""

from __future__ import annotations

import importlib
import socket
import sys

import huggingface_hub.constants
import pytest
import torch

import nanfast
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from nanfast.integrations.transformers import NanfastCallback
from training_state import clone, equal, hooks_of

BLOCK = "transformer.h.1"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """HF_HUB_OFFLINE, and no socket may connect: another module may have imported huggingface_hub
    (lightning does) before this one could set the variable, so the constant is patched too."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise OSError("test_integrations_transformers: no network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def dataset(n: int = 24, labels: bool = True) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 100, (8,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone() if labels else torch.full_like(ids, -100)})
    return rows


def plant_inf(model: torch.nn.Module, at_forward: int) -> dict:
    """Multiplies block 1's output by inf in the `at_forward`-th training forward (1-based, counting
    microbatches): finite values become +/-inf there, and NaN downstream."""
    seen = {"forwards": 0}

    def hook(module, args, output):
        if module.training and torch.is_grad_enabled():
            seen["forwards"] += 1
            if seen["forwards"] == at_forward:
                return output * float("inf")

    model.get_submodule(BLOCK).register_forward_hook(hook)
    return seen


def trainer(model, tmp_path, callbacks, steps: int = 5, accumulation: int = 1, data=None) -> Trainer:
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulation, learning_rate=1e-2, logging_steps=1,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    return Trainer(model=model, args=args, train_dataset=data or dataset(), callbacks=callbacks)


class Snapshot(TrainerCallback):
    """Copies the parameters and the optimizer state when `step` begins, and compares them right after
    its optimizer.step() (before the LR scheduler and zero_grad)."""

    def __init__(self, step: int):
        self.step = step
        self.before = None
        self.unchanged = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.step:
            self.before = (clone(model.state_dict()), clone(optimizer.state_dict()["state"]))

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.step:
            self.unchanged = (equal(self.before[0], model.state_dict())
                              and equal(self.before[1], optimizer.state_dict()["state"]))


class LogRecorder(TrainerCallback):
    """Listed before NanfastCallback: sees the logs as the reporters of report_to do."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_raise_names_the_block(tmp_path):
    model = tiny_gpt2()
    plant_inf(model, at_forward=3)
    before = hooks_of(model)
    callback = NanfastCallback(action="raise")
    t = trainer(model, tmp_path, [callback])
    with pytest.raises(nanfast.NonFiniteError) as caught:
        t.train()
    event = caught.value.report
    assert (event.step, event.phase, event.name, event.module_class) == (2, "forward", BLOCK, "GPT2Block")
    assert BLOCK in str(caught.value)
    assert t.state.global_step == 2  # steps 0 and 1 applied, step 2 stopped before its update
    assert all(torch.isfinite(p).all() for p in model.parameters())
    callback.remove()  # no on_train_end after a raise
    assert hooks_of(model) == before


def test_skip_leaves_the_step_unapplied_and_logs(tmp_path):
    model = tiny_gpt2()
    plant_inf(model, at_forward=3)
    before = hooks_of(model)
    snapshot, recorder, callback = Snapshot(step=2), LogRecorder(), NanfastCallback(action="skip")
    t = trainer(model, tmp_path, [recorder, snapshot, callback], steps=5)
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        t.train()
    # The Trainer clipped the NaN gradients (max_grad_norm=1) before optimizer.step(): all NaN; the
    # watch took them away, so neither the parameters nor AdamW's moments moved.
    assert snapshot.unchanged is True
    assert t.state.global_step == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert callback.watch.skipped_steps == 1 and callback.watch.events[0].name == BLOCK
    assert hooks_of(model) == before  # removed at on_train_end
    steps = {h["step"]: h for h in t.state.log_history if "loss" in h}
    assert sorted(steps) == [1, 2, 3, 4, 5]
    bad = steps[3]  # global_step 3 logs the step counted 2 by the watch
    assert bad["nanfast/posinf"] > 0 and bad["nanfast/nan"] > 0 and bad["nanfast/skipped_steps"] == 1
    assert steps[2]["nanfast/posinf"] == 0 and steps[2]["nanfast/skipped_steps"] == 0
    assert steps[4]["nanfast/param_norm"] == bad["nanfast/param_norm"] > 0  # the skipped step moved nothing
    assert steps[3]["learning_rate"] < steps[2]["learning_rate"]  # the LR scheduler still stepped
    # A callback before this one (where the Trainer puts report_to's reporters) saw the statistics.
    seen = [logs for logs in recorder.logs if "loss" in logs]
    assert len(seen) == 5 and all("nanfast/grad_norm" in logs for logs in seen)
    assert seen[2]["nanfast/posinf"] > 0


def test_without_skip_the_clipped_nan_reaches_every_parameter(tmp_path):
    # Why skip matters in HF's Trainer: max_grad_norm clipping makes every gradient NaN, and AdamW then
    # every parameter; the next step begins with non-finite parameters, which no skip can undo.
    model = tiny_gpt2()
    plant_inf(model, at_forward=3)
    callback = NanfastCallback(action="warn")
    with pytest.warns(RuntimeWarning, match=BLOCK):
        trainer(model, tmp_path, [callback], steps=4).train()
    assert not any(torch.isfinite(p).any() for p in model.parameters())
    assert [(e.step, e.phase) for e in callback.watch.events] == [(2, "forward"), (3, "param")]


def test_gradient_accumulation(tmp_path):
    model = tiny_gpt2()
    plant_inf(model, at_forward=4)  # the second microbatch of the second step
    snapshot, callback = Snapshot(step=1), NanfastCallback(action="skip")
    t = trainer(model, tmp_path, [snapshot, callback], steps=3, accumulation=2)
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        t.train()
    event = callback.watch.events[0]
    assert (event.step, event.name, event.first.microbatch) == (1, BLOCK, 1)
    assert snapshot.unchanged is True
    assert t.state.global_step == 3 and callback.watch.step_count == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_models_loss_goes_to_watch_loss(tmp_path):
    # Every label ignored: GPT-2's loss is a mean over no tokens, NaN (the case of docs/watch.md's
    # NOTE: [The loss value]); the callback gives the model's output loss to w.loss.
    model = tiny_gpt2()
    callback = NanfastCallback()
    t = trainer(model, tmp_path, [callback], steps=2, data=dataset(labels=False))
    with pytest.raises(nanfast.NonFiniteError) as caught:
        t.train()
    places = caught.value.report.places
    assert any(p.phase == "loss_value" and p.name == "loss" and p.nan > 0 for p in places)
    callback.remove()


def test_options_pass_through(tmp_path):
    model = tiny_gpt2()
    plant_inf(model, at_forward=2)
    callback = NanfastCallback(action="skip", ignore=["transformer.h.*"], nan_only=True, every=2)
    t = trainer(model, tmp_path, [callback], steps=2)
    t.train()  # every=2: step 1, the bad one, is not checked
    assert callback.watch.every == 2 and callback.watch.ignore == ("transformer.h.*",) and callback.watch.nan_only
    assert callback.watch.events == []


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    monkeypatch.delitem(sys.modules, "nanfast.integrations.transformers")
    with pytest.raises(ImportError, match=r"pip install 'nanfast\[transformers\]'"):
        importlib.import_module("nanfast.integrations.transformers")
