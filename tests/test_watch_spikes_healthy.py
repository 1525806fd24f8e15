"""The spike rule on a healthy run whose values are heavy-tailed (NOTE: the spike rule and its defaults,
docs/watch.md): a converged classifier with label noise, as a probe ran it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast


def train_blobs(seed: int, spike_at: int = -1) -> list:
    """6 epochs (564 steps) of a 3-layer MLP on Gaussian blobs with 1% of labels flipped, Adam, batch 32,
    under a default watch given the loss; at step `spike_at`, the loss handed to the watch is 1000x."""
    torch.manual_seed(seed)
    dims, classes, n = 20, 5, 3000
    labels = torch.randint(0, classes, (n,))
    x = (torch.randn(classes, dims) * 1.5)[labels] + torch.randn(n, dims)
    flip = torch.rand(n) < 0.01
    labels[flip] = torch.randint(0, classes, (int(flip.sum()),))
    model = torch.nn.Sequential(torch.nn.Linear(dims, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, classes))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    step = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with nanfast.watch(model, opt) as w:
            for _ in range(6):
                order = torch.randperm(n)
                for i in range(0, n, 32):
                    batch = order[i:i + 32]
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x[batch]), labels[batch])
                    w.loss(loss * 1000 if step == spike_at else loss)
                    loss.backward()
                    opt.step()
                    step += 1
    assert step == 564 and (model(x).argmax(1) == labels).float().mean() > 0.95  # it did converge
    return [e for e in w.events if e.kind == "spike"]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_converged_classifier_with_label_noise_raises_no_spike(seed):
    """Its loss sits at ~0.01 with a batch holding a mislabelled example at ~0.3 now and then, 26x the
    median: 62 warnings in 564 healthy steps (seed 0), 11 (seed 1), before a spike had to leave the
    window's own largest excess behind too."""
    assert [(e.step, e.detail) for e in train_blobs(seed)] == []


def test_a_real_spike_on_the_same_run_still_fires():
    (event,) = train_blobs(0, spike_at=400)
    assert event.step == 400 and (event.phase, event.name) == ("loss_value", "loss")
