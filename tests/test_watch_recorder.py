"""The watch's recorder (nanfast._C.WatchRecorder) and the calls its step end makes: the counts each
record leaves, as take() hands them over (on CPU kept as numbers: NOTE: [CPU counts kept as numbers]),
the headroom limits of the pass (_C.limits_of) and the pass's call under grad mode."""

import random

import pytest
import torch

from nanfast import _C
from nanfast.watcher import headroom
from reference import assert_stats_match, reference_stats


def planted(numel: int, rng: random.Random, dtype=torch.float32) -> torch.Tensor:
    """Random values with a few NaN, +inf and -inf at random places (none in some tensors)."""
    t = torch.randn(numel, generator=torch.Generator().manual_seed(rng.randrange(2**31))).to(dtype)
    for value in (float("nan"), float("inf"), float("-inf")):
        for _ in range(rng.randrange(3)):
            t[rng.randrange(numel)] = value
    return t


def reference_counts(tensors: list[torch.Tensor]) -> list[list[int]]:
    return [reference_stats(t).counts for t in tensors]


@pytest.mark.parametrize("fuse_bytes", [0, 1 << 20], ids=["at-once", "fused"])
def test_take_hands_over_every_records_counts_in_order(fuse_bytes):
    rng = random.Random(fuse_bytes)
    rec = _C.WatchRecorder(torch.device("cpu"), False, fuse_bytes)
    expected, slots = [], []
    for slot in range(40):
        tensors = [planted(rng.randrange(1, 3000), rng) for _ in range(rng.randrange(1, 4))]
        rec.record(tensors, slot)
        expected += reference_counts(tensors)
        slots.append((slot, len(tensors)))
    parts, _, got_slots, absmax, limited = rec.take()
    counts = torch.cat(parts)
    assert counts.dtype == torch.int64 and counts.shape == (len(expected), 3)
    assert counts.tolist() == expected and got_slots == slots
    assert absmax is None and limited == []
    empty, _, no_slots, _, _ = rec.take()  # the next step starts with nothing
    assert [part.shape for part in empty] == [(0, 3)] and no_slots == []


def test_take_leaves_out_discarded_records():
    rng = random.Random(1)
    rec = _C.WatchRecorder(torch.device("cpu"))
    kept = [[planted(100, rng)], [planted(50, rng), planted(7, rng)]]
    for slot, tensors in enumerate(kept):
        rec.record(tensors, slot)
    rec.record([planted(80, rng)], 2)  # a forward that raised: its records go
    rec.record([planted(9, rng), planted(9, rng)], 3)
    rec.discard(2)
    counts, _, slots, _, _ = rec.take()
    assert torch.cat(counts).tolist() == reference_counts([t for ts in kept for t in ts])
    assert slots == [(0, 1), (1, 2)]


def test_records_are_read_when_made():
    """The counts are those of the values when recorded: a later in-place change does not alter them."""
    rec = _C.WatchRecorder(torch.device("cpu"))
    t = torch.zeros(10)
    t[3] = float("nan")
    rec.record([t], 0)
    t.fill_(float("inf"))
    counts, _, _, _, _ = rec.take()
    assert torch.cat(counts).tolist() == [[1, 0, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.float8_e4m3fn, torch.float8_e5m2, torch.int32])
def test_limits_of_matches_the_python_table(dtype):
    t = torch.zeros(3, dtype=dtype)
    fp32 = torch.zeros(2)
    limit = headroom.LIMITS.get(dtype, 0.0)
    if limit:
        assert _C.limits_of([fp32, t, fp32]) == [0.0, limit, 0.0]
    else:  # no row needs one: nothing to carry
        assert _C.limits_of([fp32, t]) == []


def test_the_pass_call_under_grad_mode_makes_no_graph():
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    with torch.enable_grad():
        counts, norm, absmax = _C.stats_on(params, torch.device("cpu"))
        assert torch.is_grad_enabled()  # the call's own no-grad ends with it
    assert not norm.requires_grad and norm.grad_fn is None and not absmax.requires_grad
    assert_stats_match(counts, norm, absmax, [p.detach() for p in params])


def test_a_device_recorder_takes_one_calls_records_as_one_view():
    """NOTE: [Records taken as views]: on a device (meta here: the same code path as CUDA, without
    values) each record keeps its call's whole results and its first row; take() joins adjacent rows of
    one call into one view and hands the counts over as one view per call, in execution order, so a
    fused step's records come out without a cat (a launch on a GPU) however many calls checked them;
    the max |x| of low-precision records that span calls are joined by one cat."""
    from op_recorder import OpRecorder

    meta = torch.device("meta")

    def records(recorder, sizes, dtype=torch.float32):
        for slot, n in enumerate(sizes):
            recorder.record([torch.empty(k + 1, device=meta, dtype=dtype) for k in range(n)], slot)

    fused = _C.WatchRecorder(meta, False, 1 << 20)
    records(fused, [1, 2, 3])
    counts, norm, _ = fused.stats_with_deferred([torch.empty(5, device=meta)] * 2, meta)
    assert counts.shape == (2, 3) and norm.shape == (2,)  # the pass's own rows
    with OpRecorder() as ops:
        packed, _, slots, absmax, limited = fused.take()
    assert [part.shape for part in packed] == [(6, 3)] and slots == [(0, 1), (1, 2), (2, 3)]
    assert absmax is None and limited == []
    assert dict(ops.counts) == {"aten.slice.Tensor": 1}  # rows 0-5 of the pass's call: one view

    bounded = _C.WatchRecorder(meta, False, 8)  # 8 bytes: records 0 and 1 (1 + 3 bfloat16 values) reach it
    with OpRecorder() as ops:
        records(bounded, [1, 2, 1], dtype=torch.bfloat16)
        packed, _, slots, absmax, limited = bounded.take()
    assert [part.shape for part in packed] == [(3, 3), (1, 3)] and slots == [(0, 1), (1, 2), (2, 1)]
    assert absmax.shape == (4,) and [slot for slot, _ in limited] == [0, 1, 1, 2]
    # The bound's call (records 0 and 1: whole) and the take's (record 2: whole): the counts as they
    # are, the max |x| joined by one cat.
    assert ops.counts["aten.cat.default"] == 1 and ops.counts["nanfast.stats.default"] == 2
    assert "aten.slice.Tensor" not in ops.counts

    at_once = _C.WatchRecorder(meta, False, 0)
    records(at_once, [2, 1])
    with OpRecorder() as ops:
        packed, _, slots, _, _ = at_once.take()
    assert [part.shape for part in packed] == [(2, 3), (1, 3)] and not ops.counts  # one part per call, no op
