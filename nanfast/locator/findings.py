"""What `locate` reports: the finding (LocateFinding), the tensors it describes (TensorInfo) and the
op that wrote each input (Producer), with their text and dict forms."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

from .source import SourceLine

RECOMPUTED = "recomputed in backward (activation checkpointing)"


class Producer(NamedTuple):
    """The op that last wrote a tensor's storage under `locate`. For a backward op, `source` is where
    the forward op of its autograd node ran (the line the user wrote); for a forward op that activation
    checkpointing re-ran in backward (phase "recompute"), the line of the checkpointed code. One is made
    per op."""

    op: str
    phase: str  # "forward" | "backward" | "recompute"
    node: Optional[str]
    source: Optional[SourceLine]

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        if self.phase == "backward":
            return f"{self.op} (backward of {self.node or 'an unknown node'}, forward{where or ' line unknown'})"
        if self.phase == "recompute":
            return f"{self.op} ({RECOMPUTED}){where}"
        return f"{self.op}{where}"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One input or output of the reported op (of a nested tensor: its values(), so named). min/max are
    over its finite elements (None when it has none or is complex); `producer` (inputs only) is None for
    a tensor no op under locate wrote: data, parameters, buffers, or values made before locate was
    entered. `partial`: `producer` wrote only part of the tensor's storage in place, over values made
    before locate (`x[:, 0] = 0` on a batch), and the rest still counts as from outside."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    nan: int
    posinf: int
    neginf: int
    min: Optional[float]
    max: Optional[float]
    producer: Optional[Producer] = None
    partial: bool = False

    @property
    def nonfinite(self) -> int:
        """NaN, +inf and -inf elements together."""
        return self.nan + self.posinf + self.neginf

    def describe(self, with_producer: bool) -> str:
        """One line: name, shape, dtype, counts and finite range.

        Args:
            with_producer: also name the op that wrote it (inputs), or that no op under locate did.
        Returns:
            The line.
        """
        text = f"{self.name}: {list(self.shape)} {self.dtype} nan={self.nan} +inf={self.posinf} -inf={self.neginf}"
        if self.min is not None:
            text += f" min={self.min:.6g} max={self.max:.6g}"
        if with_producer:
            outside = "not made by an op locate saw (data, a parameter or buffer, or a compiled region's kernels)"
            if self.producer is None:
                text += f" <- {outside}"
            elif self.partial:
                text += f" <- partly written by {self.producer}; the rest {outside}"
            else:
                text += f" <- {self.producer}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (shape a list, producer its text).

        Returns:
            A dict keyed by field name.
        """
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["producer"] = str(self.producer) if self.producer else None
        return d


@dataclasses.dataclass(frozen=True)
class LocateFinding:
    """What `locate` found. kind "producer": `op` made non-finite values its inputs did not hold (inf
    from finite inputs, or NaN from inputs without NaN). kind "scalar": `op` made non-finite values from
    a non-finite number argument (`x * nan`, `torch.full(..., nan)`, `x + inf`) and is not one of the
    masking ops allowed an infinite one (MASKING_OPS). kind "input": `op` is the first op to consume NaN
    that no op under locate produced (dirty data, a NaN parameter).

    `phase` is "forward", "backward", or "recompute" (a forward op that activation checkpointing ran
    again in backward). `source` is where the op ran (in backward: the line that called backward, when
    the engine ran on a thread with Python frames); `forward_source` (backward only) is where the
    forward op of `node` ran; `backward_source` (backward only) is the line of the Python code autograd
    called that ran the op (a tensor or module hook, an autograd.Function's backward), None for torch's
    own backward formulas. `diagnosis`: the pattern in words, where the op and its inputs show a
    known one (nanfast.locator.diagnosis: a fully masked softmax row, division by exact zeros, ...), else None."""

    kind: str
    op: str
    phase: str
    node: Optional[str]
    source: Optional[SourceLine]
    forward_source: Optional[SourceLine]
    reason: str
    outputs: tuple[TensorInfo, ...]
    inputs: tuple[TensorInfo, ...]
    scalars: tuple[str, ...]  # the op's non-tensor arguments, as name=value
    dump: Optional[str] = None
    diagnosis: Optional[str] = None
    backward_source: Optional[SourceLine] = None

    @property
    def where(self) -> Optional[SourceLine]:
        """The user's line responsible: in backward, the line of the hook or custom backward that ran the
        op, else the forward line of the node; the op's own line in forward."""
        if self.phase == "backward":
            return self.backward_source or self.forward_source
        return self.source

    def summary(self) -> str:
        """One line: the op, its phase, the user's line responsible, the reason and the diagnosis.

        Returns:
            The line, starting "nanfast.locate: ".
        """
        phase = {"backward": f"backward of {self.node}", "recompute": RECOMPUTED}.get(self.phase, "forward")
        at = f" at {self.where}" if self.where else ""
        why = f": {self.diagnosis}" if self.diagnosis else ""
        return f"nanfast.locate: {self.op} ({phase}){at}: {self.reason}{why}"

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.phase == "backward":
            lines.append(f"  autograd node: {self.node}, forward op at {self.forward_source or 'unknown'}")
            if self.backward_source:
                lines.append(f"  run in backward by Python code autograd called (a hook, a custom backward) at "
                             f"{self.backward_source}")
            lines.append(f"  backward called at {self.source or 'unknown (autograd worker thread)'}")
        else:
            lines.append(f"  op called at {self.source or 'unknown'}")
        lines.append("  outputs:")
        lines += [f"    {o.describe(with_producer=False)}" for o in self.outputs]
        lines.append("  inputs:")
        lines += [f"    {i.describe(with_producer=True)}" for i in self.inputs] or ["    (no tensor inputs)"]
        if self.scalars:
            lines.append(f"  scalar arguments: {', '.join(self.scalars)}")
        if self.dump:
            lines.append(f"  inputs saved to {self.dump} (nanfast.replay({self.dump!r}) re-runs the op)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The finding as JSON-ready values (source lines as text, tensors as TensorInfo.to_dict).

        Returns:
            A dict keyed by field name.
        """
        return {
            "kind": self.kind, "op": self.op, "phase": self.phase, "node": self.node,
            "source": str(self.source) if self.source else None,
            "forward_source": str(self.forward_source) if self.forward_source else None,
            "backward_source": str(self.backward_source) if self.backward_source else None,
            "reason": self.reason, "outputs": [o.to_dict() for o in self.outputs],
            "inputs": [i.to_dict() for i in self.inputs], "scalars": list(self.scalars), "dump": self.dump,
            "diagnosis": self.diagnosis,
        }

