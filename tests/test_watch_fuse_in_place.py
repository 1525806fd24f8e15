"""watch(fuse=True) and values written in place between a record and the flush that reads it (NOTE:
[Deferred tensors changed in place] and the NOTEs after it in csrc/python/deferred_records.h): each named
where the default watch, which reads at once, names it; and what the fused watch gives up there."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast

# Each test runs with the recorder's counts on the host and as tensors, as on a GPU (conftest.py).
pytestmark = pytest.mark.usefixtures("recorder_counts")

NAN, INF = float("nan"), float("inf")


def test_what_it_gives_up_a_value_made_finite_in_place_before_the_forward_ends():
    # Documented: the fused check reads a tensor at the step's pass; a ReLU(inplace=True) after the
    # layer that made -inf has replaced it with 0 by then. The default watch checks at once and sees it.
    class Net2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)
            self.relu = torch.nn.ReLU(inplace=True)

        def forward(self, x):
            return self.relu(self.fc(x))

    model = Net2()
    with torch.no_grad():
        model.fc.bias[0] = -INF
    found = {}
    for fuse in (False, True):
        with nanfast.watch(model, fuse=fuse, action="warn") as w, torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(torch.randn(3, 2))
        found[fuse] = [(e.phase, e.name) for e in w.events]
    assert found[False] == [("forward", "fc")] and found[True] == []


class WritesNaNInPlace(torch.nn.Module):
    """Writes NaN into the tensor it is given and returns it: its own output is the previous module's."""

    def forward(self, x):
        return x.mul_(NAN)


class WritesNaNIntoItsGradient(torch.autograd.Function):
    """A hand-written backward that fills the incoming gradient in place (no clone)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        grad[0].fill_(NAN)
        return grad


class BackwardWritesNaN(torch.nn.Module):
    def forward(self, x):
        return WritesNaNIntoItsGradient.apply(x)


def events_of_a_step(fuse, middle, microbatches):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), middle, torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer = torch.empty(8, 4)  # one input buffer, refilled for each microbatch
    seen = []
    with nanfast.watch(model, opt, fuse=fuse, action=seen.append):
        for batch in microbatches:
            buffer.copy_(batch)
            model(buffer).sum().backward()
        opt.step()
    return [[(p.phase, p.name, p.microbatch, p.nan) for p in (e.first, *e.later)] for e in seen]


@pytest.mark.parametrize("case", ["module", "backward", "buffer"])
def test_a_value_written_in_place_later_is_named_where_it_was_written(case):
    """A module that writes NaN into the output it was given and returns it, a backward that writes NaN
    into the incoming gradient, an input buffer refilled with a dirty second microbatch: the fused watch
    read the earlier record after the write and named the module before (or the first microbatch) as
    the producer (a probe, session 42; NOTE: [Deferred tensors changed in place]). The same events as
    the default watch."""
    clean = torch.randn(8, 4)
    dirty = clean.clone()
    dirty[3, 1] = NAN
    middle, microbatches = {"module": (WritesNaNInPlace(), [clean]), "backward": (BackwardWritesNaN(), [clean]),
                            "buffer": (torch.nn.Tanh(), [clean, dirty])}[case]
    fused = events_of_a_step(True, middle, microbatches)
    assert fused == events_of_a_step(False, middle, microbatches) and len(fused) == 1
    first = {"module": ("forward", "1", 0), "backward": ("backward", "1", 0), "buffer": ("input", "input", 1)}[case]
    assert fused[0][0][:3] == first


class LogOfZeros(torch.nn.Module):
    """log(0) at the given places of its input (everywhere: `at=None`): a -inf of a module's own."""

    def __init__(self, at=None):
        super().__init__()
        self.at = at

    def forward(self, x):
        zeros = torch.ones_like(x) if self.at is not None else torch.zeros_like(x)
        if self.at is not None:
            zeros[self.at] = 0.0
        return x + torch.log(zeros)


class MaskedAttention(torch.nn.Module):
    """Additive attention (Bahdanau) over padded sequences: the scores, `v`'s output, get -inf at the
    padding in place after `v` returned, the usual way to mask them before a softmax. `fault`: a module
    appended to `v`, whose output is then the scores."""

    def __init__(self, fault=None):
        super().__init__()
        self.w = torch.nn.Linear(8, 8)
        self.v = torch.nn.Linear(8, 1) if fault is None else torch.nn.Sequential(torch.nn.Linear(8, 1), fault)

    def forward(self, h, pad):
        scores = self.v(torch.tanh(self.w(h))).squeeze(-1)
        scores.masked_fill_(pad, -INF)
        return (torch.softmax(scores, -1).unsqueeze(-1) * h).sum(1)


class Policy(torch.nn.Module):
    """A policy that masks the logits of illegal actions with -inf in place, after its head returned."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def forward(self, h, illegal):
        logits = self.body(h.mean(1))
        logits[illegal] = -INF
        return torch.distributions.Categorical(logits=logits).log_prob(torch.zeros(len(h), dtype=torch.long))


class NearestOther(torch.nn.Module):
    """The distance of each point to its nearest other point: the pairwise distances, a module's output,
    get +inf on their diagonal in place before the min, the usual way to leave each point out."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.dist = PairwiseSquaredDistances()

    def forward(self, h, _):
        d = self.dist(self.proj(h.flatten(0, 1)))
        d.fill_diagonal_(INF)
        return d.min(1).values


class PairwiseSquaredDistances(torch.nn.Module):
    def forward(self, a):
        return (a[:, None] - a[None]).square().sum(-1)


def masked_run_events(fuse, model):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pad = torch.zeros(4, 5, dtype=torch.bool)
    pad[:, 3:] = True
    illegal = torch.zeros(4, 4, dtype=torch.bool)
    illegal[:, 1:3] = True
    seen = []
    with nanfast.watch(model, opt, fuse=fuse, action=seen.append):
        for _ in range(3):
            opt.zero_grad()
            out = model(torch.randn(4, 5, 8), illegal if isinstance(model, Policy) else pad)
            out.sum().backward()
            opt.step()
    return [(e.first.phase, e.first.name, e.first.nan, e.first.neginf) for e in seen]


@pytest.mark.parametrize("make", [MaskedAttention, Policy])
def test_a_healthy_module_whose_output_is_masked_with_minus_inf_in_place_is_not_blamed(make):
    """-inf written in place into a module's output after it returned (attention scores masked at the
    padding, a policy's illegal actions) is the caller's, not the module's: the fused watch read the
    record at the step's end, saw the mask and named `v` (or the head) as the producer on every healthy
    step, where the default watch, reading at once, saw nothing (a probe, session 53; NOTE: [Deferred
    tensors changed in place])."""
    assert masked_run_events(True, make()) == masked_run_events(False, make()) == []


def test_what_it_gives_up_plus_inf_written_in_place_on_purpose():
    """Documented: a +inf written in place on purpose (a distance matrix's diagonal before its min) is
    blamed on the module by the fused watch, which cannot tell it from an overflow a ReLU(inplace=True)
    kept (below); `ignore=` names the module."""
    assert masked_run_events(False, NearestOther()) == []
    assert [event[:2] for event in masked_run_events(True, NearestOther())] == [("forward", "dist")] * 3


def test_what_it_gives_up_for_that_a_modules_own_minus_inf_masked_in_place_later():
    """The price: the fused watch does not know which -inf of a rewritten output were there before the
    write. A module's own -inf everywhere (log(0)) makes NaN in the softmax: found, at the attention's
    output, where the default watch names the module itself. A single -inf of its own that the softmax
    absorbs (a zero weight, finite everywhere after) goes unseen by the fused watch."""
    everywhere = masked_run_events(True, MaskedAttention(LogOfZeros()))
    assert masked_run_events(False, MaskedAttention(LogOfZeros()))[0][:2] == ("forward", "v.1")
    assert len(everywhere) == 3 and everywhere[0][:2] == ("forward", "") and everywhere[0][2] > 0
    assert masked_run_events(False, MaskedAttention(LogOfZeros(at=(0, 0))))[0][:2] == ("forward", "v.1")
    assert masked_run_events(True, MaskedAttention(LogOfZeros(at=(0, 0)))) == []


class Plants(torch.nn.Module):
    """A new tensor with `value` at [0, 0]: a fault of this module's own."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        y = x.clone()
        y[0, 0] = self.value
        return y


class ReluInPlaceAfter(torch.nn.Module):
    """fc -> plant -> relu_ (functional: no module, no record of its own) -> out."""

    def __init__(self, value):
        super().__init__()
        self.fc, self.plant, self.out = torch.nn.Linear(4, 4), Plants(value), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.out(F.relu_(self.plant(self.fc(x))))


@pytest.mark.parametrize("value", [NAN, INF])
def test_a_modules_own_fault_rewritten_in_place_by_a_relu(value):
    """A module's NaN or +inf that a ReLU(inplace=True) rewrites (ResNet's BatchNorm, AlexNet's and VGG's
    convolutions, then their ReLU, which the watch leaves unhooked) is still named at the module by the
    fused watch, as by the default watch: ReLU keeps them (dropped, AlexNet's overflowing first
    convolution was named as the second: a probe, session 54)."""
    model = ReluInPlaceAfter(value)
    found = {}
    for fuse in (False, True):
        seen = []
        with nanfast.watch(model, fuse=fuse, action=seen.append), torch.no_grad():
            model(torch.randn(3, 4))
        found[fuse] = [(e.first.phase, e.first.name) for e in seen]
    assert found == {False: [("forward", "plant")], True: [("forward", "plant")]}


class ActivationInPlaceAfter(torch.nn.Module):
    """fc -> plant (a fault of its own, or none) -> [the parent writes `between` into it] -> a hooked
    in-place activation -> out."""

    def __init__(self, activation, value=None, between=None):
        super().__init__()
        self.fc, self.act, self.out = torch.nn.Linear(4, 4), activation, torch.nn.Linear(4, 2)
        self.plant = Plants(value) if value is not None else torch.nn.Linear(4, 4)
        self.between = between

    def forward(self, x):
        y = self.plant(self.fc(x))
        if self.between is not None:
            y[1, 1] = self.between
        return self.out(self.act(y))


def first_places_of_a_training_step(model, fuse):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with nanfast.watch(model, opt, fuse=fuse, action=seen.append):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    return [(e.first.phase, e.first.name, e.first.nan, e.first.posinf) for e in seen]


IN_PLACE_ACTIVATIONS = {  # torchvision's mobilenet_v3, DCGAN's discriminator (pytorch/examples dcgan), ELU nets
    "hardswish": lambda: torch.nn.Hardswish(inplace=True), "leaky_relu": lambda: torch.nn.LeakyReLU(0.2, inplace=True),
    "elu": lambda: torch.nn.ELU(inplace=True), "mish": lambda: torch.nn.Mish(inplace=True)}


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("activation", IN_PLACE_ACTIVATIONS)
def test_a_fault_kept_by_a_hooked_in_place_activation_is_named_where_it_was_made(activation, value):
    """NOTE: [Non-finite values an in-place activation keeps]: a NaN or +inf a module made, which a hooked
    in-place activation of torch's then rewrites and keeps, was named at the activation by the fused
    watch (its record holds the rewritten tensor; a probe, session 54, on torchvision's mobilenet_v3), at
    the module by the default watch. Now both name the module."""
    found = {fuse: first_places_of_a_training_step(ActivationInPlaceAfter(IN_PLACE_ACTIVATIONS[activation](), value), fuse)
             for fuse in (False, True)}
    assert found[True] == found[False] and found[True][0][:2] == ("forward", "plant")


@pytest.mark.parametrize("activation", IN_PLACE_ACTIVATIONS)
def test_a_value_the_parent_writes_before_an_in_place_activation_is_still_named_at_the_activation(activation):
    """The rule holds only where the activation's write is the only one since the earlier record: a NaN
    the parent writes into a clean output before the activation is first seen at the activation, by both
    watches (the module before is not blamed for it)."""
    torch.manual_seed(0)
    model = ActivationInPlaceAfter(IN_PLACE_ACTIVATIONS[activation](), between=NAN)
    found = {fuse: first_places_of_a_training_step(copy.deepcopy(model), fuse) for fuse in (False, True)}
    assert found[True] == found[False] and found[True][0][:2] == ("forward", "act")


class ResidualEnd(torch.nn.Module):
    """The end of torchvision's BasicBlock: its child's output, changed in place by the block's own code
    (`out += identity`, an in-place ReLU the watch leaves unhooked), returned; `added`: what the add adds
    (the block's input by default)."""

    def __init__(self, child, added=None):
        super().__init__()
        self.child, self.added = child, added

    def forward(self, x):
        out = self.child(x)
        out += x if self.added is None else self.added
        return F.relu(out, inplace=True)


def test_a_childs_fault_that_its_block_changes_in_place_and_returns_is_named_at_the_child():
    """NOTE: [A child's output a module changes in place and returns]: the block's record holds its
    child's output, written since the child's record; the fused watch named the block for the child's NaN
    (ResNet-18's bn2 as `layer1.0`, a probe, session 55). Both watches name the child."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), ResidualEnd(Plants(NAN)), torch.nn.Linear(4, 2))
    found = {fuse: first_places_of_a_training_step(copy.deepcopy(model), fuse) for fuse in (False, True)}
    assert found[True] == found[False] and found[True][0][:2] == ("forward", "1.child")


def test_what_it_gives_up_a_fault_of_the_blocks_own_in_place_op_is_named_at_the_child():
    """Documented: where the block's own add makes the NaN, the default watch, which read the child's output
    clean, names the block; the fused watch, reading it after the add, names the child."""
    added = torch.zeros(3, 4)
    added[1, 2] = NAN
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), ResidualEnd(torch.nn.Linear(4, 4), added), torch.nn.Linear(4, 2))
    found = {fuse: first_places_of_a_training_step(copy.deepcopy(model), fuse) for fuse in (False, True)}
    assert found[False][0][:2] == ("forward", "1") and found[True][0][:2] == ("forward", "1.child")
