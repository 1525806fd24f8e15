"""_C.BufferSlots: the undo's walks over a model's buffers in C++ (NOTE: [Buffers read in one loop]): each
slot's tensor and version counter, and which slots a step re-assigned or changed in place."""

import pytest
import torch

from nanfast import _C


def test_state_and_changes_of_a_models_buffers():
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    bn = model[0]
    with torch.inference_mode():
        frozen = torch.zeros(2)
    bn.register_buffer("frozen", frozen)
    bn.register_buffer("absent", None)
    slots = [(m, name) for m in model.modules() for name in m._buffers]
    walk = _C.BufferSlots([m for m, _ in slots], [name for _, name in slots])
    names = [name for _, name in slots]

    tensors, versions = walk.state()
    assert all(t is m._buffers[n] for t, (m, n) in zip(tensors, slots))
    assert versions[names.index("frozen")] == versions[names.index("absent")] == -1  # not tracked
    assert versions[names.index("running_mean")] == bn.running_mean._version
    assert walk.changed(tensors, versions) == ([], [])

    bn(torch.randn(4, 3))  # the running statistics (version counters do not move: pytorch#13402) and the count
    bn.running_var.add_(1)  # in place
    bn.frozen = torch.ones(2)  # re-assigned
    del bn._buffers["num_batches_tracked"]  # removed: another object (None) than before
    reassigned, in_place = walk.changed(tensors, versions)
    assert sorted(names[i] for i in reassigned) == ["frozen", "num_batches_tracked"]
    assert [names[i] for i in in_place] == ["running_var"]

    # A module whose buffer dict is replaced whole is read through its new dict.
    bn._buffers = dict(bn._buffers, running_mean=torch.zeros(3))
    reassigned, _ = walk.changed(tensors, versions)
    assert "running_mean" in [names[i] for i in reassigned]


def test_copy_tensors_copies_each_pair_and_bumps_versions():
    """_C.copy_tensors (NOTE: [Small copies without the dispatcher]): small dense CPU pairs by memcpy, the
    rest (a strided view, a view with its negative bit, a tensor of a grain or more, a dtype change) by
    _foreach_copy_; every target holds its source's values, as copy_ leaves them, and its version moved."""
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(5, generator=gen), torch.randint(0, 9, (3,), generator=gen),  # memcpy
               torch.randn(4, 4, generator=gen).t(),  # not contiguous
               torch.randn(6, generator=gen)._neg_view(),  # the negative bit: the values are -data
               torch.randn(40_000, generator=gen),  # a grain or more: several threads
               torch.randn(3, generator=gen, dtype=torch.float64),  # into a float32 target
               torch.empty(0)]
    targets = [torch.empty_like(s, memory_format=torch.contiguous_format).resolve_neg() for s in sources]
    targets[5] = torch.empty(3)
    expected = [torch.empty_like(t).copy_(s) for t, s in zip(targets, sources)]
    versions = [t._version for t in targets]
    _C.copy_tensors(targets, sources)
    for t, e, v in zip(targets, expected, versions):
        assert torch.equal(t, e) and t._version > v
    with pytest.raises(RuntimeError, match="nanfast._C.copy_tensors: 2 targets for 1 sources"):
        _C.copy_tensors(targets[:2], sources[:1])
