"""nanfast.integrations.transformers.NanfastCallback in the real HF Trainer: a tiny random-initialised
GPT-2 on CPU, a fault planted in one block's output at a chosen forward; raise and skip behave as in a
plain loop, gradient accumulation works, the statistics reach the logs; parameters made non-finite
between steps are rolled back (action="rollback") and stop a skip. Offline: nothing is downloaded
(the model is built from a config, no tokenizer), and the tests refuse any network connection."""

from __future__ import annotations

import importlib
import socket
import sys
import warnings

import huggingface_hub.constants

import pytest
import torch

import nanfast
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from nanfast.integrations.transformers import NanfastCallback
from training_state import FAULTS, break_parameters, equal, hooks_of, plant_inf, state_of

BLOCK = "transformer.h.1"
WEIGHT = "transformer.h.0.mlp.c_fc.weight"


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


def trainer(model, tmp_path, callbacks, steps: int = 5, accumulation: int = 1, data=None) -> Trainer:
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulation, learning_rate=1e-2, logging_steps=1,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    return Trainer(model=model, args=args, train_dataset=data or dataset(), callbacks=callbacks)


class Snapshot(TrainerCallback):
    """Copies the parameters and the optimizer state when each step begins (`began`) and right after
    its optimizer.step() (`stepped`: before the LR scheduler and zero_grad), by state.global_step."""

    def __init__(self):
        self.began, self.stepped = {}, {}

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.began[state.global_step] = state_of(model, optimizer)

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.stepped[state.global_step] = state_of(model, optimizer)

    def unchanged(self, step: int) -> bool:
        """Whether step `step`'s optimizer.step() left parameters and optimizer state bit-identical."""
        return equal(self.began[step], self.stepped[step])


class BreakParameters(TrainerCallback):
    """Makes the parameters non-finite before step `at` begins (break_parameters): "huge_lr" in step
    at-1's update (the Trainer's LR scheduler then puts the lr back), "nan_weight" after it."""

    def __init__(self, fault: str, at: int):
        self.fault, self.at = fault, at

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.fault == "huge_lr" and state.global_step == self.at - 1:
            break_parameters(self.fault, model, optimizer, WEIGHT)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.fault == "nan_weight" and state.global_step == self.at:  # step at-1 was counted
            break_parameters(self.fault, model, optimizer, WEIGHT)


class LogRecorder(TrainerCallback):
    """Listed before NanfastCallback: sees the logs as the reporters of report_to do."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_raise_names_the_block(tmp_path):
    model = tiny_gpt2()
    plant_inf(model, BLOCK, at_forward=3)
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
    plant_inf(model, BLOCK, at_forward=3)
    before = hooks_of(model)
    snapshot, recorder, callback = Snapshot(), LogRecorder(), NanfastCallback(action="skip", params_every=1)
    t = trainer(model, tmp_path, [recorder, snapshot, callback], steps=5)
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        t.train()
    # The Trainer clipped the NaN gradients (max_grad_norm=1) before optimizer.step(): all NaN; the
    # watch took them away, so neither the parameters nor AdamW's moments moved.
    assert snapshot.unchanged(2)
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
    # The skipped step did not step the LR scheduler: accelerate's optimizer says it was skipped, as after a
    # GradScaler's overflow (it did step before). The linear schedule's logged rates decrease but for one
    # repeat, at the bad step's log: transformers 5 logs the rate a step used (steps 3 and 4 equal), 4.46
    # the rate after the step's scheduler step (steps 2 and 3).
    rates = [steps[k]["learning_rate"] for k in sorted(steps)]
    repeats = [k for k, (a, b) in enumerate(zip(rates, rates[1:]), 1) if a == b]
    assert all(a >= b for a, b in zip(rates, rates[1:])) and repeats in ([2], [3]), rates
    # A callback before this one (where the Trainer puts report_to's reporters) saw the statistics.
    seen = [logs for logs in recorder.logs if "loss" in logs]
    assert len(seen) == 5 and all("nanfast/grad_norm" in logs for logs in seen)
    assert seen[2]["nanfast/posinf"] > 0


def test_without_skip_the_clipped_nan_reaches_every_parameter(tmp_path):
    # Why skip matters in HF's Trainer: max_grad_norm clipping makes every gradient NaN, and AdamW then
    # every parameter; the next step begins with non-finite parameters, which no skip can undo.
    model = tiny_gpt2()
    plant_inf(model, BLOCK, at_forward=3)
    callback = NanfastCallback(action="warn")
    with pytest.warns(RuntimeWarning, match=BLOCK):
        trainer(model, tmp_path, [callback], steps=4).train()
    assert not any(torch.isfinite(p).any() for p in model.parameters())
    assert [(e.step, e.phase) for e in callback.watch.events] == [(2, "forward"), (3, "param")]


def test_gradient_accumulation(tmp_path):
    model = tiny_gpt2()
    plant_inf(model, BLOCK, at_forward=4)  # the second microbatch of the second step
    snapshot, callback = Snapshot(), NanfastCallback(action="skip")
    t = trainer(model, tmp_path, [snapshot, callback], steps=3, accumulation=2)
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        t.train()
    event = callback.watch.events[0]
    assert (event.step, event.name, event.first.microbatch) == (1, BLOCK, 1)
    assert snapshot.unchanged(1)
    assert t.state.global_step == 3 and callback.watch.step_count == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("every, restored", [(1, 3), (2, 2)])
@pytest.mark.parametrize("fault", FAULTS)
def test_rollback_puts_back_the_last_snapshot(tmp_path, fault, every, restored):
    # Step 4 begins with non-finite parameters (NaN written into a weight after step 3, or step 3 applied
    # with lr=inf), which no skip can repair. The watch puts back the state its last snapshot holds: the
    # one step `restored` began with (rollback_every=1: step 3; 2: snapshots at steps 0 and 2).
    model = tiny_gpt2()
    snapshot, callback = Snapshot(), NanfastCallback(action="rollback", rollback_every=every)
    t = trainer(model, tmp_path, [snapshot, BreakParameters(fault, at=4), callback], steps=6)
    with pytest.warns(RuntimeWarning, match=f"rolled back to the state step {restored} began with"):
        t.train()
    w = callback.watch
    assert (w.rolled_back_steps, w.skipped_steps, w.last_rollback) == (1, 0, (4, restored))
    assert [(e.step, e.phase) for e in w.events] == [(4, "param")]
    assert fault != "nan_weight" or w.events[0].name == WEIGHT
    # Right after step 4's optimizer.step(): parameters and AdamW's state as step `restored` began, bit for bit.
    assert equal(snapshot.stepped[4], snapshot.began[restored])
    assert t.state.global_step == 6
    assert all(torch.isfinite(p).all() for p in model.parameters())
    steps = {h["step"]: h for h in t.state.log_history if "loss" in h}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    bad = steps[5]  # global_step 5 logs the step counted 4 by the watch
    assert bad["nanfast/nan"] + bad["nanfast/posinf"] + bad["nanfast/neginf"] > 0
    assert (bad["nanfast/rolled_back_steps"], bad["nanfast/skipped_steps"], bad["nanfast/events"]) == (1, 0, 1)
    assert steps[4]["nanfast/rolled_back_steps"] == 0 and steps[4]["nanfast/nan"] == 0
    # Step 5 began with the restored parameters: the norm that step `restored` read.
    assert steps[6]["nanfast/param_norm"] == steps[restored + 1]["nanfast/param_norm"]


@pytest.mark.parametrize("fault", FAULTS)
def test_skip_cannot_repair_nonfinite_parameters(tmp_path, fault):
    model = tiny_gpt2()
    callback = NanfastCallback(action="skip")
    t = trainer(model, tmp_path, [BreakParameters(fault, at=4), callback], steps=6)
    with pytest.raises(nanfast.NonFiniteError, match="cannot be skipped once the parameters are non-finite") as caught:
        t.train()
    assert (caught.value.report.step, caught.value.report.phase) == (4, "param")
    assert t.state.global_step == 4 and callback.watch.skipped_steps == 0
    callback.remove()


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
    # First seen in the model's output, a ModelOutput: named by its field (NOTE: [Naming the output's fields]).
    first = caught.value.report.first
    assert (first.phase, first.name, [e.name for e in first.entries]) == ("forward", "", ["loss"])
    assert "output of <model> (GPT2LMHeadModel): loss (nan=1" in caught.value.report.summary()
    callback.remove()


class _Wrapped(torch.nn.Module):
    """GPT-2 held by a module of one's own (as a PEFT model or a LightningModule holds it)."""

    def __init__(self):
        super().__init__()
        self.model = tiny_gpt2()

    def forward(self, **batch):
        return self.model(**batch)


def test_a_wrapped_models_loss_is_named_in_its_output():
    """Every label ignored: the NaN loss first appears in the GPT-2 submodule's output, a ModelOutput:
    named by its field there too (NOTE: [Naming the output's fields])."""
    wrapped = _Wrapped()
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (2, 8))
    with nanfast.watch(wrapped, optimizer) as w:
        wrapped(input_ids=ids, labels=torch.full_like(ids, -100)).loss.backward()
        with pytest.raises(nanfast.NonFiniteError) as caught:
            optimizer.step()
    first = caught.value.report.first
    assert (first.phase, first.name, [e.name for e in first.entries]) == ("forward", "model", ["loss"])
    assert "output of model (GPT2LMHeadModel): loss (nan=1" in caught.value.report.summary()
    assert w.events[0] is caught.value.report


def test_options_pass_through(tmp_path):
    model = tiny_gpt2()
    plant_inf(model, BLOCK, at_forward=2)
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


def test_an_evaluation_whose_labels_are_all_masked_skips_no_training_step(tmp_path):
    """The Trainer evaluates between optimizer steps (eval_strategy="steps"). An evaluation batch whose
    labels are all -100 makes the model's loss a mean over nothing: NaN (a known HF pitfall). That is the
    evaluation forward's own event, not the next training step's, which a skip watch used to skip though
    it was healthy."""
    model = tiny_gpt2()
    callback = NanfastCallback(action="skip")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=2, learning_rate=1e-2,
                             logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                             seed=0)
    t = Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset(4, labels=False),
                callbacks=[callback])
    with pytest.warns(RuntimeWarning, match="an evaluation forward, so no optimizer step to skip"):
        t.train()
    w = callback.watch
    assert t.state.global_step == 5 and w.skipped_steps == 0
    assert w.events and all(e.evaluation and e.phase == "forward" for e in w.events)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_resumed_run_numbers_its_steps_as_the_trainer_does(tmp_path):
    """A run resumed from checkpoint-2 reported its third step as step 1 (the watch counted from 0 at
    each train()); it starts at the trainer's global step."""
    args = dict(per_device_train_batch_size=2, learning_rate=1e-2, report_to="none", use_cpu=True,
                disable_tqdm=True, seed=0, save_strategy="steps", save_steps=2)
    Trainer(model=tiny_gpt2(), args=TrainingArguments(output_dir=str(tmp_path), max_steps=2, **args),
            train_dataset=dataset()).train()
    # transformers 4.46 (the extra's floor) reads the RNG states with torch.load's default, which torch >= 2.6
    # refuses for their numpy part; they play no part here (the Trainer goes on without them, warning).
    (tmp_path / "checkpoint-2" / "rng_state.pth").unlink()
    model = tiny_gpt2()
    plant_inf(model, BLOCK, at_forward=2)  # the resumed run's second step: global step 3 (0-based)
    callback = NanfastCallback(action="raise")
    t = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), max_steps=5, **args),
                train_dataset=dataset(), callbacks=[callback])
    with pytest.raises(nanfast.NonFiniteError) as caught:
        t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert (caught.value.report.step, t.state.global_step) == (3, 3)
    assert "step 3" in str(caught.value)
    callback.remove()


def test_a_hand_written_accelerate_loop_watches_the_prepared_optimizer():
    """nanfast.watch(model, accelerator-prepared optimizer) raised AttributeError (accelerate's
    AcceleratedOptimizer never runs Optimizer.__init__) and left its model hooks on; the watch takes the
    torch optimizer it wraps, as the Trainer's callback does."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model, optimizer = accelerator.prepare(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1)))(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))))
    w = nanfast.watch(model, optimizer, action="skip")
    assert w.optimizer is optimizer.optimizer
    x = torch.randn(6, 4)
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        loss = model(x).pow(2).mean() * (float("nan") if step == 1 else 1.0)
        accelerator.backward(loss)
        if step == 1:
            with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
                optimizer.step()
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        else:
            optimizer.step()
    assert [e.step for e in w.events] == [1] and w.skipped_steps == 1
    w.remove()


def test_a_skip_in_an_accelerate_loop_leaves_the_prepared_lr_scheduler_as_it_was():
    """accelerate's AcceleratedScheduler steps only after an optimizer step that was not skipped; a skip of
    the watch's went unseen there, so the schedule ran a step ahead of a run that never saw the batch
    (StepLR halved the learning rate a step early, and every later update differed)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)

    def run(bad_step):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model, optimizer, scheduler = accelerator.prepare(
            model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
        w = nanfast.watch(model, optimizer, action="skip") if bad_step is not None else None
        for step in range(4):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            if step == bad_step:
                x[0, 0] = float("nan")
            elif bad_step is None and step == 1:
                continue  # the reference never sees the bad batch
            optimizer.zero_grad()
            accelerator.backward(model(x).pow(2).mean())
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the skip's
                optimizer.step()
            scheduler.step()
        if w is not None:
            assert w.skipped_steps == 1
            w.remove()
        return model, optimizer, scheduler

    (model, optimizer, scheduler), (reference, ref_optimizer, ref_scheduler) = run(bad_step=1), run(bad_step=None)
    assert scheduler.scheduler.state_dict() == ref_scheduler.scheduler.state_dict()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    for p, q in zip(optimizer.optimizer.state.values(), ref_optimizer.optimizer.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in p)


@pytest.mark.parametrize("with_scaler", [False, True])
def test_accelerates_optimizer_says_which_step_a_skip_left_unapplied(with_scaler):
    """With a GradScaler accelerate sets step_was_skipped after the step from whether the optimizer's step
    ran; the NaN is off the loss here, so the scaler steps and only the watch skips."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # its state, which AcceleratedOptimizer reads

    class SideOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.main, self.side = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

        def forward(self, x, bad):
            return self.main(x), self.side(x) * (float("nan") if bad else 1.0)

    model = SideOutput()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if with_scaler else None
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    w = nanfast.watch(model, optimizer, action="skip", scaler=scaler)
    said = []
    for step in range(3):
        optimizer.zero_grad()
        loss = model(torch.randn(3, 4), bad=step == 1)[0].pow(2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the skip's
            optimizer.step()
        said.append(optimizer.step_was_skipped)
    assert said == [False, True, False] and (w.skipped_steps, w.scaler_skipped_steps) == (1, 0)
    # A skip on the last step a watch sees: removed, it clears the flag, which accelerate without a
    # scaler never does (its scheduler would never step again).
    optimizer.zero_grad()
    model(torch.randn(3, 4), bad=True)[0].pow(2).mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        optimizer.step()
    assert optimizer.step_was_skipped
    w.remove()
    assert not optimizer.step_was_skipped


def test_the_statistics_go_to_training_logs_only(tmp_path):
    """Added once per step to whichever log came first at it: with evaluations every 2 steps and logs
    every 3, the evaluation entries of steps 2 and 4 and the end-of-training summary got them, as
    docs/integrations.md says they do not."""
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, logging_steps=3, eval_strategy="steps", eval_steps=2,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    t = Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset(), eval_dataset=dataset(4),
                callbacks=[NanfastCallback()])
    t.train()
    kinds = [("eval" if "eval_loss" in h else "train" if "loss" in h else "summary", h["step"],
              any(k.startswith("nanfast/") for k in h)) for h in t.state.log_history]
    # (transformers 5 evaluates at the last step too, 4.46 does not)
    assert [k for k in kinds if k[2]] == [("train", 3, True)], kinds
    assert ("eval", 2, False) in kinds and ("eval", 4, False) in kinds and ("summary", 5, False) in kinds, kinds
