"""Writes the health timeline behind the README's figure (docs/health_timeline.png): a small pre-norm MLP
trained on CPU under float16 autocast and `nanfast.watch(action="skip", log_to=...)`, with three things
going wrong on purpose, each caught by the watch as it happens:

- step 100: a batch with a NaN in it (dirty data): an event of kind "nonfinite", the step skipped;
- step 180: the learning rate set 30x too high for one step: the loss and gradient norm jump at the
  next step, more than 10x their running medians: an event of kind "spike";
- throughout: the inputs' scale drifts upwards (an unnormalised feature), so the first layer's float16
  output creeps towards float16's largest finite value: events of kind "headroom" as it crosses 25% and
  50% (the run ends before 90%).

The records are the watch's own (streamed by `log_to=`). Run from the repository root:

    python docs/health_timeline_example.py health.jsonl
    python -m nanfast plot health.jsonl -o docs/health_timeline.png
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F

import nanfast

STEPS, DIRTY_STEP, LR_MISTAKE_STEP = 300, 100, 180


class PreNormMLP(torch.nn.Module):
    def __init__(self, features: int = 16, hidden: int = 64):
        super().__init__()
        self.fc1 = torch.nn.Linear(features, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.fc2(self.norm(self.fc1(x)))))


def batch(step: int, gen: torch.Generator, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch whose inputs' scale doubles every 50 steps (the targets do not depend on it)."""
    x = torch.randn(64, 16, generator=gen)
    y = torch.tanh(x @ teacher)
    x = x * (200.0 * 2 ** (step / 50))
    if step == DIRTY_STEP:
        x[3, 5] = float("nan")
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON Lines file to write")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)  # the README's figure and numbers: sums, hence the spike's size, vary with it
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 1, generator=gen)
    model = PreNormMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with warnings.catch_warnings(), nanfast.watch(model, optimizer, action="skip", log_to=args.out) as w:
        warnings.simplefilter("ignore", RuntimeWarning)  # the events are in the file (and in w.events)
        for step in range(STEPS):
            x, y = batch(step, gen, teacher)
            for group in optimizer.param_groups:
                group["lr"] = 0.05 * (30 if step == LR_MISTAKE_STEP else 1)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = w.loss(F.mse_loss(model(x).float(), y))
            loss.backward()
            optimizer.step()
    kinds = [e.kind for e in w.events]
    print(f"{args.out}: {STEPS} steps, {w.skipped_steps} skipped; events: "
          + ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)))


if __name__ == "__main__":
    main()
