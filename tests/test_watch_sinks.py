"""The watch's `log_to` sinks when they fail or collide (found by probing in session 37): a sink that
raises is warned about and nothing else changes (the step's update, the other sinks, a NonFiniteError
being raised); two live watches cannot stream into one file."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import nanfast

NAN = float("nan")


def steps(model, opt, n, bad_at=None):
    g = torch.Generator().manual_seed(0)
    for step in range(n):
        x = torch.randn(4, 3, generator=g)
        if step == bad_at:
            x[0, 0] = NAN
        opt.zero_grad()
        F.mse_loss(model(x), torch.zeros(4, 2)).backward()
        opt.step()


def setup(**options):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, nanfast.watch(model, opt, **options)


def test_a_sink_that_raises_is_warned_about_and_changes_nothing_else(tmp_path):
    """A logger's transient error came out of optimizer.step(): that step's update was lost, and the
    sinks after it missed the record."""
    calls = []

    def flaky(values):
        calls.append(values)
        if len(calls) == 2:
            raise ConnectionError("logger unreachable")

    path = tmp_path / "run.jsonl"
    model, opt, w = setup(log_to=[flaky, path])
    torch.manual_seed(0)
    unwatched = torch.nn.Linear(3, 2)
    with pytest.warns(RuntimeWarning, match="a log_to sink raised ConnectionError: logger unreachable"):
        steps(model, opt, 4)
    steps(unwatched, torch.optim.SGD(unwatched.parameters(), lr=0.1), 4)
    assert torch.equal(model.weight, unwatched.weight)  # every update applied, the second one too
    w.remove()
    assert [json.loads(line).get("step") for line in path.read_text().splitlines()] == [None, 0, 1, 2, 3]


def test_a_sink_that_raises_does_not_hide_a_nonfinite_error(tmp_path):
    def broken(values):
        raise ValueError("logger cannot take this record")

    path = tmp_path / "run.jsonl"
    model, opt, w = setup(log_to=[broken, path])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(nanfast.NonFiniteError, match="step 2"):
            steps(model, opt, 4, bad_at=2)
    w.remove()
    assert [json.loads(line).get("step") for line in path.read_text().splitlines()] == [None, 0, 1, 2]


def test_two_watches_cannot_stream_into_one_file(tmp_path):
    """Their lines overwrote each other mid-record: a file no reader (nor `nanfast plot`) could parse."""
    path = tmp_path / "run.jsonl"
    _, _, first = setup(log_to=path)
    with pytest.raises(ValueError, match="is already written by another watch in this process"):
        setup(log_to=str(tmp_path / "." / "run.jsonl"))
    first.remove()  # its file is free again
    _, _, second = setup(log_to=path)
    second.remove()


# Session 44's probe of the timeline's files.

def test_save_onto_a_file_a_stream_is_writing_is_refused(tmp_path):
    """save() truncated the file under the stream, which wrote on at its offset: NUL bytes, and a file
    plot refused."""
    path = tmp_path / "run.jsonl"
    model, opt, w = setup(log_to=path, history=2)
    steps(model, opt, 4)
    with pytest.raises(ValueError, match="a log_to stream of this process is writing that file"):
        w.save(str(tmp_path / "." / "run.jsonl"))
    steps(model, opt, 2)
    w.remove()
    lines = path.read_text().splitlines()
    assert len(lines) == 7 and all(json.loads(line) for line in lines)  # the header and 6 records, whole


@pytest.mark.parametrize("bad", ["missing/run.jsonl", "a_directory"])
def test_a_bad_log_to_entry_leaves_the_files_before_it_as_they_were(tmp_path, bad):
    """Each entry was opened, truncating it, before a later one failed: a previous run's file was lost."""
    previous = tmp_path / "previous.jsonl"
    previous.write_text('{"nanfast": "0.1.0"}\n{"step": 0, "loss": 1.0}\n')
    (tmp_path / "a_directory").mkdir()
    with pytest.raises(OSError):
        setup(log_to=[previous, tmp_path / bad])
    assert previous.read_text() == '{"nanfast": "0.1.0"}\n{"step": 0, "loss": 1.0}\n'
