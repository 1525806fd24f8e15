"""The watch under careless or unusual use (a probe, session 43): each case either works as a run without
the watch would, or is refused or warned about in words that say what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import nanfast
from training_state import equal, state_of

NAN = float("nan")


class Tokens(nn.Module):
    """An Embedding with max_norm, whose forward renormalises the rows a batch looks up, in place."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8, max_norm=1.0)
        self.f = nn.Linear(3, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, tokens, feats):
        return self.out(self.emb(tokens).mean(1) + self.f(feats))


def _token_batches():
    torch.manual_seed(1)
    data = [(torch.randint(0, 20, (6, 5)), torch.randn(6, 3)) for _ in range(4)]
    data[2] = (torch.randint(25, 30, (6, 5)), data[2][1].clone())  # rows no other batch looks up
    data[2][1][0, 0] = NAN
    return data


@pytest.mark.filterwarnings("ignore:nanfast.watch. step 2:RuntimeWarning")
@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_a_skip_puts_back_the_rows_an_embedding_renormalised_in_its_forward(sync):
    """A skipped step left the rows that the bad batch's forward renormalised (norm 1.0 where a run
    without the batch had 6.2): the weights such an Embedding rewrites are copied at each step's start."""
    def train(watched, drop_bad):
        torch.manual_seed(0)
        model = Tokens()
        with torch.no_grad():
            model.emb.weight.mul_(3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=sync == "lagged")
        w = nanfast.watch(model, optimizer, action="skip", sync=sync) if watched else None
        for i, (tokens, feats) in enumerate(_token_batches()):
            if i == 2 and drop_bad:
                continue
            optimizer.zero_grad()
            model(tokens, feats).sum().backward()
            optimizer.step()
        if w is not None:
            w.flush()
            assert w.skipped_steps == 1
            w.remove()
        return state_of(model, optimizer)

    assert equal(train(watched=True, drop_bad=False), train(watched=False, drop_bad=True))


def test_an_embeddings_renorm_is_no_update_by_another_optimizer():
    """Gradient accumulation over an Embedding with max_norm: its forwards renormalise the weight, which
    the watch took for an optimizer it does not see, and said so, wrongly, on a healthy run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 8, max_norm=1.0), nn.Flatten(), nn.Linear(40, 2))
    with torch.no_grad():
        model[0].weight.mul_(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nanfast.watch(model, optimizer) as w:
            for _ in range(3):
                optimizer.zero_grad()
                for _ in range(3):
                    model(torch.randint(0, 30, (4, 5))).sum().backward()
                optimizer.step()
    assert w.events == [] and w.step_count == 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

    def forward(self, x):
        return self.head(self.backbone(x))


def test_a_skipping_watch_of_a_submodule_warns_that_the_optimizer_steps_more():
    """The backbone watched, the optimizer over the whole model: a skipped dirty batch left NaN running
    statistics in the head's BatchNorm, silently (the model gave NaN in eval for good). A skip can put back
    the watched model's buffers only: said at watch()."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.warns(UserWarning, match=r"steps 6 parameter\(s\) outside the watched Sequential \(param\[2\], "
                                         r"param\[3\], param\[4\] and 3 more\)"):
        nanfast.watch(model.backbone, optimizer, action="skip").remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nanfast.watch(model, optimizer, action="skip").remove()  # the whole model: nothing to say
        nanfast.watch(model.backbone, optimizer, action="warn").remove()  # no skip: nothing is put back


class SparseAndDense(nn.Module):
    """A sparse embedding (trained by SparseAdam, which takes sparse gradients only) under a dense head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 6, sparse=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, idx, scale):
        return self.fc(self.emb(idx).mean(1) * scale)


def test_a_skip_that_another_optimizer_made_useless_raises_naming_its_parameters():
    """Two optimizers (SparseAdam for a sparse embedding, Adam for the rest), the docs' advice followed: the
    one stepped last watched with action="skip". A dirty batch's NaN reached the embedding through
    SparseAdam, stepped first, which no skip undoes: the watch then skipped every later step, healthy
    batches too, silently, naming the embedding's output and never its weight (a probe, session 46).
    watch() now says that the model has parameters its optimizer does not step, and the skip raises once
    they (or frozen ones: a probe, session 46) are non-finite, naming them."""
    model = SparseAndDense()
    sparse = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.01)
    dense = torch.optim.Adam(model.fc.parameters(), lr=0.01)
    with pytest.warns(UserWarning, match=r"1 trainable parameter\(s\) of the watched SparseAndDense are not in its "
                                         r"optimizer \(emb\.weight\)"):
        w = nanfast.watch(model, dense, action="skip")
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skips' own warnings
        for i in range(6):
            idx, y = torch.randint(0, 20, (4, 3), generator=g), torch.randint(0, 3, (4,), generator=g)
            scale = torch.ones(4, 1)
            if i == 2:
                scale[1] = NAN
            sparse.zero_grad()
            dense.zero_grad()
            nn.functional.cross_entropy(model(idx, scale), y).backward()
            sparse.step()  # NaN into the rows batch 2 looked up: no skip of `dense` undoes it
            if i < 2:
                dense.step()
                continue
            with pytest.raises(nanfast.NonFiniteError, match=r"the step cannot be skipped: the model's parameters "
                                                             r"emb\.weight, which the optimizer does not step, are "
                                                             r"non-finite"):
                dense.step()
            break
    assert w.skipped_steps == 0
    w.remove()
    # The same model with every trainable parameter in the watched optimizer: nothing to say, and a skip.
    model = SparseAndDense()
    model.emb.weight.requires_grad_(False)
    dense = torch.optim.Adam(model.fc.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = nanfast.watch(model, dense, action="skip")
    dense.zero_grad()
    nn.functional.cross_entropy(model(torch.zeros(2, 3, dtype=torch.long), torch.full((2, 1), NAN)),
                                torch.zeros(2, dtype=torch.long)).backward()
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        dense.step()
    assert w.skipped_steps == 1
    # A frozen weight gone NaN (written in place; an adapter merged into it) made every later step skip:
    # no skip puts it back, so the skip raises, naming it.
    with torch.no_grad():
        model.emb.weight[3, 0] = NAN
    dense.zero_grad()
    nn.functional.cross_entropy(model(torch.full((2, 3), 3), torch.ones(2, 1)), torch.zeros(2, dtype=torch.long)).backward()
    with pytest.raises(nanfast.NonFiniteError, match=r"parameters emb\.weight, which the optimizer does not step, are "
                                                     r"non-finite .*or they were frozen so"):
        dense.step()
    assert w.skipped_steps == 1
    w.remove()


class Masked(nn.Module):
    """A frozen parameter that holds -inf on purpose (an additive mask kept as a parameter)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.mask = nn.Parameter(torch.tensor([0.0, -float("inf"), 0.0]), requires_grad=False)

    def forward(self, x):
        return (self.lin(x) + self.mask).softmax(-1)


@pytest.mark.parametrize("options", [dict(ignore=["mask"]), dict(nan_only=True)])
def test_a_frozen_parameter_the_watch_allows_to_be_infinite_does_not_stop_a_skip(options):
    """The check of the parameters outside the optimizer before a skip read them whatever `ignore` and
    `nan_only` said: a model with an intended -inf in a frozen parameter had every skip turned into a
    raise (a review, session 46)."""
    model = Masked()
    optimizer = torch.optim.SGD(model.lin.parameters(), lr=0.1)
    w = nanfast.watch(model, optimizer, action="skip", **options)
    x = torch.randn(2, 4)
    x[0, 0] = NAN
    optimizer.zero_grad()
    model(x).sum().backward()
    with pytest.warns(RuntimeWarning, match="skipped the optimizer step"):
        optimizer.step()
    assert w.skipped_steps == 1
    w.remove()


def test_a_torchscript_model_is_refused_saying_so():
    """watch(torch.jit.script(model), optimizer) failed in its setup with "contains(): incompatible function
    arguments" (the message depended on the action)."""
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    optimizer = torch.optim.SGD(scripted.parameters(), lr=0.1)
    for action in ("raise", "warn", "skip"):
        with pytest.raises(TypeError, match="is a TorchScript module .*watch the eager module"):
            nanfast.watch(scripted, optimizer, action=action)


def _global_hooks() -> int:
    module = torch.nn.modules.module
    return len(module._global_module_registration_hooks) + len(module._global_buffer_registration_hooks)


def _train_and_drop(**options) -> None:
    """A watch made, one step, and everything dropped without remove() (a sweep, a notebook cell run again)."""
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    nanfast.watch(model, optimizer, **options)
    optimizer.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()


def test_watches_dropped_without_remove_leave_no_global_hooks_behind():
    """Each left its two global registration hooks for good, which every later module attribute set ran:
    600 of them made building a model 6x slower (a probe, session 43). The next watch removes them."""
    import gc

    gc.collect()
    nanfast.watch(nn.Linear(4, 2)).remove()  # removes what earlier tests' dropped watches retired
    before = _global_hooks()
    for _ in range(50):
        _train_and_drop()
        gc.collect()
    assert _global_hooks() <= before + 2  # at most the last one's, until another watch is installed
    model = nn.Linear(4, 2)
    w = nanfast.watch(model)
    assert _global_hooks() == before + 2  # its own
    w.remove()
    assert _global_hooks() == before


def test_a_log_to_file_of_a_watch_dropped_without_remove_can_be_written_again(tmp_path):
    """The path stayed taken for the life of the process ("already written by another watch")."""
    import gc

    path = tmp_path / "run.jsonl"
    _train_and_drop(log_to=path)
    gc.collect()
    w = nanfast.watch(nn.Linear(4, 2), log_to=path)
    w.remove()
    # Without a collection in between (a sweep, one model and one watch per run): the watch and its model
    # hold each other, and the path stayed taken until the cyclic collector happened to run.
    gc.disable()
    try:
        for _ in range(3):
            _train_and_drop(log_to=path)
        nanfast.watch(nn.Linear(4, 2), log_to=path).remove()
    finally:
        gc.enable()


def test_event_warnings_leave_no_text_in_the_warning_registry():
    """Each event warning names its step, so Python's registry (one entry per text shown, for the life of
    the process) only grew: 0.7 MB per 1000 steps of a watch with action="warn" on a NaN weight."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.weight[0, 0] = NAN
    registry = globals().setdefault("__warningregistry__", {})
    registry.clear()
    with nanfast.watch(model, optimizer, action="warn") as w, warnings.catch_warnings():
        warnings.simplefilter("default")  # as outside a test run: each text once per line, kept in the registry
        for _ in range(20):
            optimizer.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
    assert len(w.events) == 20
    assert [k for k in registry if k != "version"] == []


@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_event_warnings_work_in_code_run_without_a_file(how):
    """In `python -c`, a script piped to stdin or a REPL, __main__'s loader is BuiltinImporter: an event's
    warning raised ImportError ("'__main__' is not a built-in module") out of optimizer.step(), so
    action="warn" and "skip" stopped the run they were meant to keep going."""
    code = ("import torch, nanfast\n"
            "m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "with nanfast.watch(m, o, action='skip') as w:\n"
            "    x = torch.randn(1, 2); x[0, 0] = float('nan'); m(x).sum().backward(); o.step()\n"
            "print('skipped', w.skipped_steps)\n")
    args, stdin = ([sys.executable, "-c", code], None) if how == "-c" else ([sys.executable, "-"], code)
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "skipped 1"
    assert "RuntimeWarning: nanfast.watch: step 0: the input batch is dirty" in done.stderr


def test_hooks_of_modules_swapped_out_are_not_kept():
    """A head swapped in at every step: the handles of the heads gone piled up in the watch. Now the
    watch holds neither the heads nor their hooks' handles (NOTE: [Module hooks without a Python frame])."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    heads = []
    with nanfast.watch(model, optimizer) as w:
        for _ in range(20):
            model[1] = nn.Linear(8, 2)
            heads.append(weakref.ref(model[1]))
            optimizer.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
        gc.collect()
        assert [head() is None for head in heads] == [True] * 19 + [False]
        assert len(w._handles) < 20


def _trained_then(final, **options):
    """Three healthy SGD steps under a watch, then `final(model)` inside its block; returns the watch and
    what final returned (None when the block's end raised: see the caller)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, opt, **options) as w:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
        final(model)
    return w


def _dirty_batch():
    x = torch.randn(3, 4)
    x[0, 0] = NAN
    return x


@pytest.mark.parametrize("mode", ["eval, gradients on", "train, no_grad"])
def test_a_final_batch_no_step_ended_is_read_when_the_block_ends(mode):
    """A last test batch run after the last optimizer.step(), in eval mode without torch.no_grad() or under
    no_grad in train mode, counts into a step no optimizer.step() ends: the block's end dropped its checks
    unread, a NaN output with no event and no warning (a probe, session 49). Now read there."""
    def final(model):
        if mode.startswith("eval"):
            model.eval()
            return model(_dirty_batch())
        with torch.no_grad():
            return model(_dirty_batch())

    with pytest.raises(nanfast.NonFiniteError, match=r"step 3 \(forwards no step ended, after the last "
                                                     r"optimizer.step\(\) or w.step\(\): read when the watch ended\): "
                                                     r"the input batch is dirty"):
        _trained_then(final)
    with pytest.warns(RuntimeWarning, match=r"read when the watch ended\).*no step followed its forwards, so no "
                                            r"optimizer step to skip"):
        w = _trained_then(final, action="skip")
    (event,) = w.events
    assert event.unended and not event.evaluation and event.step == 3 and event.dirty_input
    assert w.skipped_steps == 0 and len(w.history) == 3


def test_inference_with_gradients_and_no_optimizer_is_read_when_the_block_ends():
    """model.eval() inference that forgot torch.no_grad(), watched without an optimizer and never
    calling w.step(): every forward joined one open step, dropped unread at the block's end (100 NaN
    outputs, no event: a probe, session 49)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    with torch.no_grad():
        model[2].weight[0, 0] = NAN
    with pytest.warns(RuntimeWarning, match=r"step 0 \(forwards no step ended.*output of 2 \(Linear\) \(nan=3"):
        with nanfast.watch(model, action="warn") as w:
            for _ in range(5):
                model(torch.randn(3, 4))
    assert [(e.unended, e.name) for e in w.events] == [(True, "2")]


def test_a_healthy_block_end_reads_nothing_more():
    """The block's end reads open forwards only when they recorded checks: a loop ending at its
    optimizer.step() has none (no host read there), and healthy open ones make no event."""
    from op_recorder import OpRecorder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = nanfast.watch(model, opt).__enter__()
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
        with OpRecorder() as ops:
            w.__exit__(None, None, None)
        assert ops.host_syncs == 0 and w.events == []
        w = _trained_then(lambda model: model.eval()(torch.randn(3, 4)))
    assert w.events == [] and len(w.history) == 3
