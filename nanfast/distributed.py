"""nanfast on `torch.distributed` as it is: a step's non-finite flag all-reduced asynchronously (so
every rank takes the same decision), the ranks' findings gathered only when a step is bad, and
DTensor (FSDP2 `fully_shard`, tensor parallel) entries checked on their local shards and reduced
over their mesh, so that counts and norms are those of the full tensor."""

from __future__ import annotations

import hashlib
import pickle
import sys
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

# A row of per-tensor results is (nan, +inf, -inf, norm, absmax), as check_all and stats lay it out:
# counts before NORM, norm and absmax from it.
NORM = 3
# Whether this torch build has torch.distributed: fixed for the process, asked once (the watch asks
# whether to agree at every step, right after the model's kernels, where each call is cold).
_AVAILABLE = dist.is_available()


def dtensor_type() -> Optional[type]:
    """torch's DTensor class if it has been imported, else None. Importing torch.distributed.tensor
    costs a second; a program that has no DTensor has not imported it, and needs no check."""
    module = sys.modules.get("torch.distributed.tensor._api")
    return None if module is None else module.DTensor


def dtensor_api() -> Any:
    """The module of DTensor's public API (placements, distribute_tensor): torch.distributed.tensor."""
    import torch.distributed.tensor as api

    return api


def is_dtensor(t: Any) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def has_dtensor(tensors: Sequence[Any]) -> bool:
    cls = dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The values of `t` this rank holds: a DTensor's local shard (after reducing any Partial
    placement), any other tensor itself."""
    return _resolve_partial(t).to_local() if is_dtensor(t) else t


def default_group(group: Optional[Any]) -> Optional[Any]:
    """The process group to agree over: `group` if given, the default group when torch.distributed is
    initialised and has more than one rank, else None (one process: nothing to agree on)."""
    if group is not None:
        return group
    if _AVAILABLE and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def all_reduce_flag_async(flag: torch.Tensor, group: Any) -> Any:
    """Starts the MAX all-reduce of `flag` (a tensor of the step's non-finite counts) in place over
    `group` and returns its Work. Nothing blocks here: wait() on the Work right before the value is
    used (on NCCL wait() only orders the current stream after the collective; the host reads the flag
    once after it, as it would anyway)."""
    return dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)


def _collective_device(group: Any) -> torch.device:
    """Where the tensors of a host collective over `group` live: the current CUDA device on NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def any_rank(value: bool, group: Any) -> bool:
    """Whether `value` is true on any rank of `group`: a host collective (one small all-reduce and its
    read), for a decision that a rank's own state would make differently from the others' (see NOTE:
    [Decisions that only one rank can see]); every rank must call it at the same point."""
    device = _collective_device(group)
    flag = torch.tensor([1 if value else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def gather_objects(obj: Any, group: Any) -> list:
    """Every rank's `obj`, in group-rank order. A host collective: only for a bad step, which every
    rank knows to be bad from the reduced flag, so all of them call it.

    Pickled bytes travel in uint8 tensors (sizes first, then the padded payloads): torch's
    all_gather_object converts them back through numpy, which a user of nanfast may not have."""
    device = _collective_device(group)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    lengths = [int(size.item()) for size in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [pickle.loads(bytes(t[:n].cpu().tolist())) for t, n in zip(gathered, lengths)]


# NOTE: [Global statistics of a DTensor]
# Each rank runs the fused pass over its local shard, like any other tensor. Then, per process group
# (not per tensor), two small all-reduces over the mesh dimensions on which the DTensor is sharded:
# MAX of [norm, absmax], then SUM of [nan, +inf, -inf, (norm / max norm)^2]. The global norm is
# max norm * sqrt(sum): a float64 tensor's norm can be near the float64 maximum, and its square would
# overflow, so the squares are summed relative to the largest. On mesh dimensions where the DTensor is
# replicated every rank holds the same values: nothing is reduced there (the counts stay those of one
# copy). A Partial (pending-reduction) DTensor is redistributed to Replicate first: its local values
# are not the tensor's values.


def _reduce_dims(t: Any) -> list[int]:
    shard = dtensor_api().Shard
    return [d for d, placement in enumerate(t.placements) if isinstance(placement, shard)]


def _resolve_partial(t: Any) -> Any:
    """`t` with its Partial placements reduced (a collective of its own; sharded and replicated DTensors,
    FSDP2's parameters and gradients, need none)."""
    api = dtensor_api()
    if any(isinstance(p, api.Partial) for p in t.placements):
        return t.redistribute(placements=[api.Replicate() if isinstance(p, api.Partial) else p for p in t.placements])
    return t


def _groups_of(tensors: Sequence[torch.Tensor]) -> dict[Any, list[int]]:
    """The process groups the DTensor entries of `tensors` are sharded over, each with the positions of
    its entries, both in the order the tensors come."""
    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        if is_dtensor(t):
            for d in _reduce_dims(t):
                groups.setdefault(t.device_mesh.get_group(d), []).append(i)
    return groups


# NOTE: [Ranks that pass different DTensors]
# The reductions add rows by position: they are right only where every rank of a group passes the same
# DTensors in the same order. A rank that listed its entries in another order (a dict built from a set;
# {"a", "b"} on one rank, {"b", "a"} on another) made check_all put one entry's NaN in another's row and
# name it there, on every rank, silently; with entries of different numbers, the reductions' sizes
# disagree (a probe, session 53). So check_all, which reads its rows anyway, first agrees on a
# fingerprint of each group's entries (names, shapes, dtypes, placements): the MAX all-reduce of [h, -h]
# gives h and -h back only where every rank's h is the same; every rank of a group that disagrees
# gathers the ranks' entries and raises, naming the first that differs. any_nonfinite, which makes no
# host read, carries a fingerprint of its entries as a set (order does not change a flag) in its one
# all-reduce, and says "non-finite" where the ranks' sets differ: a rank's shard it was not given was
# not read, and a check that could not look never says finite. stats, which makes no host read either
# and whose rows are by position, cannot tell: every rank must pass the same DTensors in the same order
# (check_all tells which differ). Every rank of a group must take part: a rank that passes no DTensor
# sharded over it waits in none of its collectives, and the others wait for it until the process
# group's timeout.
def _fingerprint(described: list) -> float:
    """A 52-bit hash of `described` (the same on every process, unlike hash()), exact in float64."""
    digest = hashlib.blake2b(repr(described).encode(), digest_size=8).digest()
    return float(int.from_bytes(digest, "little") >> 12)


def _describe(tensors: Sequence[torch.Tensor], indices: list[int], names: Optional[Sequence[str]] = None) -> list:
    """Each entry at `indices`: its name (if `names`), shape, dtype and placements."""
    return [((names[i],) if names is not None else ()) + (tuple(tensors[i].shape), str(tensors[i].dtype).removeprefix(
        "torch."), str(tensors[i].placements)) for i in indices]


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, without a host sync: torch.tensor(..., device=cuda) copies with
    non_blocking=False, which waits for the stream; from pageable memory a non-blocking copy is staged
    at once, so the list may go."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _agreement(described: list, device: torch.device) -> torch.Tensor:
    """The [h, -h] of `described` to all-reduce with MAX over a group: it comes back [h, -h] where every
    rank's h is the same."""
    h = _fingerprint(described)
    return _to_device([h, -h], torch.float64, device)


def _agree_on_entries(tensors: Sequence[torch.Tensor], names: Sequence[str], indices: list[int], group: Any,
                      device: torch.device) -> None:
    """Raises ValueError on every rank of `group` unless every rank passes the same DTensor entries
    there, naming the first that differs (see NOTE: [Ranks that pass different DTensors])."""
    described = _describe(tensors, indices, names)
    agreed = _agreement(described, device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    h, minus_h = agreed.tolist()
    if h == -minus_h:
        return
    every = gather_objects(described, group)
    ranks = dist.get_process_group_ranks(group)
    k = next(k for k in range(max(map(len, every))) if len({repr(e[k:k + 1]) for e in every}) > 1)
    listed = "; ".join(f"rank {rank}: " + (f"{e[k][0]!r} {e[k][1]} {e[k][2]} {e[k][3]}" if k < len(e) else "none")
                       for rank, e in zip(ranks, every))
    raise ValueError(f"nanfast.check_all: the ranks pass different DTensor entries (every rank of a mesh must pass "
                     f"the same DTensors in the same order); DTensor entry {k} sharded over the process group of "
                     f"ranks {ranks} is: {listed}")


def globalize_rows(tensors: Sequence[torch.Tensor], rows: torch.Tensor,
                   names: Optional[Sequence[str]] = None) -> torch.Tensor:
    """`rows` (float64 [len(tensors), 5]: nan, +inf, -inf, norm, absmax of each tensor's local part)
    with the rows of DTensor entries replaced by those of the full DTensor. Collectives: two per
    process group involved (three with `names`), in the order the tensors come (the same on every
    rank); none when no entry is a DTensor.

    Args:
        tensors, rows: the entries and their local rows.
        names: check_all's names of the entries: the ranks first agree on them (one host read).

    Raises:
        ValueError: with `names`, the ranks of a group pass different DTensor entries (see NOTE: [Ranks
            that pass different DTensors]), naming the first."""
    groups = _groups_of(tensors)
    if not groups:
        return rows
    if names is not None:
        for group, indices in groups.items():
            _agree_on_entries(tensors, names, indices, group, rows.device)
    rows = rows.clone()
    local_norm = rows[:, NORM].clone()
    for group, indices in groups.items():
        index = _to_device(indices, torch.int64, rows.device)
        top = rows.index_select(0, index)[:, NORM:].contiguous()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        rows[index, NORM:] = top
    # rows[:, NORM] is now the largest shard norm of each DTensor: the scale of its squares.
    scale = torch.where(torch.isfinite(rows[:, NORM]) & (rows[:, NORM] > 0), rows[:, NORM], 1.0)
    relative_sumsq = (local_norm / scale).square()
    for group, indices in groups.items():
        index = _to_device(indices, torch.int64, rows.device)
        part = torch.cat([rows.index_select(0, index)[:, :NORM], relative_sumsq.index_select(0, index)[:, None]], dim=1)
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
        rows[index, :NORM] = part[:, :NORM]
        relative_sumsq[index] = part[:, NORM]
    reduced = set(i for indices in groups.values() for i in indices)
    reduced_rows = _to_device([i in reduced for i in range(len(tensors))], torch.bool, rows.device)
    rows[:, NORM] = torch.where(reduced_rows, scale * relative_sumsq.sqrt(), local_norm)
    return rows


def globalize_flag(tensors: Sequence[torch.Tensor], flag: torch.Tensor) -> torch.Tensor:
    """`flag` (0-dim bool: any non-finite value in the local parts of `tensors`) made true on every rank
    of the meshes the DTensor entries are sharded over when it is true on one, or when the ranks pass
    different sets of DTensor entries there (see NOTE: [Ranks that pass different DTensors]): one MAX
    all-reduce per process group, no host read."""
    groups = _groups_of(tensors)
    if not groups:
        return flag
    value = flag.to(torch.float64).reshape(1)
    for group, indices in groups.items():
        agreed = torch.cat([value, _agreement(sorted(_describe(tensors, indices)), flag.device)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        value = torch.maximum(agreed[:1], (agreed[1] != -agreed[2]).to(torch.float64))
    return value[0] > 0
