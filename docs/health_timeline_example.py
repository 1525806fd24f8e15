"""Writes the health timeline behind the README's figure (docs/health_timeline.png): a small pre-norm MLP
trained on CPU under float16 autocast and `nanfast.watch(action="skip")`, with three things going wrong
on purpose, each caught as it happens:

- step 100: a batch with a NaN in it (dirty data): the watch catches it and skips the step;
- step 180: the learning rate set 30x too high for one step: the loss and gradient norm jump at the
  next step, and a running-median check in this script calls it a spike;
- throughout: the inputs' scale drifts upwards (an unnormalised feature), so the first layer's float16
  output creeps towards float16's largest finite value; this script warns when it passes 50%.

Until the watch writes these records itself (issue 18: `w.save`, `log_to=`), this script writes them in
the same JSON Lines format (one object per step, a header first). The headroom and spike checks here
are this script's own simple ones, not the watch's. Run from the repository root:

    python docs/health_timeline_example.py health.jsonl
    python -m nanfast plot health.jsonl -o docs/health_timeline.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch
import torch.nn.functional as F

import nanfast

STEPS, DIRTY_STEP, LR_MISTAKE_STEP = 300, 100, 180
HEADROOM_THRESHOLD = 0.5
SPIKE_RATIO, SPIKE_WINDOW = 3.0, 20
FLOAT16_MAX = torch.finfo(torch.float16).max


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
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 1, generator=gen)
    model = PreNormMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fc1_max = torch.zeros(())

    def keep_fc1_max(module, inputs, out):
        # The first layer's float16 output, its largest finite |x| (kept on the device, read once a step).
        fc1_max.copy_(torch.where(torch.isfinite(out), out.abs(), 0).amax())

    model.fc1.register_forward_hook(keep_fc1_max)
    losses: list[float] = []
    in_spike = [False]
    warned_headroom = False
    with open(args.out, "w") as f, nanfast.watch(model, optimizer, action="skip", loss=True) as w:
        f.write(json.dumps({"nanfast": nanfast.__version__, "model": type(model).__name__,
                            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "headroom_thresholds": [HEADROOM_THRESHOLD]}) + "\n")
        for step in range(STEPS):
            x, y = batch(step, gen, teacher)
            for group in optimizer.param_groups:
                group["lr"] = 0.05 * (30 if step == LR_MISTAKE_STEP else 1)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = w.loss(F.mse_loss(model(x).float(), y))
            loss.backward()
            seen, skipped = len(w.events), w.skipped_steps
            optimizer.step()
            record = step_record(w, loss.item(), fc1_max.item() / FLOAT16_MAX, skipped)
            record["events"] += [event_record(e) for e in w.events[seen:]]
            record["events"] += spike_events(step, record["loss"], losses, in_spike)
            if record["headroom"] >= HEADROOM_THRESHOLD and not warned_headroom:
                warned_headroom = True
                record["events"].append({"kind": "headroom", "phase": "forward", "name": "fc1", "summary": (
                    f"step {step}: output of fc1 (Linear) at {100 * record['headroom']:.0f}% of float16's max")})
            f.write(json.dumps(record) + "\n")
    print(f"{args.out}: {STEPS} steps, {w.skipped_steps} skipped, {len(w.events)} watch events")


def step_record(w: nanfast.Watch, loss: float, headroom: float, skipped_before: int) -> dict:
    """The per-step record of issue 18's format, from w.stats() and this script's own measures."""
    stats = w.stats()
    return {"step": w.step_count - 1, "loss": loss, "losses": {"loss": loss},
            "grad_norm": stats.get("grad_norm"), "param_norm": stats.get("param_norm"),
            "grad_max_abs": stats.get("grad_max_abs"), "nan": int(stats.get("nan", 0)),
            "posinf": int(stats.get("posinf", 0)), "neginf": int(stats.get("neginf", 0)),
            "headroom": headroom, "headroom_place": "output of fc1 (Linear)", "loss_scale": None,
            "skipped": w.skipped_steps > skipped_before, "scaler_skipped": False, "rolled_back": False,
            "events": []}


def event_record(event: nanfast.Event) -> dict:
    return {"kind": event.kind, "phase": event.first.phase, "name": event.first.name, "summary": event.summary()}


def spike_events(step: int, loss: float, history: list[float], in_spike: list[bool]) -> list[dict]:
    """A loss more than SPIKE_RATIO times the median of the last SPIKE_WINDOW finite losses starts a spike,
    reported once until the loss is back under that bound; only finite losses join the window."""
    found = []
    if len(history) >= SPIKE_WINDOW and loss == loss:
        median = statistics.median(history[-SPIKE_WINDOW:])
        spiking = loss > SPIKE_RATIO * median
        if spiking and not in_spike[0]:
            found.append({"kind": "spike", "phase": "loss_value", "name": "loss",
                          "summary": f"step {step}: loss {loss:.3g} is {loss / median:.0f}x its running median"})
        in_spike[0] = spiking
    if loss == loss:
        history.append(loss)
    return found


if __name__ == "__main__":
    main()
