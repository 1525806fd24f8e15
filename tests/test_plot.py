"""`python -m nanfast plot`: reading a watch's JSON Lines timeline and drawing it. The figure is inspected
(axes, labels, scales, the markers' steps and kinds, the legend), as tests/test_bench.py does for the
benchmark's chart."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from nanfast import cli
from nanfast.cli import plot
from nanfast.cli.timeline_file import TimelineError, parse_steps, read_timeline

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
np = pytest.importorskip("numpy")

SPIKE, NAN, ROLLED_BACK, HEADROOM_WARNING = 30, 40, 50, 55


def _records(n: int = 60) -> list[dict]:
    """A smooth run (the loss falls over two decades) with a loss spike, a NaN caught and skipped, a
    rollback, a headroom warning and headroom growing; one record lacks most keys, one has extra ones."""
    records = []
    for step in range(n):
        records.append({
            "step": step, "loss": 3.0 * math.exp(-step / 10), "losses": {"mse": 3.0 * math.exp(-step / 10)},
            "grad_norm": 1.0 / (1 + step), "param_norm": 5.0, "grad_max_abs": 0.1, "nan": 0, "posinf": 0,
            "neginf": 0, "headroom": 0.01 * 2 ** (step / 10), "headroom_place": "output of fc1 (Linear)",
            "loss_scale": None, "skipped": False, "scaler_skipped": False, "rolled_back": False, "events": [],
        })
    records[SPIKE].update(loss=50.0, events=[{"kind": "spike", "phase": "loss_value", "name": "loss",
                                              "summary": "loss 50 is 40x its running median"}])
    records[NAN].update(loss=float("nan"), grad_norm=None, nan=3, skipped=True,
                        events=[{"kind": "nonfinite", "phase": "forward", "name": "fc1", "summary": "NaN in fc1"}])
    records[ROLLED_BACK]["rolled_back"] = True
    records[HEADROOM_WARNING]["events"] = [{"kind": "headroom", "phase": "forward", "name": "fc2", "summary": "41%"}]
    records[12] = {"step": 12}  # every other key missing
    records[13]["future_key"] = {"anything": [1, 2]}
    return records


def _write(path, records, header=True) -> str:
    lines = [json.dumps({"nanfast": "0.1.0", "model": "TinyMLP", "started": "2026-11-23T15:00:00",
                         "headroom_thresholds": [0.5, 0.9]})] if header else []
    lines += [json.dumps(r) for r in records]  # json writes NaN as the token NaN, as Watch.save will
    path.write_text("\n".join(lines) + "\n\n")
    return str(path)


@pytest.fixture
def run_file(tmp_path):
    return _write(tmp_path / "run.jsonl", _records())


def _event_lines(ax) -> dict[str, list[float]]:
    """label -> the steps of the vertical lines of that LineCollection."""
    return {c.get_label(): sorted(seg[0][0] for seg in c.get_segments()) for c in ax.collections if c.get_label()}


def _marks(ax) -> dict[str, list[float]]:
    return {line.get_label(): list(line.get_xdata()) for line in ax.lines if line.get_linestyle() == "None"}


def test_reads_columns_events_and_marks_tolerating_missing_and_extra_keys(run_file):
    t = read_timeline(run_file)
    assert t.header["model"] == "TinyMLP" and list(t.steps) == list(range(60))
    assert t.headroom_thresholds == [0.5, 0.9]
    # Step 12 has no keys; the NaN loss is a value, the null grad norm is not.
    assert t.present == {"loss": 59, "grad_norm": 58, "headroom": 59}
    assert math.isnan(t.columns["loss"][NAN]) and math.isnan(t.columns["grad_norm"][NAN])
    assert math.isnan(t.columns["loss"][12]) and t.columns["loss"][SPIKE] == 50.0
    assert t.marks == {"skipped": [NAN], "scaler_skipped": [], "rolled_back": [ROLLED_BACK]}
    assert [(s, k) for s, k, _ in t.events] == [(SPIKE, "spike"), (NAN, "nonfinite"), (HEADROOM_WARNING, "headroom")]
    assert t.events[1][2] == "NaN in fc1"


def test_cli_writes_the_png_and_the_figure_shows_every_panel_event_and_mark(run_file, tmp_path, capsys):
    out = tmp_path / "health.png"
    assert cli.main(["plot", run_file, "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "3 events" in capsys.readouterr().out

    fig = plot.figure(read_timeline(run_file))
    loss, grad, headroom = fig.axes
    assert "loss" in loss.get_ylabel() and "gradient norm" in grad.get_ylabel() and "%" in headroom.get_ylabel()
    assert "step" in headroom.get_xlabel()
    assert loss.get_yscale() == grad.get_yscale() == headroom.get_yscale() == "log"
    title = fig.get_suptitle()
    assert "run.jsonl: TinyMLP" in title and "3 events" in title
    assert "1 step skipped" in title and "1 rolled back" in title and "steps 0-59" in title
    # The headroom line is in percent.
    x, y = headroom.lines[0].get_data()
    assert y[list(x).index(20)] == pytest.approx(100 * 0.01 * 4)
    for ax in fig.axes:  # every panel carries every event at its step, by kind, and the marks
        lines = _event_lines(ax)
        assert lines == {"loss / gradient norm spike (1)": [SPIKE], "non-finite values (NaN/inf) (1)": [NAN],
                         "overflow headroom warning (1)": [HEADROOM_WARNING]}
        assert _marks(ax) == {"step skipped by the watch (1)": [NAN],
                              "rolled back to the last good state (1)": [ROLLED_BACK]}
    thresholds = [line.get_ydata()[0] for line in headroom.lines if line.get_label().startswith("threshold")]
    assert thresholds == [50.0, 90.0]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["loss / gradient norm spike (1)", "non-finite values (NaN/inf) (1)",
                      "overflow headroom warning (1)", "step skipped by the watch (1)",
                      "rolled back to the last good state (1)", "threshold 50% (from the file's header)",
                      "threshold 90% (from the file's header)"]


def test_python_m_nanfast_plot_writes_svg(run_file, tmp_path):
    out = tmp_path / "health.svg"
    done = subprocess.run([sys.executable, "-m", "nanfast", "plot", run_file, "-o", str(out), "--title", "my run"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    svg = out.read_text()
    assert svg.startswith("<?xml") and "my run" in svg


def test_pdf_by_suffix_and_the_default_output_beside_the_input(run_file, tmp_path):
    assert cli.main(["plot", run_file, "-o", str(tmp_path / "h.pdf")]) == 0
    assert (tmp_path / "h.pdf").read_bytes()[:5] == b"%PDF-"
    assert cli.main(["plot", run_file]) == 0
    assert (tmp_path / "run.png").exists()


def test_a_panel_without_data_says_so_and_headroom_is_drawn_only_when_present(tmp_path):
    path = _write(tmp_path / "g.jsonl", [{"step": s, "grad_norm": 0.5 + s % 3, "loss": None} for s in range(10)],
                  header=False)
    fig = plot.figure(read_timeline(path))
    assert len(fig.axes) == 2  # no headroom panel
    loss, grad = fig.axes
    assert not loss.lines and [t.get_text() for t in loss.texts] == ["no loss in this file (pass it to w.loss(...))"]
    assert len(grad.lines) == 1 and not grad.texts
    # No header: the file's name alone; no events: nothing in a legend.
    assert fig.get_suptitle().startswith("g.jsonl\n0 events, 0 steps skipped") and not fig.legends


def test_several_named_losses_are_drawn_each_so_that_the_one_that_went_nan_shows(tmp_path):
    records = [{"step": s, "loss": 2.0 / (1 + s), "losses": {"ce": 2.0 / (1 + s), "aux": 0.5}} for s in range(8)]
    records[4]["losses"]["aux"] = float("nan")
    for s in range(5, 8):
        records[s]["losses"]["reg"] = 0.01  # a name given only from step 5 on
    t = read_timeline(_write(tmp_path / "named.jsonl", records))
    assert list(t.losses) == ["ce", "aux", "reg"]
    assert math.isnan(t.losses["aux"][4]) and [math.isnan(v) for v in t.losses["reg"]] == [True] * 5 + [False] * 3
    fig = plot.figure(t)
    loss = fig.axes[0]
    lines = {line.get_label(): line.get_ydata() for line in loss.lines}
    assert list(lines) == ["loss 'ce'", "loss 'aux'", "loss 'reg'"]
    assert math.isnan(lines["loss 'aux'"][4]) and lines["loss 'ce'"][4] == pytest.approx(0.4)
    assert loss.get_yscale() == "log"  # 0.01 to 2 over the names together
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["loss 'ce'", "loss 'aux'", "loss 'reg'"]


def test_gradscaler_skips_and_unknown_event_kinds_are_marked_too(tmp_path):
    records = [{"step": s, "loss": 1.0, "scaler_skipped": s in (0, 1)} for s in range(4)]
    records[2]["events"] = [{"kind": "oom", "summary": "a kind this reader does not know"}]
    fig = plot.figure(read_timeline(_write(tmp_path / "amp.jsonl", records)))
    loss = fig.axes[0]
    assert _marks(loss) == {"step skipped by GradScaler (inf gradients) (2)": [0, 1]}
    assert _event_lines(loss) == {"event: oom (1)": [2]}
    assert "1 event (1 oom), 0 steps skipped, 0 rolled back, 2 skipped by GradScaler" in fig.get_suptitle()


def test_linear_scale_when_the_loss_spans_less_than_a_decade_or_goes_negative(tmp_path):
    records = [{"step": s, "loss": 1.0 + 0.1 * s, "grad_norm": 1.0} for s in range(5)]
    records[2]["loss"] = -0.5
    fig = plot.figure(read_timeline(_write(tmp_path / "l.jsonl", records)))
    assert fig.axes[0].get_yscale() == "linear" and "log" not in fig.axes[0].get_ylabel()


def test_a_zero_gradient_norm_is_a_gap_on_the_log_axis_and_the_label_says_so(tmp_path):
    # A step whose gradients were all NaN has a norm of 0 over its finite elements.
    records = [{"step": s, "grad_norm": 0.0 if s == 3 else 1.0 + s} for s in range(6)]
    grad = plot.figure(read_timeline(_write(tmp_path / "z.jsonl", records))).axes[1]
    assert grad.get_yscale() == "log" and grad.get_ylabel().endswith("log; 0 not drawn")
    x, y = grad.lines[0].get_data()
    assert list(x) == list(range(6)) and math.isnan(y[3]) and y[4] == 5.0


def test_envelope_keeps_spikes_and_gaps_of_a_million_points():
    rng = np.random.default_rng(0)
    y = 1.0 + 0.01 * rng.random(1_000_000)
    y[123_457], y[654_321], y[500_001] = 40.0, 0.001, np.nan
    x = np.arange(y.size)
    xs, ys = plot.envelope(x, y, max_points=2000)
    assert len(xs) <= 3000 and np.all(np.diff(xs) > 0)
    assert 123_457 in xs and 654_321 in xs and 500_001 in xs
    assert np.nanmax(ys) == 40.0 and np.nanmin(ys) == 0.001
    short = np.arange(10.0)
    assert plot.envelope(short, short, 2000)[1] is short


def test_a_long_run_is_thinned_for_drawing_but_never_loses_an_event_or_a_skipped_step(tmp_path):
    n = 20_000
    records = [{"step": s, "loss": 1.0 + (s % 7) / 10, "grad_norm": 2.0} for s in range(n)]
    event_steps = list(range(17, n, 997))
    for s in event_steps:
        records[s]["events"] = [{"kind": "spike", "phase": "grad", "name": "", "summary": ""}]
        records[s + 1]["skipped"] = True
    fig = plot.figure(read_timeline(_write(tmp_path / "long.jsonl", records, header=False)), max_points=200)
    loss = fig.axes[0]
    assert len(loss.lines[0].get_xdata()) <= 300
    assert _event_lines(loss) == {f"loss / gradient norm spike ({len(event_steps)})": event_steps}
    assert _marks(loss) == {f"step skipped by the watch ({len(event_steps)})": [s + 1 for s in event_steps]}


def test_steps_option_keeps_a_range(run_file, tmp_path):
    t = read_timeline(run_file, parse_steps("35:45"))
    assert list(t.steps) == list(range(35, 46)) and [k for _, k, _ in t.events] == ["nonfinite"]
    assert list(read_timeline(run_file, parse_steps("55:")).steps) == list(range(55, 60))
    assert list(read_timeline(run_file, parse_steps(":2")).steps) == [0, 1, 2]
    assert cli.main(["plot", run_file, "--steps", "35:45", "-o", str(tmp_path / "r.png")]) == 0


def test_steps_out_of_order_are_drawn_by_step(tmp_path):
    records = [{"step": s, "loss": float(s)} for s in (3, 4, 5, 0, 1, 2)]
    t = read_timeline(_write(tmp_path / "resumed.jsonl", records))
    assert list(t.steps) == [0, 1, 2, 3, 4, 5] and list(t.columns["loss"]) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at column 2)"),
    ('{"step": 1, "loss": "abc"}', "'loss' must be a number or null, not \"abc\""),
    ('{"step": 1, "grad_norm": true}', "'grad_norm' must be a number or null, not true"),
    ('{"step": "7"}', "'step' must be a 64-bit integer, not \"7\""),
    ('{"step": 18446744073709551616}', "'step' must be a 64-bit integer, not 18446744073709551616"),
    ('{"step": 1, "skipped": "yes"}', "'skipped' must be true, false or null"),
    ('{"step": 1, "events": [{"phase": "forward"}]}', "events[0] must be an object with a string 'kind'"),
    ("[1, 2]", "expected a JSON object"),
    ('{"step": 1, "losses": [0.5]}', "'losses' must be an object of name: number, not [0.5]"),
    ('{"step": 1, "losses": {"ce": "x"}}', "'losses': 'ce' must be a number or null, not \"x\""),
])
def test_a_bad_line_is_named_with_its_number_and_exit_code_2(tmp_path, capsys, line, message):
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps({"nanfast": "0.1.0"}) + '\n{"step": 0, "loss": 1.0}\n' + line + "\n")
    with pytest.raises(TimelineError, match="^" + re.escape(f"{path}:3: {message}")):
        read_timeline(str(path))
    assert cli.main(["plot", str(path), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nanfast plot: {path}:3: {message}")
    assert not (tmp_path / "x.png").exists()


def test_a_last_line_cut_off_mid_write_is_left_out_and_said(tmp_path, capsys):
    """A run killed while writing its last record (each is written whole, newline last) left a file that
    plot refused ("not JSON" at its last line): that line is left out, and said; a bad line with its
    newline is still refused (the test above)."""
    path = tmp_path / "run.jsonl"
    whole = json.dumps({"nanfast": "0.1.0"}) + '\n{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.5}\n'
    path.write_text(whole + '{"step": 2, "loss": 0.2, "grad_no')
    t = read_timeline(str(path))
    assert list(t.steps) == [0, 1] and t.cut_off
    assert cli.main(["plot", str(path), "-o", str(tmp_path / "x.png")]) == 0
    assert "its last line, cut off mid-write, left out" in capsys.readouterr().out
    path.write_text(whole)
    assert not read_timeline(str(path)).cut_off


def test_a_bad_threshold_in_the_header_is_named(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"nanfast": "0.1.0", "headroom_thresholds": [0.5, 50]}\n')
    with pytest.raises(TimelineError, match=re.escape(f"{path}:2: 'headroom_thresholds' must be a list of "
                                                      "fractions in (0, 1], not [0.5, 50]")):
        read_timeline(str(path))


@pytest.mark.parametrize("args, message", [
    (["missing.jsonl"], "missing.jsonl: cannot read (No such file or directory)"),
    (["{dir}/empty.jsonl"], "empty.jsonl: no per-step records"),
    (["{dir}/ok.jsonl", "--steps", "100:200"], "no per-step records (objects with a 'step' key) in steps 100:200"),
    (["{dir}/ok.jsonl", "--steps", "5"], "--steps '5': expected A:B"),
    (["{dir}/ok.jsonl", "--steps", "9:3"], "--steps '9:3': the first step is after the last"),
    (["{dir}/ok.jsonl", "-o", "{dir}/x.jpg"], "x.jpg: the output's suffix picks the format, one of .png, .svg, .pdf"),
    (["{dir}/ok.jsonl", "-o", "{dir}/no/such/dir/x.png"], "x.png: cannot write"),
])
def test_bad_input_or_options_give_a_clear_message_and_exit_code_2(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text(json.dumps({"nanfast": "0.1.0"}) + "\n")
    (tmp_path / "ok.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    assert cli.main(["plot", *(a.format(dir=tmp_path) for a in args)]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_file_in_a_subprocess_is_a_message_not_a_traceback(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": [1]}\n')
    done = subprocess.run([sys.executable, "-m", "nanfast", "plot", str(path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{path}:2: 'loss' must be a number or null, not [1]" in done.stderr


def test_without_matplotlib_the_message_names_the_extra(run_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert cli.main(["plot", run_file, "-o", str(tmp_path / "h.png")]) == 2
    assert "pip install 'nanfast[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "h.png").exists()


def test_an_old_matplotlib_is_named_with_the_extra(run_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(matplotlib, "__version_info__", (3, 6, 3))
    monkeypatch.setattr(matplotlib, "__version__", "3.6.3")
    assert cli.main(["plot", run_file, "-o", str(tmp_path / "h.png")]) == 2
    assert "needs matplotlib >= 3.7 (found 3.6.3): pip install 'nanfast[plot]'" in capsys.readouterr().err


def test_a_value_with_no_finite_neighbour_is_drawn_as_a_dot(tmp_path):
    """Headroom of the steps that ran in float16 (autocast on even steps only) and a loss given to w.loss
    every 5th step: each value lies between empty steps, made no line segment, and the panels were drawn
    empty with their axes stretched to the values (a probe, session 41)."""
    records = [{"step": s, "loss": 1.0 + s if s % 5 == 0 else None, "grad_norm": 0.5,
                "headroom": 0.05 if s % 2 == 0 else None} for s in range(20)]
    fig = plot.figure(read_timeline(_write(tmp_path / "sparse.jsonl", records)))
    loss, _, headroom = fig.axes

    def dots(ax):
        return sorted(float(v) for line in ax.lines if line.get_marker() == "o" for v in line.get_ydata())

    assert dots(loss) == [1.0, 6.0, 11.0, 16.0]
    assert dots(headroom) == [pytest.approx(5.0)] * 10  # percent of the largest finite value


def test_damaged_or_extreme_files_are_refused_by_name_not_a_traceback(tmp_path, capsys):
    """Session 44's probe: a record cut off before any whole one was "not JSON" (not said to be cut
    off); an integer past float64's range and losses of +-1e308 (the axes' span overflows) were tracebacks
    with exit 1."""
    path = tmp_path / "run.jsonl"
    header = json.dumps({"nanfast": "0.1.0"}) + "\n"
    path.write_text(header + '{"step": 0, "loss": 0.7, "losses": {"lo')
    assert cli.main(["plot", str(path), "-o", str(tmp_path / "x.png")]) == 2
    assert "no per-step records" in capsys.readouterr().err
    path.write_text(header + '{"step": 0, "loss": 1' + "0" * 400 + "}\n")
    assert cli.main(["plot", str(path), "-o", str(tmp_path / "x.png")]) == 2
    assert "'loss' is a number past float64's range" in capsys.readouterr().err
    path.write_text(header + '{"step": 0, "loss": 1e308}\n{"step": 1, "loss": -1e308}\n')
    assert cli.main(["plot", str(path), "-o", str(tmp_path / "x.png")]) == 2
    assert "cannot draw it" in capsys.readouterr().err
