"""Infinities stored on purpose are listed apart, not called faults (nanfast/intended.py). Additive
attention masks (0 where attended, -inf where masked; NOTE: [Additive masks]): in the watch's input
(PyTorch's own translation tutorial passes one to the model's forward: pytorch/tutorials,
beginner_source/translation_transformer.py), in check_all (a GPT-style causal-mask buffer), in
check_batch and checked(), and in the scans; a NaN or +inf in a mask, an -inf anywhere else, and a
mask's gradient are still reported. Score sentinels (NOTE: [Sentinel infinities]): torch's
ReduceLROnPlateau keeps `best` and `mode_worse` at +-inf in its state_dict, training scripts start
`best_loss = float("inf")`; an infinite learning rate or loss scale is still a fault. And a model whose
own output is -inf on purpose (masked logits) is ignored under the name events give it."""

from __future__ import annotations

import warnings

import pytest
import torch

import nanfast
from nanfast import scan
from nanfast.cli import main
from nanfast.intended import is_additive_mask, is_mask_name, is_sentinel
from op_recorder import OpRecorder

NAN, INF = float("nan"), float("inf")

# The tutorial passes a bool key padding mask with a float attention mask, which torch warns about.
# Each test runs with the watch's recorder keeping its counts on the host and as tensors, as on a GPU.
pytestmark = [pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning"),
              pytest.mark.usefixtures("recorder_counts")]
VOCAB, D, SEQ = 20, 16, 6


class Seq2Seq(torch.nn.Module):
    """The translation tutorial's model, small: its forward takes the masks the training loop makes."""

    def __init__(self):
        super().__init__()
        self.src_embed = torch.nn.Embedding(VOCAB, D)
        self.tgt_embed = torch.nn.Embedding(VOCAB, D)
        self.transformer = torch.nn.Transformer(D, 2, 1, 1, 32, dropout=0.0)
        self.generator = torch.nn.Linear(D, VOCAB)

    def forward(self, src, tgt, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, memory_key_padding_mask):
        out = self.transformer(self.src_embed(src), self.tgt_embed(tgt), src_mask, tgt_mask, None,
                               src_padding_mask, tgt_padding_mask, memory_key_padding_mask)
        return self.generator(out)


def _masks(src, tgt_input):
    """What the tutorial's create_mask gives: a float causal mask for the target, the others bool."""
    tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(tgt_input.shape[0])
    src_mask = torch.zeros(src.shape[0], src.shape[0], dtype=torch.bool)
    return src_mask, tgt_mask, (src == 0).T, (tgt_input == 0).T


def _train(model, steps, change=None, **options):
    """The tutorial's training loop (sequence-first batches) under a watch; `change(step, tgt_mask)` may
    return another mask for that step. Returns the watch."""
    g = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanfast.watch(model, optimizer, **options) as w:
        for step in range(steps):
            src = torch.randint(1, VOCAB, (SEQ, 4), generator=g)
            tgt = torch.randint(1, VOCAB, (SEQ + 1, 4), generator=g)
            tgt_input = tgt[:-1]
            src_mask, tgt_mask, src_pad, tgt_pad = _masks(src, tgt_input)
            if change is not None:
                tgt_mask = change(step, tgt_mask)
            logits = model(src, tgt_input, src_mask, tgt_mask, src_pad, tgt_pad, src_pad)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tgt[1:].reshape(-1))
            loss.backward()
            optimizer.step()
    return w


def test_mask_names():
    for name in ("mask", "tgt_mask", "attention_mask", "model.mask", "batch.src_key_padding_mask", "masks.tgt_mask[0]",
                 "Attn_Mask", "attention_mask.1", "attention_mask (#2)"):
        assert is_mask_name(name), name
    for name in ("masks", "mask_weight", "x", "masked_scores", "mask.bias", "masks.0", "mask.x1"):
        assert not is_mask_name(name), name
    assert is_additive_mask("tgt_mask", 0, 0, 3)
    assert not is_additive_mask("tgt_mask", 1, 0, 3) and not is_additive_mask("tgt_mask", 0, 1, 3)
    assert not is_additive_mask("features", 0, 0, 3)
    for name in ("best", "best_loss", "scheduler.best", "callbacks.EarlyStopping{'monitor': 'val'}.best_score",
                 "current_best", "mode_worse", "kth_value", "worst_score", "state.best_val[0]", "best_val.0"):
        assert is_sentinel(name, 1, 0, 1, 0) and is_sentinel(name, 1, 0, 0, 1), name
    assert not is_sentinel("best", 1, 1, 0, 0) and not is_sentinel("best", 2, 0, 2, 0)
    for name in ("lr", "scale", "weight", "bestow.weight", "is_best_epoch"):
        assert not is_sentinel(name, 1, 0, 1, 0), name
    assert is_sentinel("fc.activation_post_process.min_val", 1, 0, 1, 0)  # an empty running minimum
    assert is_sentinel("fc.activation_post_process.max_val", 1, 0, 0, 1)
    assert not is_sentinel("fc.activation_post_process.min_val", 1, 0, 0, 1)  # a minimum that saw -inf
    assert not is_sentinel("fc.activation_post_process.max_val", 1, 0, 1, 0)


@pytest.mark.parametrize("options", [{}, {"fuse": True}, {"sync": "lagged"}], ids=["eager", "fused", "lagged"])
def test_the_translation_tutorials_loop_trains_without_an_event(options):
    w = _train(Seq2Seq(), 3, **options)
    assert w.step_count == 3 and not w.events


@pytest.mark.parametrize("fuse", [False, True], ids=["default", "fused"])
@pytest.mark.parametrize("value,counts", [(NAN, (1, 0, 0)), (INF, (0, 1, 0))], ids=["nan", "posinf"])
def test_a_nan_or_posinf_in_the_mask_is_still_the_dirty_input(value, counts, fuse):
    def spoil(step, mask):
        if step == 1:
            mask = mask.clone()
            mask[0, 0] = value
        return mask

    with pytest.warns(RuntimeWarning, match="is dirty"):
        w = _train(Seq2Seq(), 2, spoil, action="warn", fuse=fuse)  # the last step: the NaN it spreads is not read
    (event,) = w.events
    assert event.step == 1 and event.first.phase == "input"
    (entry,) = event.first.entries
    assert entry.name == "tgt_mask" and (entry.nan, entry.posinf, entry.neginf) == counts  # its -inf not counted


def test_a_fused_step_leaves_a_masks_minus_inf_uncounted_without_a_launch_of_its_own():
    """The -inf of an input's mask rows were zeroed out of its counts by a zero_ per mask row: with a GPU's
    bookkeeping, a launch per step for the tutorial's tgt_mask. They are cells the summary leaves out as
    it sums (NOTE: [Cells a record does not count]): no op of their own; still no event."""
    model = Seq2Seq()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with nanfast.watch(model, optimizer, fuse=True) as w:
        for _ in range(3):
            src = torch.randint(1, VOCAB, (SEQ, 4), generator=g)
            tgt = torch.randint(1, VOCAB, (SEQ + 1, 4), generator=g)
            src_mask, tgt_mask, src_pad, tgt_pad = _masks(src, tgt[:-1])
            logits = model(src, tgt[:-1], src_mask, tgt_mask, src_pad, tgt_pad, src_pad)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tgt[1:].reshape(-1)).backward()
            with OpRecorder() as ops:
                optimizer.step()  # the step's end: the flush
            assert "aten.zero_.default" not in ops.counts  # (Adam's own step makes none)
    assert w.step_count == 3 and not w.events


def test_an_neginf_in_an_input_not_named_as_a_mask_is_reported():
    class Scores(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, features, bias):
            return self.lin(features) + bias

    model = Scores()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    bias = torch.nn.Transformer.generate_square_subsequent_mask(2)[:1].expand(3, 2)  # -inf, but not named a mask
    with pytest.raises(nanfast.NonFiniteError, match=r"the input batch is dirty: bias \(nan=0, \+inf=0, -inf=3\)"):
        with nanfast.watch(model, optimizer):
            model(torch.randn(3, 4), bias).sum().backward()
            optimizer.step()


def test_a_mask_given_by_keyword_is_a_mask_too():
    class Keyword(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, **kwargs):
            return self.attn(x, x, x, attn_mask=kwargs["attn_mask"], need_weights=False)[0]

    model = Keyword()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
    with nanfast.watch(model, optimizer) as w:
        for _ in range(2):
            model(torch.randn(2, 5, 8), attn_mask=mask).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert w.step_count == 2 and not w.events


class CausalLM(torch.nn.Module):
    """A GPT-style model that keeps its causal mask as a buffer, as many do."""

    def __init__(self, T=8):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        layer = torch.nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = torch.nn.Linear(D, VOCAB)
        self.register_buffer("mask", torch.triu(torch.full((T, T), -INF), 1))

    def forward(self, ids):
        n = ids.shape[1]
        return self.head(self.body(self.embed(ids), mask=self.mask[:n, :n], is_causal=True))


def test_check_all_lists_a_causal_mask_buffer_apart():
    model = CausalLM()
    report = nanfast.check_all(model)  # raises on anything bad
    assert report.ok and [e.name for e in report.masks] == ["mask"] and report.bad == []
    assert "15 of 16 tensors are finite (2,948 elements); left out, as additive masks (-inf where they mask): " \
           "mask (-inf=28)" == report.summary()
    assert report.to_dict()["masks"][0]["neginf"] == 28
    model.mask[0, 0] = NAN
    with pytest.raises(nanfast.NonFiniteError, match=r"mask \[8, 8\] \(nan=1, \+inf=0, -inf=28\)"):
        nanfast.check_all(model)


def test_a_gradient_is_never_a_mask():
    holder = torch.nn.Module()
    holder.mask = torch.nn.Parameter(torch.zeros(3))
    holder.mask.grad = torch.tensor([0.0, -INF, 0.0])
    report = nanfast.check_all(holder, grads=True, raise_on_nonfinite=False)
    assert not report.ok and [e.name for e in report.bad] == ["mask"] and report.masks == []


def test_a_list_of_masks_is_left_out_by_check_all_as_by_check_batch():
    """check_all names a list's positions ".0", check_batch "[0]": a list of per-layer additive masks was
    left out by check_batch and called non-finite by check_all (a probe, session 49). Entries of one
    name, numbered by check_all, are masks too."""
    mask = torch.tensor([0.0, float("-inf")])
    batch = {"attention_mask": [mask, mask.clone()], "x": torch.ones(2)}
    report = nanfast.check_all(batch)  # raises on a fault
    assert [e.name for e in report.masks] == ["attention_mask.0", "attention_mask.1"] and report.ok
    assert [f.path for f in nanfast.check_batch(batch).masks] == ["attention_mask[0]", "attention_mask[1]"]
    twice = nanfast.check_all([("attention_mask", mask), ("attention_mask", mask.clone())])
    assert [e.name for e in twice.masks] == ["attention_mask", "attention_mask (#2)"] and twice.ok
    nan_mask = {"attention_mask": [mask, torch.tensor([float("nan"), 0.0])]}  # a NaN in one is still bad
    assert [e.name for e in nanfast.check_all(nan_mask, raise_on_nonfinite=False).bad] == ["attention_mask.1"]


def test_check_batch_and_checked_keep_a_batch_with_a_mask():
    mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
    batches = [{"x": torch.randn(2, 4), "tgt_mask": mask} for _ in range(3)]
    report = nanfast.check_batch(batches[0])
    assert report.ok and [f.path for f in report.masks] == ["tgt_mask"]
    assert report.summary() == "nanfast: 1 of the batch's 2 tensors are finite; left out, as additive masks (-inf " \
                               "where they mask): field 'tgt_mask' (-inf=6)"
    assert len(list(nanfast.checked(batches, action="skip"))) == 3
    dirty = {"x": torch.tensor([[0.0, -INF]]), "tgt_mask": mask}
    report = nanfast.check_batch(dirty, raise_on_nonfinite=False)
    assert [f.path for f in report.bad] == ["x"] and report.samples == [0]
    assert "; left out, as additive masks (-inf where they mask): field 'tgt_mask' (-inf=6)" in report.summary()


def test_scans_of_checkpoints_holding_a_mask_buffer_are_clean(capsys, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    model = CausalLM()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, VOCAB, (2, 8))).sum().backward()
    optimizer.step()
    pt, st = tmp_path / "model.pt", tmp_path / "model.safetensors"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, pt)
    safetensors.save_file(model.state_dict(), str(st))
    for path, name in ((pt, "model.mask"), (st, "mask")):
        result = scan.scan_file(str(path))
        assert result.status == "clean" and [e.name for e in result.report.masks] == [name]
        assert main(["scan", str(path)]) == 0
        assert f": clean; left out, as additive masks (-inf where they mask): {name} (-inf=28)" in capsys.readouterr().out
    state = model.state_dict()
    state["mask"][1, 0] = INF
    torch.save(state, pt)
    result = scan.scan_file(str(pt))
    assert result.status == "nonfinite" and [e.name for e in result.report.bad] == ["mask"]


class MaskedPolicy(torch.nn.Module):
    """Invalid-action masking: the logits of actions not allowed are -inf, which Categorical handles."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 5)

    def forward(self, obs, legal):
        return self.head(self.body(obs)).masked_fill(~legal, -INF)


def _policy_steps(given_loss=True, steps=3, spike_at=None, masked=True, **options):
    policy = MaskedPolicy()
    optimizer = torch.optim.Adam(policy.parameters())
    g = torch.Generator().manual_seed(0)
    with nanfast.watch(policy, optimizer, **options) as w:
        for step in range(steps):
            legal = torch.rand(8, 5, generator=g) > 0.3
            legal[:, 0 if masked else slice(None)] = True
            dist = torch.distributions.Categorical(logits=policy(torch.randn(8, 4, generator=g), legal))
            loss = -dist.log_prob(dist.sample()).mean() - 0.01 * dist.entropy().mean()
            if step == spike_at:
                loss = loss + 1e4 * loss.detach().abs()  # the value spikes, its gradients do not
            if given_loss:
                w.loss(loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w


def test_masked_logits_train_with_one_notice_and_are_ignored_under_the_models_name():
    """An RL policy that masks its illegal actions' logits with -inf was stopped at its first step, with
    no word on how to say the -inf are intended (a probe, session 53). Its loss and gradients are finite:
    the -inf harmed nothing the watch checks, so the steps go on, and the watch says so once, naming the
    ignore= that says they are intended (NOTE: [-inf that did no harm])."""
    with pytest.warns(RuntimeWarning, match=r"only -inf, in output of <model> \(MaskedPolicy\) \(nan=0, \+inf=0") as caught:
        w = _policy_steps()
    notices = [c for c in caught if "nanfast.watch" in str(c.message)]
    assert len(notices) == 1 and "pass ignore=['<model>']" in str(notices[0].message)
    assert w.step_count == 3 and w.skipped_steps == 0 and [(e.kind, e.step, e.name) for e in w.events] == [
        ("absorbed", 0, "")]
    for ignore in (["<model>"], [""]):  # the name events give the model, and its qualified name
        w = _policy_steps(ignore=ignore)
        assert w.step_count == 3 and not w.events
    # Those steps are healthy ones for the spike alarms too: a loss 10^4 times its usual is told.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = _policy_steps(steps=9, spike_at=8, spikes=dict(warmup=4, window=8, action="record"))
    assert [(e.kind, e.step) for e in w.events] == [("absorbed", 0), ("spike", 8)]
    # Not given the loss, the watch cannot know the -inf did no harm there: an event, which says how to
    # say they are intended.
    with pytest.raises(nanfast.NonFiniteError, match=r"in the output of <model> \(MaskedPolicy\) \(nan=0, \+inf=0") as e:
        _policy_steps(given_loss=False)
    assert "if they are intended, logits or scores masked with -inf, pass ignore=['<model>']" in str(e.value)


def test_steps_whose_minus_inf_were_absorbed_before_read_no_more_than_healthy_ones():
    """A bad step reads the parameters again, to name a non-finite one; an RL policy masking its
    actions read them at every step, as if every step were bad. Once -inf at some places were taken for
    masked, a step with -inf there alone reads what a healthy step reads: as much as the same steps with
    no action masked."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        read = {masked: _policy_steps(steps=6, masked=masked, profile=True).costs()["pass_bytes"]
                for masked in (True, False)}
    assert read[True] == read[False] > 0


class OffsetPolicy(MaskedPolicy):
    """The same policy with an offset of its own added to the logits, in its own forward."""

    def __init__(self):
        super().__init__()
        self.offset = torch.nn.Parameter(torch.zeros(5))

    def forward(self, obs, legal):
        return (self.head(self.body(obs)) + self.offset).masked_fill(~legal, -INF)


@pytest.mark.parametrize("policy,name,found_at", [(MaskedPolicy, "head.bias", 1), (OffsetPolicy, "offset", 4)])
def test_a_parameter_gone_minus_inf_after_minus_inf_were_absorbed_is_named(policy, name, found_at):
    """What that gives up, and where it is found: a -inf written into a parameter once the masked places
    were taken for absorbed. The head's bias makes -inf in the head's output, a new place: the step reads
    the parameters and names it at once. The policy's own offset makes -inf only in the output already
    taken for masked, the loss and gradients finite: the read of every parameter every `params_every`
    steps names it (before, the step it appeared did)."""
    policy = policy()
    optimizer = torch.optim.Adam(policy.parameters())
    parameter = policy.get_parameter(name)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(nanfast.NonFiniteError, match=rf"began with non-finite values in parameter {name} ") as e, \
                nanfast.watch(policy, optimizer, params_every=4) as w:
            for step in range(8):
                if step == 1:
                    with torch.no_grad():
                        parameter[3] = -INF
                legal = torch.rand(8, 5, generator=g) > 0.3
                legal[:, 0] = True
                dist = torch.distributions.Categorical(logits=policy(torch.randn(8, 4, generator=g), legal))
                loss = -dist.log_prob(dist.sample()).mean()
                w.loss(loss)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    assert e.value.report.step == found_at
    assert [(ev.kind, ev.step) for ev in w.events] == [("absorbed", 0), ("nonfinite", found_at)]


def test_minus_inf_that_did_harm_or_could_not_be_followed_is_still_an_event():
    """Only where the watch saw where the -inf went: one that made NaN after it (a log(0) times 0), or
    one in an inference forward (no loss, no gradients to read), is an event as before; the latter's
    message names the ignore= that would leave it out."""
    class LogOfZero(torch.nn.Module):
        def forward(self, x):
            return x + torch.log(torch.zeros_like(x))

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), LogOfZero())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nanfast.NonFiniteError, match=r"first appeared in the output of 1 \(LogOfZero\)") as e, \
            nanfast.watch(model, optimizer) as w:
        loss = (model(torch.randn(2, 4)) * 0).sum()  # -inf * 0: NaN in the loss (its gradients are finite)
        w.loss(loss)
        loss.backward()
        optimizer.step()
    assert "if they are intended" not in str(e.value)
    whole_row = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Softmax(-1))
    with torch.no_grad():
        whole_row[0].bias.fill_(-float("inf"))  # every logit -inf: the softmax makes NaN
    with pytest.raises(nanfast.NonFiniteError) as e, nanfast.watch(whole_row), torch.no_grad():
        whole_row(torch.randn(2, 4))
    assert "first appeared in the output of 0 (Linear)" in str(e.value) and "if they are intended" not in str(e.value)
    masked = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with torch.no_grad():
        masked[0].bias[1] = -float("inf")
    with pytest.raises(nanfast.NonFiniteError) as e, nanfast.watch(masked), torch.no_grad():
        masked(torch.randn(2, 4))  # inference: where the -inf went is not known
    assert "if they are intended, logits or scores masked with -inf, pass ignore=['0']" in str(e.value)


def _checkpoint(mode="min", metric=None, **extra):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode=mode)
    if metric is not None:
        scheduler.step(metric)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            **extra}


@pytest.mark.parametrize("mode,metric,apart", [("min", None, ["mode_worse", "best"]), ("max", None, ["mode_worse", "best"]),
                                                ("min", 0.5, ["mode_worse"])])
def test_a_checkpoint_with_reduce_lr_on_plateau_and_a_best_loss_is_clean(mode, metric, apart):
    report = nanfast.check_all(_checkpoint(mode, metric, best_loss=INF, epoch=3))  # raises on anything bad
    assert report.ok and [e.name for e in report.sentinels] == [f"scheduler.{name}" for name in apart] + ["best_loss"]
    assert "left out, as infinities a best or worst score or a running min or max starts from (best_loss, " \
           "ReduceLROnPlateau's mode_worse, kth_value, an observer's min_val): scheduler." in report.summary()
    assert [e["name"] for e in report.to_dict()["sentinels"]] == [e.name for e in report.sentinels]


def test_an_infinite_learning_rate_loss_scale_or_nan_best_is_still_a_fault(tmp_path):
    checkpoint = _checkpoint(best_loss=NAN, scaler={"scale": INF})
    checkpoint["optimizer"]["param_groups"][0]["lr"] = INF
    report = nanfast.check_all(checkpoint, raise_on_nonfinite=False)
    assert [e.name for e in report.bad] == ["optimizer.param_groups.0.lr", "best_loss", "scaler.scale"]
    assert [e.name for e in report.sentinels] == ["scheduler.mode_worse", "scheduler.best"]


def test_a_scan_lists_a_saved_best_score_apart(capsys, tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": torch.nn.Linear(3, 2).state_dict(), "best_val_loss": torch.tensor(INF)}, path)
    result = scan.scan_file(str(path))
    assert result.status == "clean" and [e.name for e in result.report.sentinels] == ["best_val_loss"]
    assert main(["scan", str(path)]) == 0
    assert ": clean; left out, as infinities a best or worst score or a running min or max starts from" \
           in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_a_model_prepared_for_quantization_aware_training_is_clean_before_its_first_forward():
    quantization = pytest.importorskip("torch.ao.quantization")

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.fc, self.dequant = quantization.QuantStub(), torch.nn.Linear(4, 4), quantization.DeQuantStub()

        def forward(self, x):
            return self.dequant(self.fc(self.quant(x)))

    model = Small().train()
    model.qconfig = quantization.get_default_qat_qconfig("x86")
    quantization.prepare_qat(model, inplace=True)
    report = nanfast.check_all(model)  # its observers' min_val (+inf) and max_val (-inf): raises on anything bad
    assert sorted(e.name.rsplit(".", 1)[-1] for e in report.sentinels) == ["max_val", "max_val", "min_val", "min_val"]
    model(torch.randn(2, 4))
    assert nanfast.check_all(model).sentinels == []  # seen data: finite
    observer = model.fc.activation_post_process.activation_post_process
    observer.min_val.fill_(-INF)  # a minimum that saw -inf is a fault
    assert [e.name for e in nanfast.check_all(model, raise_on_nonfinite=False).bad] == [
        "fc.activation_post_process.activation_post_process.min_val"]


class MaskedAttention(torch.nn.Module):
    def __init__(self, need_weights):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, 1)
        self.need_weights = need_weights

    def forward(self, x, attn_mask):
        return self.head(self.attn(x, x, x, attn_mask=attn_mask, need_weights=self.need_weights)[0])


@pytest.mark.parametrize("need_weights", [True, False])
def test_a_mask_that_masks_a_whole_head_is_found_where_it_makes_nan(need_weights):
    # pytorch/pytorch#160064 (and #41508): a head whose every key is masked gets NaN from
    # MultiheadAttention's plain softmax (need_weights=True); the fast path's safe softmax gives 0. The
    # mask's -inf are not counted, so what is named is where the NaN is made, whichever torch does.
    model = MaskedAttention(need_weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, attn_mask = torch.randn(2, 5, 8), torch.zeros(2 * 2, 5, 5)
    attn_mask[1] = -INF  # sample 0, head 1
    with torch.no_grad():
        makes_nan = bool(model.attn(x, x, x, attn_mask=attn_mask, need_weights=need_weights)[0].isnan().any())
    with nanfast.watch(model, optimizer, action="warn") as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model(x, attn_mask).sum().backward()
        optimizer.step()
    assert [(e.first.phase, e.first.name) for e in w.events] == ([("forward", "attn")] if makes_nan else [])
