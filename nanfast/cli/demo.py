"""A small classifier trained for a few steps on synthetic data, with a fault planted mid-run: the
watch catches it and skips the step, check_batch shows the data is finite, and locate names the op.

The fault: the model standardizes each sample's features without an epsilon, and at step 5 a sample
is constant (a stuck sensor), so its standard deviation is 0 and the division makes 0/0 = NaN.
Deterministic (fixed seeds, CPU) and a few seconds long."""

from __future__ import annotations

import argparse
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

import nanfast

STEPS = 8
BAD_STEP = 5
BAD_SAMPLE = 11
BATCH, FEATURES, CLASSES = 16, 8, 4


class Standardize(torch.nn.Module):
    """Zero mean, unit variance per sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centered = x - x.mean(dim=-1, keepdim=True)
        return centered / centered.std(dim=-1, keepdim=True)  # the planted fault: no epsilon


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.standardize = Standardize()
        self.hidden = torch.nn.Linear(FEATURES, 32)
        self.out = torch.nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.standardize(x))))


def make_batches() -> list[dict[str, torch.Tensor]]:
    """The synthetic batches, labelled by a random linear teacher; BAD_STEP's holds a constant sample.

    Returns:
        STEPS batches of {"features", "label"}.
    """
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    batches = []
    for step in range(STEPS):
        x = torch.randn(BATCH, FEATURES, generator=gen)
        if step == BAD_STEP:
            x[BAD_SAMPLE] = 0.5  # finite data that the model cannot standardize
        batches.append({"features": x, "label": (x @ teacher).argmax(dim=-1)})
    return batches


def run(args: Optional[argparse.Namespace] = None) -> int:
    """Trains the classifier for STEPS steps under a skipping watch and prints what each tool shows.

    Args:
        args: the parsed command line (the demo has no options).
    Returns:
        0.
    """
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = make_batches()
    print(f"nanfast demo: {STEPS} steps of a small classifier; a constant sample is planted at step {BAD_STEP}\n")

    current: dict[str, torch.Tensor] = {}

    def forward_backward() -> None:
        """The step's forward and backward on the current batch: what the watch re-runs under locate."""
        F.cross_entropy(model(current["features"]), current["label"]).backward()

    # A bad step is skipped, then re-run under nanfast.locate (same batch, same RNG states): the
    # finding comes with the event.
    watch = nanfast.watch(model, optimizer, action="skip", on_event="locate", rerun=forward_backward)
    for step, batch in enumerate(batches):
        current.update(batch)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(batch["features"]), batch["label"])
        loss.backward()
        params_before = [p.detach().clone() for p in model.parameters()]
        events_before = len(watch.events)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skip's warning: printed below, in its place
            optimizer.step()
        caught = len(watch.events) > events_before
        print(f"step {step}: loss {loss.item():.4f}" + ("  <- non-finite" if caught else ""))
        if not caught:
            continue

        event = watch.last
        print(f"\n1. The watch caught it (fused checks in hooks, one host read per step):\n   {event.summary()}")
        unchanged = all(torch.equal(p, before) for p, before in zip(model.parameters(), params_before))
        print(f"2. It skipped the optimizer step: parameters unchanged: {unchanged}")
        print(f"3. check_batch: the data is not the cause: {nanfast.check_batch(batch).summary()}")
        print("4. The watch re-ran the step (same batch, same RNG state) under locate() and names the op:")
        print("   " + str(event.located).replace("\n", "\n   "))
        print()
    watch.remove()
    print(f"\ntrained {STEPS} steps; the bad one was skipped and the parameters stayed finite: "
          f"{nanfast.check_all(model, raise_on_nonfinite=False).ok}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo takes no options.

    Args:
        parser: its subcommand parser, left as it is.
    """
