"""_C.BufferSlots: the undo's walks over a model's buffers in C++ (NOTE: [Buffers read in one loop]): each
slot's tensor and version counter, and which slots a step re-assigned or changed in place."""

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
