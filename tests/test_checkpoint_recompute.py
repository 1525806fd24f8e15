"""Activation checkpointing (torch.utils.checkpoint) re-runs forward ops inside backward: locate labels
them as recomputed, not as backward ops of the node that needed their values."""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import nanfast

_SOURCE = pathlib.Path(__file__).read_text().splitlines()


def line(marker: str) -> int:
    [hit] = [i for i, text in enumerate(_SOURCE, 1) if text.endswith(f"# <{marker}>")]
    return hit


def block(x):
    y = torch.log(x)  # <checkpointed-log>
    return y * y  # its backward needs log(x): the recomputation runs log again


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_locate_labels_the_recomputed_op(use_reentrant):
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    with nanfast.locate(action="record") as region:
        checkpoint(block, x, use_reentrant=use_reentrant).sum().backward()
    forward, recomputed = region.findings[:2]
    assert (forward.op, forward.phase) == ("aten.log.default", "forward")
    assert (recomputed.op, recomputed.phase, recomputed.node) == ("aten.log.default", "recompute", None)
    assert recomputed.where.lineno == line("checkpointed-log") and recomputed.where.filename == __file__
    assert "recomputed in backward (activation checkpointing)" in recomputed.summary()
    assert all(f.phase != "backward" or f.node != "MulBackward0" for f in region.findings)


def test_locate_entered_for_backward_only_finds_the_fault_in_the_recomputation():
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    loss = checkpoint(block, x, use_reentrant=False).sum()
    with pytest.raises(nanfast.NonFiniteError, match="recomputed in backward") as raised:
        with nanfast.locate():
            loss.backward()
    finding = raised.value.report
    assert (finding.op, finding.phase, finding.where.lineno) == ("aten.log.default", "recompute", line("checkpointed-log"))
