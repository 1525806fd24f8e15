"""A dirty input batch is named by its entries, as the forward's arguments call them (NOTE: [Naming the
input's entries]): positional and keyword arguments, *args, nested lists and dicts, several dirty
entries, a later microbatch, a lagged read; and a layout that cannot name its rows names nothing. The
model's own output, and the loss's gradient w.r.t. it, are named by its fields (NOTE: [Naming the output's
fields])."""

from __future__ import annotations

import inspect

import pytest
import torch

import nanfast
from nanfast.watcher.events import InputEntry
from nanfast.watcher.inputs import Layout, entry_names, input_tensors, output_names, walked_tensors

NAN = float("nan")
INF = float("inf")


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, x, ids=None, weights=None, extra=None):
        out = self.lin(x if ids is None else x + self.emb(ids))
        if weights is not None:
            out = out * weights
        if extra is not None:
            out = out + extra["bias"].sum() + sum(t.sum() for t in extra["more"])
        return out


class Star(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, *parts):
        return self.lin(sum(parts))


def _dirty_step(model, *args, sync="eager", **kwargs):
    """One training step with a warn watch: its event."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="is dirty"), nanfast.watch(model, optimizer, action="warn", sync=sync) as w:
        model(*args, **kwargs).sum().backward()
        optimizer.step()
        assert not w.events or sync == "eager"  # a lagged watch reads the step when it leaves the block
    return w.events[0]


def test_the_one_argument_is_named():
    x = torch.randn(3, 4)
    x[1, 2] = NAN
    event = _dirty_step(Scaled(), x)
    assert event.first.entries == (InputEntry("x", 1, 0, 0),) and not event.forward_unchecked
    assert "step 0: the input batch is dirty: x (nan=1, +inf=0, -inf=0); the model did not produce" in event.summary()


def test_arguments_after_an_integer_tensor_and_none_are_named_by_position():
    x, weights = torch.randn(3, 4), torch.ones(3, 2)
    weights[0, 0] = float("inf")
    ids = torch.tensor([1, 2, 3])
    tensors, layout = input_tensors((x, ids, weights), {})
    assert layout.positions == (0, 2) and len(tensors) == 2  # the fast path, which skips the ids
    event = _dirty_step(Scaled(), x, ids, weights)
    assert event.first.entries == (InputEntry("weights", 0, 1, 0),)
    event = _dirty_step(Scaled(), x, None, weights)
    assert [e.name for e in event.first.entries] == ["weights"]


def test_keyword_arguments_and_nested_containers_are_named_by_their_path():
    x = torch.randn(3, 4)
    extra = {"bias": torch.zeros(2), "more": [torch.zeros(1), torch.tensor([NAN, NAN])]}
    event = _dirty_step(Scaled(), x, extra=extra)
    assert event.first.entries == (InputEntry("extra.more[1]", 2, 0, 0),)
    x[0, 0] = -float("inf")
    event = _dirty_step(Scaled(), x=x, extra=extra)  # every argument a keyword
    assert [(e.name, e.neginf, e.nan) for e in event.first.entries] == [("x", 1, 0), ("extra.more[1]", 0, 2)]
    assert "is dirty: x (nan=0, +inf=0, -inf=1), extra.more[1] (nan=2, +inf=0, -inf=0);" in event.summary()


def test_star_arguments_are_named_by_index():
    parts = [torch.randn(2, 4) for _ in range(3)]
    parts[2][1, 1] = NAN
    event = _dirty_step(Star(), *parts)
    assert [e.name for e in event.first.entries] == ["parts[2]"]


def test_a_later_microbatch_is_said_and_a_lagged_read_names_it_too():
    model = Scaled()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clean, dirty = torch.randn(3, 4), torch.randn(3, 4)
    dirty[2] = NAN
    with nanfast.watch(model, optimizer, action="warn") as w, pytest.warns(RuntimeWarning, match="is dirty"):
        for x in (clean, dirty):  # two microbatches, one optimizer step
            model(x).sum().backward()
        optimizer.step()
    assert "step 0: the input batch [microbatch 1] is dirty: x (nan=4, +inf=0, -inf=0)" in w.events[0].summary()
    event = _dirty_step(Scaled(), dirty, sync="lagged")
    assert event.first.entries == (InputEntry("x", 4, 0, 0),)


def test_a_dirty_input_after_non_finite_parameters_is_not_said_to_be_where_they_went():
    model = Scaled()
    with torch.no_grad():
        model.lin.weight[0, 0] = NAN
    x = torch.randn(3, 4)
    x[0, 1] = float("inf")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning) as caught, nanfast.watch(model, optimizer, action="warn") as w:
        model(x).sum().backward()
        optimizer.step()
    summary = w.events[0].summary()
    assert w.events[0].phase == "param" and str(caught[0].message) == summary
    assert summary.endswith("; the input batch was dirty too: x (nan=0, +inf=1, -inf=0); then propagated to 2 places: "
                            "output of lin (Linear); gradient of parameter lin.weight")


def test_a_layout_that_does_not_match_its_rows_names_nothing():
    forward = Scaled().forward
    assert entry_names(Layout(positions=(0, 2)), 2, forward) == ["x", "weights"]
    assert entry_names(Layout(positions=(0, 2)), 3, forward) is None
    assert entry_names(Layout(), 5, forward) == ["x", "ids", "weights", "extra", "args[4]"]
    assert entry_names(None, 1, forward) is None
    _, layout = input_tensors((torch.zeros(1),), {"extra": {"bias": torch.zeros(1)}})
    assert entry_names(layout, 2, forward) == ["x", "extra.bias"] and entry_names(layout, 1, forward) is None


class WithLoss(torch.nn.Module):
    """Computes its loss inside its forward, as a HF model does, and returns a dict (or a tuple)."""

    def __init__(self, as_tuple=False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.as_tuple = as_tuple

    def forward(self, x, labels):
        logits = self.lin(x)
        loss = torch.nn.functional.cross_entropy(logits, labels)  # NaN when every label is ignored
        return (logits, loss) if self.as_tuple else {"logits": logits, "aux": {"loss": loss}}


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_the_models_output_is_named_by_its_fields(sync):
    """A NaN loss computed in the model's forward (every label ignore_index: a mean over nothing) first
    appears in the model's output; the event said "output of <model>", not which field."""
    x, ignored = torch.randn(2, 4), torch.full((2,), -100)
    for model, field in ((WithLoss(), "aux.loss"), (WithLoss(as_tuple=True), "[1]")):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.warns(RuntimeWarning, match="non-finite"), \
                nanfast.watch(model, optimizer, action="warn", sync=sync) as w:
            out = model(x, ignored)
            (out["aux"]["loss"] if isinstance(out, dict) else out[1]).backward()
            optimizer.step()
        first = w.events[0].first
        assert (first.phase, first.name, first.entries) == ("forward", "", (InputEntry(field, 1, 0, 0),))
        assert f"first appeared in the output of <model> (WithLoss): {field} (nan=1, +inf=0, -inf=0)" \
            in w.events[0].summary()


class Siamese(torch.nn.Module):
    """One encoder applied to two inputs, its two outputs returned as a tuple or a dict
    (adambielski/siamese-triplet#18: a contrastive loss's NaN gradient, reported on one of them)."""

    def __init__(self, as_dict=False):
        super().__init__()
        self.encoder = torch.nn.Linear(4, 3)
        self.as_dict = as_dict

    def forward(self, a, b):
        out = (self.encoder(a), self.encoder(b))
        return {"left": out[0], "right": out[1]} if self.as_dict else out


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_the_gradient_wrt_an_output_field_is_named(sync):
    """The gradients of the loss w.r.t. the model's outputs were one slot: a NaN in the second output's
    gradient was "gradient of the loss w.r.t. the output of <model>" without saying which output (two such
    places, indistinguishable, when both were dirty)."""
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    for model, field in ((Siamese(), "[1]"), (Siamese(as_dict=True), "right")):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.warns(RuntimeWarning, match="non-finite"), \
                nanfast.watch(model, optimizer, action="warn", sync=sync) as w:
            out = model(a, b)
            left, right = out if isinstance(out, tuple) else (out["left"], out["right"])
            (left.sum() + (right * torch.full_like(right, NAN)).sum().nan_to_num()).backward()
            optimizer.step()
        first = w.events[0].first
        assert (first.phase, first.name, first.entries) == ("loss", "", (InputEntry(field, 6, 0, 0),))
        assert (f"first appeared in the gradient of the loss w.r.t. the output of <model> (Siamese): {field} "
                "(nan=6, +inf=0, -inf=0)") in w.events[0].summary()
    model = Scaled()  # a bare tensor's gradient names no field, as before
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="non-finite"), nanfast.watch(model, optimizer, action="warn", sync=sync) as w:
        (model(a) * NAN).sum().backward()
        optimizer.step()
    assert (w.events[0].first.phase, w.events[0].first.entries) == ("loss", ())


@pytest.mark.parametrize("as_dict", [False, True])
def test_the_models_output_is_walked_once_per_forward(monkeypatch, as_dict):
    """An output that is not a tensor (a transformers ModelOutput, a dict, a tuple) was walked twice per
    training forward: once for its check and again for its gradients' checks. One walk serves both."""
    model = Siamese(as_dict=as_dict)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    walks = []
    children = nanfast._tree._children
    monkeypatch.setattr(nanfast._tree, "_children", lambda obj: (walks.append(obj), children(obj))[1])
    with nanfast.watch(model, optimizer):
        for _ in range(2):
            walks.clear()
            out = model(torch.randn(2, 4), torch.randn(2, 4))
            assert sum(w is out for w in walks) == 1
            sum(v.sum() for v in (out.values() if as_dict else out)).backward()
            optimizer.step()



class Wrapper(torch.nn.Module):
    """Holds the model that computes the loss (a PEFT model, a LightningModule) and returns its output."""

    def __init__(self):
        super().__init__()
        self.inner = WithLoss()
        self.fail = False

    def forward(self, x, labels):
        out = self.inner(x, labels)
        if self.fail:
            raise RuntimeError("the forward raised")
        return out


def _first_of_wrapped(dropped_first: bool):
    model = Wrapper()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, ignored = torch.randn(2, 4), torch.full((2,), -100)
    with pytest.warns(RuntimeWarning, match="non-finite"), nanfast.watch(model, optimizer, action="warn") as w:
        if dropped_first:  # a forward dropped after its submodule's dict output was recorded
            model.fail = True
            with pytest.raises(RuntimeError, match="the forward raised"):
                model(x, ignored)
            model.fail, model.inner.as_tuple = False, True  # the next forward's slots reuse its ids
        out = model(x, ignored)
        (out[1] if dropped_first else out["aux"]["loss"]).backward()
        optimizer.step()
    return w.events[0]


def test_a_submodules_output_is_named_by_its_fields():
    """A wrapped model's NaN loss first appears in the submodule's output: "output of inner (WithLoss)", no
    field named (a probe, session 46). The C++ hooks walk such an output anyway; its layout is kept by
    slot id. A dropped forward's layouts go with its slots: a tuple (not walked for a submodule, so not
    named) recorded under a reused slot id is not named by them."""
    event = _first_of_wrapped(dropped_first=False)
    assert (event.first.phase, event.first.name, event.first.entries) == ("forward", "inner",
                                                                            (InputEntry("aux.loss", 1, 0, 0),))
    assert "output of inner (WithLoss): aux.loss (nan=1, +inf=0, -inf=0)" in event.summary()
    event = _first_of_wrapped(dropped_first=True)
    assert (event.first.phase, event.first.name, event.first.entries) == ("forward", "inner", ())


def test_an_output_layout_names_only_rows_it_matches():
    logits, loss = torch.zeros(2), torch.zeros(())
    assert output_names(None, 1) is None
    layout = walked_tensors({"logits": logits, "ids": torch.zeros(2, dtype=torch.long), "past": [(loss, loss)]})[1]
    assert output_names(layout, 3) == ["logits", "past[0][0]", "past[0][1]"] and output_names(layout, 2) is None


def test_a_nan_in_a_transformers_kv_cache_passed_in_is_a_dirty_input():
    """A tiny random-init Llama (transformers) decoding one token from a DynamicCache with one NaN in
    layer 1's keys: the NaN came in with the input, but the walker did not enter the cache, so the
    event named model.layers.1.self_attn.o_proj as its producer, and check_all listed the cache as not
    checked (a probe, session 49; NOTE: [Key/value caches])."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=32,
                                      intermediate_size=64, vocab_size=100, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, 6)), use_cache=True).past_key_values
    keys = cache.layers[1].keys if hasattr(cache, "layers") else cache.key_cache[1]  # transformers 5 / 4
    keys[0, 0, 2, 0] = NAN
    name = "layers.1.keys" if hasattr(cache, "layers") else "key_cache.1"
    report = nanfast.check_all({"past_key_values": cache}, raise_on_nonfinite=False)
    assert [e.name for e in report.bad] == [f"past_key_values.{name}"] and report.unchecked == ()
    # Newer transformers (5.24 here) take the cache as `cache` (`past_key_values` warns that it goes in
    # 5.40): the entry is named by the argument the cache came in.
    argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with pytest.warns(RuntimeWarning, match=rf"the input batch is dirty: {argument}\.(layers\[1\]\.keys|"
                                            r"key_cache\[1\]) \(nan=1"):
        with nanfast.watch(model, action="warn") as w, torch.no_grad():
            model(torch.randint(0, 100, (1, 1)), **{argument: cache}, use_cache=True)
    assert w.events[0].dirty_input
    # A healthy generate() with the watch on (its cache walked at every forward): no event.
    with nanfast.watch(model) as w, torch.no_grad():
        model.generate(torch.randint(0, 100, (1, 4)), max_new_tokens=3, do_sample=False)
    assert w.events == [] and len(w.history) == 3


def test_a_clean_transformers_cache_holds_nothing_unchecked():
    """A DynamicCache made without a config keeps its layers' class (layer_class_to_replicate): it was
    listed as not checked, and nanfast.checked warned that such batches pass unchecked (a probe, session
    49). A class or a function holds no values."""
    transformers = pytest.importorskip("transformers")
    cache = transformers.DynamicCache()
    cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    report = nanfast.check_all({"past_key_values": cache})
    assert report.ok and report.unchecked == () and report.num_tensors >= 2
    assert nanfast.check_all([len, torch.nn.Linear, torch]).unchecked == ()


class _SparseFeatures(torch.nn.Module):
    """Bag-of-words features as a sparse batch, projected by a dense weight (a recommender's first layer)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(6, 3) * 0.1)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x, extra=None):
        return self.head(torch.sparse.mm(x, self.proj) + (0 if extra is None else extra["w"].to_dense()))


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_nan_in_a_sparse_input_is_a_dirty_input_not_the_first_module(layout):
    """The watch read only strided inputs: a NaN in a sparse feature batch was blamed on the head
    (Linear) that read sparse.mm's output (a check of this session, 50). It reads a sparse input's stored
    values, as it reads a sparse gradient's, without coalescing (a host read on CUDA): no host read."""
    from op_recorder import OpRecorder

    torch.manual_seed(0)
    dense = (torch.rand(4, 6) < 0.4).float()
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    model = _SparseFeatures()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanfast.watch(model, optimizer) as w:  # a clean batch: silent, and the forward adds no host read
        with OpRecorder() as bare:
            model.head(torch.sparse.mm(sparse, model.proj))
        with OpRecorder() as watched:
            model(sparse).sum().backward()
        optimizer.step()
    assert not w.events and watched.host_syncs == bare.host_syncs
    dense[2, 3] = NAN
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    event = _dirty_step(_SparseFeatures(), sparse)
    assert event.first.entries == (InputEntry("x", 1, 0, 0),), event.summary()
    extra = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([INF, 1.0]), (3,))  # in a dict, uncoalesced
    event = _dirty_step(_SparseFeatures(), dense.nan_to_num().to_sparse(), extra={"w": extra})
    assert event.first.entries == (InputEntry("extra.w", 0, 1, 0),), event.summary()
