"""The benchmark runs (the README's main job) and the watch's public profiling hook (Watch.costs()) measures.
Speed itself is not asserted here: it is measured by the benchmark, never in tests."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nanfast
from nanfast import cli
from nanfast.cli import bench, bench_watch, watch_workloads
from op_recorder import OpRecorder


def test_core_benchmark_writes_every_method(tmp_path, capsys):
    assert cli.main(["bench", "--workloads", "5000x1024-fp32", "--scale", "0.002", "--repeats", "1",
                     "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["core"]
    methods = set(bench.make_methods([torch.ones(2)]))
    assert {r["method"] for r in rows} == methods and all(r["median_ms"] > 0 for r in rows)
    assert "| nanfast.stats |" in capsys.readouterr().out


def test_extra_suite_results_keep_every_table(tmp_path, monkeypatch):
    # A suite's rows go to results.json under its name, and its other tables (the watch's "inside")
    # under name_key; its title and markdown are printed only.
    seen = {}

    def run_suite(device, repeats):
        seen.update(device=device, repeats=repeats)
        return {"title": "t", "markdown": "| m |", "rows": [{"a": 1}], "inside": [{"b": 2}]}

    monkeypatch.setattr(bench_watch, "run_suite", run_suite)
    assert cli.main(["bench", "--suite", "watch", "--repeats", "3", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert seen == {"device": "cpu", "repeats": 3}
    assert results["watch"] == [{"a": 1}] and results["watch_inside"] == [{"b": 2}]
    assert set(results) == {"machine", "device", "repeats", "watch", "watch_inside"}
    # Without --repeats, the watch suite takes issue 19's protocol: 40 repeats.
    assert cli.main(["bench", "--suite", "watch", "--out", str(tmp_path)]) == 0
    assert seen == {"device": "cpu", "repeats": 40}
    assert json.loads((tmp_path / "results.json").read_text())["repeats"] == {"watch": 40}


def test_core_methods_run_once_per_repeat_each_after_others_in_turn():
    """NOTE: [Each method after any other]: every repeat runs every method once, and the method before
    each one changes from repeat to repeat (in a fixed or rotated order it never does)."""
    calls: list[str] = []
    methods = {name: (lambda name=name: calls.append(name)) for name in "abcde"}
    medians = bench.time_methods(methods, repeats=12, device="cpu")
    assert set(medians) == set("abcde")
    rounds = [calls[i:i + 5] for i in range(0, len(calls), 5)]
    assert len(rounds) == 13 and all(sorted(r) == list("abcde") for r in rounds)
    for name in "abcde":
        before = {r[r.index(name) - 1] for r in rounds[1:] if r.index(name) > 0}
        assert len(before) >= 2, (name, before)


def test_benchmarks_script_is_the_cli(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"
    if not script.exists():
        pytest.skip("run from an installed package: benchmarks/ is in the checkout (CI runs this test there)")
    done = subprocess.run([sys.executable, str(script), "--workloads", "5000x1024-fp32", "--scale", "0.001",
                           "--repeats", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| nanfast.stats |" in done.stdout and (tmp_path / "results.json").exists()
    # The acceptance targets are the checkout's, not the package's: the script checks and records them.
    targets = json.loads((tmp_path / "results.json").read_text())["targets"]
    assert [t["target"] for t in targets] == ["stats 5000 small >= 50x faster than per-tensor assert",
                                              "stats 5000 small >= 3x faster than amp check"]
    assert "Targets (CPU):" in done.stdout and not hasattr(bench, "targets")


def test_a_profiled_watch_counts_its_hooks_kernels_and_bytes():
    # The benchmark's "inside the watch" table comes from Watch.costs() (public, profile=True).
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    with nanfast.watch(model, optimizer, profile=True) as w, OpRecorder() as ops:
        assert w.costs() == {"hooks": 0.0, "kernels": 0.0, "bytes": 0, "calls": 0, "pass": 0.0, "pass_bytes": 0}
        F.mse_loss(model(x), torch.zeros(5, 4)).backward()
        after_backward = w.costs()
        optimizer.step()
        clock = w.costs()
    params = sum(p.numel() for p in model.parameters())
    # Input, the Linears' outputs (the model's is the second's); the Tanh is not hooked (PASS_THROUGH).
    activations = (5 * 8) + (5 * 16) + (5 * 4)
    input_grads = (5 * 4) + (5 * 16)  # the loss gradient, what flows out of the second Linear
    # Each exactly once: the recorder (activations, backward gradients) and the fused pass (parameters,
    # their gradients).
    assert after_backward["bytes"] == 4 * (activations + input_grads)
    assert clock["bytes"] == 4 * (activations + input_grads + 2 * params)
    assert after_backward["pass_bytes"] == 0 and clock["pass_bytes"] == 4 * 2 * params
    assert clock["hooks"] >= clock["kernels"] > clock["pass"] > 0
    # One fused-op call per record (3 activations, 2 gradients) and one for the pass, as many as the
    # dispatcher saw.
    assert after_backward["calls"] == 3 + 2 and clock["calls"] == 3 + 2 + 1
    assert ops.counts["nanfast.stats.default"] == clock["calls"]


def test_watch_suite_reports_per_step_calls_bytes_and_overhead(tmp_path, monkeypatch, capsys):
    # A tiny MLP through the CLI: each column of the per-step table against a count made here.
    mlp = dict(features=6, width=5, layers=4, classes=3, batch=4)
    monkeypatch.setattr(watch_workloads, "MLP", mlp)
    assert cli.main(["bench", "--suite", "watch", "--workloads", "mlp", "--repeats", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    [inside] = results["watch_inside"]
    assert inside["workload"].startswith("MLP") and {r["workload"] for r in results["watch"]} == {inside["workload"]}
    assert all(r["samples"] == 2 for r in results["watch"])
    # Per step: 8 activation records (the input, 4 Linear and 3 GELU outputs; the Sequential's and the
    # model's output are the last Linear's), 7 gradient checks (what flows into the 6 modules after the
    # first, and the loss gradient), 1 fused pass; as many as the dispatcher sees in a step made here.
    [(_, model, batch)] = watch_workloads.make_workloads("cpu", ["mlp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanfast.watch(model, optimizer), OpRecorder() as ops:
        bench_watch._step(model, optimizer, *batch())
    assert inside["calls"] == 8 + 7 + 1 == ops.counts["nanfast.stats.default"]
    b, f, w, c = mlp["batch"], mlp["features"], mlp["width"], mlp["classes"]
    params = sum(p.numel() for p in model.parameters())
    # Forward b*(f + 6w + c), gradients b*(6w + c), the parameters' gradients; float32. The parameters
    # themselves are read at the first watched step only (params_every=100): not in the median step.
    assert inside["mb_read"] * 1e6 == pytest.approx(4 * (b * (f + 12 * w + 2 * c) + params))
    assert inside["inside_ms"] >= inside["kernels_ms"] > 0
    watched = next(r for r in results["watch"] if r["method"] == "nanfast.watch")
    low, high = watched["overhead_pct_ci95"]
    assert low <= watched["overhead_pct"] <= high
    out = capsys.readouterr().out
    assert "fused-op calls (kernel launches)" in out and f"| {inside['workload']} |" in out


def test_watch_suite_times_watches_left_on_not_first_steps(monkeypatch):
    # NOTE: [Measuring a watch left on]: one watch per watching method and workload, on its own copy of
    # the model, installed for the whole run; the timed steps are its 4th onwards, not first steps.
    monkeypatch.setattr(watch_workloads, "MLP", dict(features=6, width=5, layers=4, classes=3, batch=4))
    made = []

    def counted(model, optimizer=None, **options):
        made.append((nanfast.watch(model, optimizer, **options), model, options))
        return made[-1][0]

    monkeypatch.setattr(bench_watch, "watch", counted)
    suite = bench_watch.run_suite("cpu", repeats=5, only=["mlp"])
    side_by_side = [(w, model) for w, model, options in made if not options.get("profile")]
    # nanfast.watch, fuse=True, the watch that clips, then the profiled one of the "inside" table.
    assert [options for _, _, options in made] == [{}, {"fuse": True}, {}, {"profile": True}]
    assert all(w.step_count == 3 + 5 and not w._installed for w, _ in side_by_side)
    assert len({id(model) for _, model in side_by_side}) == 3  # each its own copy
    assert all(r["samples"] == 5 for r in suite["rows"])
    # The clipping watch against torch's clipping; everything else against no checks.
    assert {r["method"]: r["baseline"] for r in suite["rows"] if r["baseline"] != "none"} == {
        "nanfast.watch + w.clip_grad_norm_": "torch clip_grad_norm_"}
    assert "clipping gradients" in suite["markdown"]


def test_the_watch_suite_reports_its_own_null(monkeypatch):
    """NOTE: [The run's own null]: a second copy without checks, timed against the first like every
    method, its overhead in the per-step table."""
    monkeypatch.setattr(watch_workloads, "MLP", dict(features=6, width=5, layers=4, classes=3, batch=4))
    trained = []  # each model the suite makes an optimizer for: one copy per method, then the "inside" table's
    optimizer = bench_watch._optimizer
    monkeypatch.setattr(bench_watch, "_optimizer", lambda model: trained.append(model) or optimizer(model))
    suite = bench_watch.run_suite("cpu", repeats=3, only=["mlp"])
    [null] = [r for r in suite["rows"] if r["method"] == bench_watch.NULL]
    assert null["baseline"] == "none" and null["samples"] == 3
    assert len(trained) == len(bench_watch.methods("cpu")) + 1 and len({id(m) for m in trained}) == len(trained)
    low, high = null["overhead_pct_ci95"]
    assert suite["markdown"].splitlines()[4].endswith(f"| {null['overhead_pct']:+.1f}% ({low:+.1f}..{high:+.1f}%) |")
    assert "(the run's null)" in suite["markdown"]


def test_the_watch_suite_times_the_other_fuse_beside_the_devices_default():
    """The default fuses on an accelerator (NOTE: [Fused records by default on accelerators]): the suite
    times the watch beside the one with the other `fuse` on each device."""
    assert "nanfast.watch(fuse=True)" in bench_watch.methods("cpu")
    cuda = bench_watch.methods("cuda")
    assert "nanfast.watch(fuse=False)" in cuda and "nanfast.watch(fuse=True)" not in cuda
    model = torch.nn.Linear(2, 2)
    for name, fused in (("nanfast.watch(fuse=False)", False), ("nanfast.watch(fuse=True)", True)):
        with bench_watch._method(name, model, torch.optim.SGD(model.parameters(), lr=0.1)) as w:
            assert w.fuse is fused


def test_the_watch_suite_clips_as_torch_does(monkeypatch):
    # Both clipping methods leave the same gradients (norm 1.0 when they exceed it).
    monkeypatch.setattr(watch_workloads, "MLP", dict(features=6, width=5, layers=4, classes=3, batch=4))
    [(_, model, batch)] = watch_workloads.make_workloads("cpu", ["mlp"])
    x, y = batch()
    grads = {}
    for method in ("torch clip_grad_norm_", "nanfast.watch + w.clip_grad_norm_"):
        copy_ = copy.deepcopy(model)
        with torch.no_grad():
            for p in copy_.parameters():
                p.mul_(30.0)  # gradients far above norm 1
        optimizer = torch.optim.SGD(copy_.parameters(), lr=0.0)
        with bench_watch._method(method, copy_, optimizer) as installed:
            bench_watch._step(copy_, optimizer, x, y, clip=bench_watch._clip(method, copy_, installed))
        grads[method] = torch.cat([p.grad.flatten() for p in copy_.parameters()])
    torch.testing.assert_close(grads["torch clip_grad_norm_"], grads["nanfast.watch + w.clip_grad_norm_"])
    assert grads["torch clip_grad_norm_"].norm().item() == pytest.approx(bench_watch.MAX_NORM, rel=1e-5)


def test_watch_suite_names_an_unknown_workload(tmp_path, capsys):
    assert cli.main(["bench", "--suite", "watch", "--workloads", "mlp,gpt5", "--out", str(tmp_path)]) == 2
    assert "gpt5" in capsys.readouterr().out and not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("argv, said", [
    (["--repeats", "0"], "argument --repeats: must be > 0, got 0"),  # it ran the default 7
    (["--repeats", "-1"], "argument --repeats: must be > 0, got -1"),  # a traceback (no median)
    (["--scale", "0"], "argument --scale: must be > 0, got 0"),  # it ran one tensor of 1024
    (["--device", "foo"], "argument --device: not a device: 'foo'"),  # torch's traceback
    (["--workloads", "bogus"], "unknown workload(s) bogus for --suite core"),  # ZeroDivisionError in the chart
    (["--workloads", "5000x1024-fp32,bogus"], "unknown workload(s) bogus"),  # bogus dropped without a word
    (["--suite", "locate", "--workloads", "mlp"], "this suite takes no --workloads"),
])
def test_bad_bench_arguments_are_usage_errors(tmp_path, capsys, argv, said):
    """Found by probing (session 37): each of these ran something else or ended in a traceback."""
    try:
        code = cli.main(["bench", *argv, "--out", str(tmp_path)])
    except SystemExit as stop:  # argparse's usage error
        code = stop.code
    captured = capsys.readouterr()
    assert code == 2 and said in captured.out + captured.err and "Traceback" not in captured.err
    assert not (tmp_path / "results.json").exists()


def test_an_ordinary_watch_measures_nothing():
    model = torch.nn.Linear(4, 4)
    w = nanfast.watch(model)
    model(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="profile=True"):
        w.costs()
    assert w._recorder.costs() == (0.0, 0.0, 0, 0)  # no clock read on the hot path, nothing counted
    assert model._forward_pre_hooks[next(iter(model._forward_pre_hooks))].fn == w._before_model  # not wrapped


def test_median_interval_is_the_binomial_order_statistics():
    # n = 24: P(Binomial(24, 1/2) <= 6) = 0.011 <= 0.025 < P(<= 7) = 0.032, so x(7) and x(18).
    values = [float(v) for v in torch.randperm(24).tolist()]
    assert bench_watch.median_interval(values) == (6.0, 17.0)
    # n = 5: even (min, max) covers the median with probability 1 - 2/32 < 0.95; that is what it gives.
    assert bench_watch.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    assert bench_watch.median_interval([2.0]) == (2.0, 2.0)
    # 99%: P(<= 5) = 0.0033 <= 0.005 < P(<= 6), so x(6) and x(19).
    assert bench_watch.median_interval(values, level=0.99) == (5.0, 18.0)


def _fake_rows():
    rows = []
    for workload, ceiling in (("a", 20.0), ("b", 10.0)):
        for method in bench.make_methods([torch.ones(2)]):
            rows.append({"workload": workload, "method": method, "gb_per_s": ceiling / 2, "ceiling_gb_per_s": ceiling})
    return rows


def test_chart_names_the_machine_labels_its_axes_and_draws_the_ceiling():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    fig = bench.chart(_fake_rows(), f"nanfast: {bench.machine()}")
    ax = fig.axes[0]
    title = ax.get_title()
    assert nanfast.ops._C.cpu_isa() in title and torch.__version__ in title and "threads" in title
    assert "GB/s" in ax.get_ylabel() and ax.get_xlabel()
    # One dashed ceiling segment per workload, at that workload's measured ceiling.
    heights = sorted({round(seg[0][1], 6) for c in ax.collections for seg in c.get_segments()})
    assert heights == [10.0, 20.0]
    # The legend sits outside the axes (to their right), so it hides no bar.
    legend = ax.get_legend()
    fig.canvas.draw()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1


def test_core_rows_carry_the_read_ceiling_measured_in_the_run(tmp_path):
    rows = bench.run_core("cpu", repeats=1, scale=0.002, only=["5000x1024-fp32"])
    ceiling = {r["ceiling_gb_per_s"] for r in rows}
    assert len(ceiling) == 1
    best_contiguous = max(r["gb_per_s"] for r in rows if r["method"] in (bench.CONTIGUOUS_SUM, bench.CONTIGUOUS_MAX))
    assert ceiling == {best_contiguous}
    for r in rows:
        assert r["vs_ceiling"] == pytest.approx(r["gb_per_s"] / best_contiguous)


def test_chart_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert cli.main(["bench", "--workloads", "5000x1024-fp32", "--scale", "0.001", "--repeats", "1",
                     "--out", str(tmp_path)]) == 0
    assert "pip install 'nanfast[bench]'" in capsys.readouterr().out
    assert not (tmp_path / "results.png").exists()


def test_a_workload_the_amp_check_refuses_is_timed_without_it(monkeypatch):
    """CUDA's amp check takes no bfloat16 (torch 2.11 on an H100 raised NotImplementedError there, which
    stopped the whole benchmark): such a workload is timed without it, its amp ratios read n/a, and the
    chart leaves its bar out."""
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def cuda_like(tensors, found_inf, inv_scale):
        if any(t.dtype == torch.bfloat16 for t in tensors):
            raise NotImplementedError('"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for '
                                      "'BFloat16'")
        return real(tensors, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", cuda_like)
    monkeypatch.setattr(bench, "make_workloads", lambda device, scale: {
        "tiny-fp32": [torch.randn(300) for _ in range(3)],
        "tiny-bf16": [torch.randn(300).bfloat16() for _ in range(3)]})
    rows = bench.run_core("cpu", repeats=1, scale=1.0)
    amp_rows = {r["workload"]: r for r in rows if r["method"] == bench.AMP}
    assert list(amp_rows) == ["tiny-fp32"]
    assert all((r["speedup_vs_amp"] is None) == (r["workload"] == "tiny-bf16") for r in rows)
    table = bench.core_markdown(rows)
    bf16_table = table.split("**tiny-bf16**")[1]
    assert "| n/a |" in bf16_table and "| n/a |" not in table.split("**tiny-bf16**")[0]
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    bars = {bar.get_label(): bar for bar in bench.chart(rows, "t").axes[0].containers}
    heights = [patch.get_height() for patch in bars[bench.AMP].patches]
    assert heights[0] > 0 and math.isnan(heights[1])


def test_the_machine_line_names_the_gpu_the_timings_ran_on(monkeypatch):
    # The first GPU run's chart named only the host's Xeon.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert bench.machine("cuda").startswith("NVIDIA H100 80GB HBM3; ")
    assert "H100" not in bench.machine("cpu") and "H100" not in bench.machine()


def test_the_step_end_floor_runs_its_three_variants(monkeypatch):
    """benchmarks/step_end_floor.py replaces a private method of its watch copies with calls into the
    watch's internals: it must still run and time every variant's step end inside the steps."""
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    if not (benchmarks / "step_end_floor.py").exists():
        pytest.skip("run from an installed package: benchmarks/ is in the checkout (CI runs this test there)")
    monkeypatch.syspath_prepend(str(benchmarks))
    import step_end_floor

    monkeypatch.setitem(watch_workloads.MLP, "batch", 4)
    rows = step_end_floor.measure("mlp", repeats=3)
    assert [r["variant"] for r in rows] == list(step_end_floor.VARIANTS)
    assert all(math.isfinite(r["overhead_pct"]) and r["step_end_us"] > 0 for r in rows)


def test_the_watch_cost_benchmarks_run_every_variant(monkeypatch):
    """benchmarks/watch_cost_parts.py and watch_host_costs.py (the GPU report's tables) time the watch
    through its private methods: they must still run, and what they count must hold together."""
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    if not (benchmarks / "watch_cost_parts.py").exists():
        pytest.skip("run from an installed package: benchmarks/ is in the checkout (CI runs this test there)")
    monkeypatch.syspath_prepend(str(benchmarks))
    import watch_cost_parts
    import watch_host_costs

    monkeypatch.setitem(watch_workloads.MLP, "batch", 4)
    rows = {r["variant"]: r for r in watch_cost_parts.measure("mlp", "cpu", repeats=3, profiled=False)}
    assert list(rows) == list(watch_cost_parts.VARIANTS)
    # On a CPU, the ops each would launch on a GPU (counted with a GPU's bookkeeping, views aside):
    assert rows["bare module hooks"]["kernels"] == 0 and rows["watch"]["kernels"] > 0
    assert rows[bench_watch.NULL]["kernels"] == 0 and math.isfinite(rows[bench_watch.NULL]["overhead_pct"])
    # fused (the GPU default): the pass with every record in it, the summary, the read
    assert rows["watch, the other fuse"]["kernels"] == 3
    # the bare gradient reads: one call at the optimizer step, one per parameter in backward
    assert rows["bare gradient pass at the optimizer step"]["kernels"] == 1
    assert rows["bare gradient checks in backward"]["kernels"] == 8  # 4 Linear layers
    # the glue reads no parameters or gradients: no pass
    assert rows["watch(modules=False, params=False, grads=False)"]["kernels"] < rows["watch(modules=False)"]["kernels"]
    pack = nanfast.watcher.step.Step.pack
    phases = watch_host_costs.phases_table("cpu", ["mlp"], steps_timed=3)
    assert nanfast.watcher.step.Step.pack is pack  # put back
    assert len(phases) == 2 + len(watch_host_costs.VARIANTS)
    assert all(float(cell) > 0 for row in phases[2:] for cell in row.strip("|").split("|")[2:])
