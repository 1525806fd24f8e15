"""The benchmark runs (the README's main job) and its watch instrumentation measures and cleans up.
Speed itself is not asserted here: it is measured by the benchmark, never in tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import nanfast
from nanfast import bench, bench_watch, cli


def test_core_benchmark_writes_every_method(tmp_path, capsys):
    assert cli.main(["bench", "--workloads", "5000x1024-fp32", "--scale", "0.002", "--repeats", "1",
                     "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["core"]
    methods = set(bench.make_methods([torch.ones(2)]))
    assert {r["method"] for r in rows} == methods and all(r["median_ms"] > 0 for r in rows)
    assert "| nanfast.stats |" in capsys.readouterr().out


def test_benchmarks_script_is_the_cli(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"
    done = subprocess.run([sys.executable, str(script), "--workloads", "5000x1024-fp32", "--scale", "0.001",
                           "--repeats", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| nanfast.stats |" in done.stdout and (tmp_path / "results.json").exists()


def test_timed_watch_counts_the_watch_and_restores_it():
    watch_module = sys.modules[nanfast.watch.__module__]
    before = {name: getattr(watch_module.Watch, name) for name in bench_watch._WATCH_ENTRY_POINTS}
    stats_before = watch_module._stats
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = {"hooks": 0.0, "kernels": 0.0, "bytes": 0}
    with bench_watch._timed_watch(clock), nanfast.watch(model, optimizer):
        F.mse_loss(model(torch.randn(5, 8)), torch.zeros(5, 4)).backward()
        optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    # Parameters and gradients once each, plus the input, activations, output and backward gradients.
    assert clock["bytes"] > 2 * 4 * params
    assert clock["hooks"] >= clock["kernels"] > 0
    assert {name: getattr(watch_module.Watch, name) for name in bench_watch._WATCH_ENTRY_POINTS} == before
    assert watch_module._stats is stats_before
