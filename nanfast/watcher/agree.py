"""Agreeing across ranks (see NOTE: [Agreeing across ranks]): every rank reads the same verdict for a
step, and a bad step's event names the earliest place over all ranks."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .. import distributed
from .events import Event, phase_order
from .step import Read


def start(read: Read, process_group: Optional[Any]) -> None:
    """Starts the all-reduce of the read's flag over the ranks (nothing in a single process)."""
    group = distributed.default_group(process_group)
    if group is not None:
        # NOTE: [Agreeing across ranks]
        # The flag (summary[0]) becomes the MAX over the ranks, in place and asynchronously: every
        # rank reads the same verdict at its one read and takes the same action in the same step, so
        # no rank waits in a collective (DDP's next gradient reduction, this all-reduce) that another
        # rank left by raising. The Work is waited on right before the flag is used; only a bad step,
        # which all ranks know to be bad, gathers the ranks' places. Counts and norms stay local.
        read.agreeing = distributed.all_reduce_flag_async(read.summary[:1], group)


def with_other_ranks(process_group: Optional[Any]) -> bool:
    """Whether there are other ranks to agree with."""
    return distributed.default_group(process_group) is not None


def wait(read: Read) -> None:
    """Waits for the flag's all-reduce (on NCCL this orders the stream after it; the host waits at the
    read that follows, the one it makes anyway).

    Raises:
        RuntimeError: the all-reduce failed (on gloo, its timeout: a rank that runs no watch, or fewer
            steps, never joined it), saying so; gloo's own message names no cause."""
    if read.agreeing is None:
        return
    agreeing, read.agreeing = read.agreeing, None
    try:
        agreeing.wait()
    except RuntimeError as e:
        raise RuntimeError(
            f"nanfast.watch: the all-reduce of step {read.step}'s verdict failed ({e}): another rank failed, or never "
            "joined it. Every rank of the process group must run the watch and step with it together: a watch "
            "made on some ranks only, or a rank that made fewer steps (uneven batches), leaves the others waiting "
            "in this all-reduce until the group's timeout") from e


def any_rank(value: bool, process_group: Optional[Any]) -> bool:
    """`value` on any rank (a host collective, every rank at the same point); `value` itself in a single
    process.

    NOTE: [Decisions that only one rank can see]
    The flag's all-reduce makes every rank see the same bad step, but what a rank does about it may
    also hang on its own state: whether its forward changed a buffer in place with no copy to restore
    (a DDP branch with a BatchNorm that only this rank routed through), so that the step cannot be
    skipped; whether the buffers' starting values are known, so that a rollback snapshot can be taken.
    Decided rank by rank, one rank raised while the others skipped and waited in the next collective
    (a hang), or the ranks took snapshots at different steps and a rollback put back different states
    (replicas diverged, silently). Such decisions are made here, over all ranks: on a bad step (which
    every rank reaches together) and at a snapshot's step (every `rollback_every` checked steps), so a
    healthy step pays nothing."""
    group = distributed.default_group(process_group)
    return value if group is None else distributed.any_rank(value, group)


def local_event(step: int, places: list) -> Optional[Event]:
    """The event of this rank's places alone (the first is the earliest), or None without places."""
    return Event(step, places[0], tuple(places[1:])) if places else None


def event(step: int, places: list, process_group: Optional[Any]) -> Optional[Event]:
    """The event of a bad step, the same on every rank: each rank's places gathered, the first place the
    earliest over the ranks (ties: the lowest rank). In a single process, the first of `places`. None
    if no rank has a place to report."""
    group = distributed.default_group(process_group)
    if group is None:
        return local_event(step, places)
    import torch.distributed as dist

    gathered = distributed.gather_objects((dist.get_rank(), tuple(places)), group)
    by_rank = tuple((rank, p) for rank, p in gathered if p)
    if not by_rank:
        return None
    rank, first_places = min(by_rank, key=lambda item: (phase_order(item[1][0]), item[0]))
    return Event(step, first_places[0], first_places[1:], rank=rank, by_rank=by_rank)


def spike(step: int, local: Optional[Event], process_group: Optional[Any]) -> Optional[Event]:
    """A healthy step's spike event, the same on every rank: None where no rank saw a spike, else the
    lowest such rank's event, with its rank. One host collective per call with other ranks (made only
    for a watch whose spikes act beyond a warning), a second one on a step that spiked somewhere.

    NOTE: [A spike on one rank]
    Each rank judges its own loss and gradient norms, and in data parallel training the losses differ
    from rank to rank: a spike is often seen by one rank alone. Acted on there alone, a spike skip
    applied the step on the other ranks (the replicas diverged, silently) and a spike raise left the
    other ranks waiting in the next step's gradient reduction (a hang, a probe, session 46). So a watch
    whose spikes skip, raise or call the user asks every rank at each judged step, and all act on the
    event of the lowest rank that saw one."""
    group = distributed.default_group(process_group)
    if group is None or not distributed.any_rank(local is not None, group):
        return local
    import torch.distributed as dist

    seen = [(rank, event) for rank, event in distributed.gather_objects((dist.get_rank(), local), group)
            if event is not None]
    rank, event = min(seen, key=lambda item: item[0])
    return dataclasses.replace(event, rank=rank, detail=f"on rank {rank}: {event.detail}")


def located(finding: Optional[Any], rank: Optional[int], process_group: Optional[Any]) -> Optional[Any]:
    """An agreed event's `located`: what the re-run on `rank` (the event's first place's) found, on every
    rank; `finding` itself in a single process or for an event the ranks did not agree on (rank None).
    One host collective, on a bad step of an on_event="locate" watch.

    NOTE: [One located finding for every rank]
    Every rank re-runs a bad step, but the fault is often one rank's alone: its re-run finds the op, the
    others' stay finite and found nothing. The event is the same on every rank but for `located`, None
    on those (read as "the fault did not reproduce"; a probe, session 46). The finding of the rank the
    event's first place is from is gathered for all."""
    group = distributed.default_group(process_group)
    if group is None or rank is None:
        return finding
    import torch.distributed as dist

    gathered = dict(distributed.gather_objects((dist.get_rank(), finding), group))
    return gathered.get(rank, finding)
