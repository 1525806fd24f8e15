"""nanfast on torch.distributed, for real: processes spawned on this CPU with the gloo backend.

Starting processes costs seconds, so the scenarios run in one spawn per world size: each rank runs
every scenario and pickles what it saw (or the error it got) to a file; the tests assert on the files
of all ranks. A hang fails fast: the process group has a short timeout and the spawn a deadline."""

from __future__ import annotations

import datetime
import math
import os
import pickle
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nanfast

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")

WORLD = 2
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)
SPAWN_DEADLINE_S = 120


# ---- scenarios: run on every rank; return what the tests check ----

def _sharded_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=mesh)
    return model


def _finite_norm_and_absmax(t: torch.Tensor) -> tuple[float, float]:
    finite = t[torch.isfinite(t)].double()
    return torch.linalg.vector_norm(finite).item(), finite.abs().max().item()


def fsdp2_check_all(rank, mesh):
    """fully_shard model; rank 1 plants a NaN and a +inf in its shard of 0.weight."""
    from torch.distributed.tensor import DTensor

    model = _sharded_model(mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    if rank == 1:
        with torch.no_grad():
            local = model[0].weight.to_local()
            local[0, 0] = float("nan")
            local[1, 1] = float("inf")
    report = nanfast.check_all(model, raise_on_nonfinite=False)
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {
        "bad": [(e.name, e.shape, e.numel, e.nan, e.posinf, e.neginf) for e in report.bad],
        "local_shapes": {name: tuple(p.to_local().shape) for name, p in model.named_parameters()},
        "norms": [(e.name, e.norm, e.absmax, *_finite_norm_and_absmax(full[e.name])) for e in report.entries],
        "raised": _raises(lambda: nanfast.check_all(model)),
    }


def fsdp2_grads(rank, mesh):
    """Gradients of a sharded model are DTensors too: global norms, as torch's clip_grad_norm_ gives."""
    model = _sharded_model(mesh)
    torch.manual_seed(1 + rank)  # each rank its own batch, as in data parallel training
    model(torch.randn(4, 5)).square().sum().backward()
    report = nanfast.check_all(model, grads=True)
    full = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    reference_total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in full.values()])).item()
    s = nanfast.stats([p.grad for p in model.parameters()])
    return {
        "norms": [(e.name, e.norm, *_finite_norm_and_absmax(full[e.name])) for e in report.entries],
        "total": (report.total_norm, reference_total),
        "stats_norm": s.norm.tolist(),
        "stats_total": s.total_norm.item(),
        "stats_numel": s.numel.tolist(),
        "full_numel": [g.numel() for g in full.values()],
    }


def dtensor_placements(rank, mesh):
    """distribute_tensor directly: float64 near the top of its range (the squares would overflow),
    a replicated tensor (not counted twice), and stats / any_nonfinite on DTensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    big = torch.full((6, 3), 1e200, dtype=torch.float64)
    big[4, 2] = -float("inf")  # lands on rank 1's shard
    sharded = distribute_tensor(big, mesh, [Shard(0)])
    replicated = distribute_tensor(torch.tensor([1.0, float("nan"), 3.0]), mesh, [Replicate()])
    clean = distribute_tensor(torch.arange(10.0), mesh, [Shard(0)])
    report = nanfast.check_all({"big": sharded, "replicated": replicated, "clean": clean}, raise_on_nonfinite=False)
    local_only = clean.to_local().clone()
    if rank == 0:
        local_only.fill_(float("nan"))
    flagged = distribute_tensor(torch.zeros(10), mesh, [Shard(0)])
    flagged.to_local().copy_(local_only)
    return {
        "entries": {e.name: (e.shape, e.numel, e.nan, e.posinf, e.neginf, e.norm, e.absmax) for e in report.entries},
        "big_reference": 1e200 * math.sqrt(17),
        "any_clean": nanfast.any_nonfinite([clean]).item(),
        "any_flagged": nanfast.any_nonfinite([clean, flagged]).item(),
        "stats_counts": nanfast.stats([sharded, replicated]).counts.tolist(),
    }


SCENARIOS = [fsdp2_check_all, fsdp2_grads, dtensor_placements]


def _raises(fn):
    try:
        fn()
    except nanfast.NonFiniteError as e:
        return str(e)
    return None


def _worker(rank: int, world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for scenario in SCENARIOS:
        try:
            results[scenario.__name__] = ("ok", scenario(rank, mesh))
        except Exception:
            results[scenario.__name__] = ("error", traceback.format_exc())
        dist.barrier()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    dist.destroy_process_group()


def _spawn(world: int, tmp: str) -> list[dict]:
    context = mp.spawn(_worker, args=(world, tmp), nprocs=world, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            raise TimeoutError(f"the {world} ranks did not finish within {SPAWN_DEADLINE_S} s (a hang in a collective?)")
    results = []
    for rank in range(world):
        with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn(WORLD, str(tmp_path_factory.mktemp("dist")))


def _results(ranks, scenario):
    out = []
    for rank, results in enumerate(ranks):
        status, value = results[scenario.__name__]
        assert status == "ok", f"rank {rank}:\n{value}"
        out.append(value)
    return out


# ---- the tests ----

# float32 norms: the kernels sum squares of float32 in float within blocks of eight (the project's
# promise is 1e-6, tests/reference.py); float64 ones in double.
FLOAT32_NORM_TOL = 1e-6


def test_fsdp2_check_all_names_the_full_parameter_on_every_rank(ranks):
    results = _results(ranks, fsdp2_check_all)
    # The shards really are split: each rank holds part of 0.weight (7 rows: 4 and 3).
    assert results[0]["local_shapes"]["0.weight"] == (4, 5) and results[1]["local_shapes"]["0.weight"] == (3, 5)
    for r in results:
        assert r["bad"] == [("0.weight", (7, 5), 35, 1, 1, 0)]
        assert "0.weight" in r["raised"]
        for name, norm, absmax, ref_norm, ref_absmax in r["norms"]:
            assert norm == pytest.approx(ref_norm, rel=FLOAT32_NORM_TOL), name
            assert absmax == ref_absmax, name
    assert results[0]["norms"] == results[1]["norms"]


def test_fsdp2_gradient_norms_are_global(ranks):
    results = _results(ranks, fsdp2_grads)
    for r in results:
        for name, norm, ref_norm, _ in r["norms"]:
            assert norm == pytest.approx(ref_norm, rel=FLOAT32_NORM_TOL), name
        total, reference = r["total"]
        assert total == pytest.approx(reference, rel=FLOAT32_NORM_TOL)
        assert r["stats_total"] == pytest.approx(reference, rel=FLOAT32_NORM_TOL)
        assert r["stats_norm"] == [n for _, n, _, _ in r["norms"]]  # the same pass and reduction as check_all
        assert r["stats_numel"] == r["full_numel"]
    assert results[0]["stats_norm"] == results[1]["stats_norm"]


def test_dtensor_placements_and_float64_range(ranks):
    results = _results(ranks, dtensor_placements)
    for r in results:
        shape, numel, nan, posinf, neginf, norm, absmax = r["entries"]["big"]
        assert (shape, numel, nan, posinf, neginf) == ((6, 3), 18, 0, 0, 1)
        assert norm == pytest.approx(r["big_reference"], rel=1e-12) and absmax == 1e200
        # Replicated: every rank holds the same 3 values; the NaN is counted once.
        assert r["entries"]["replicated"][:5] == ((3,), 3, 1, 0, 0)
        assert r["entries"]["replicated"][5] == pytest.approx(math.sqrt(10), rel=FLOAT32_NORM_TOL)
        assert r["entries"]["clean"][2:5] == (0, 0, 0)
        assert r["entries"]["clean"][5] == pytest.approx(math.sqrt(285), rel=FLOAT32_NORM_TOL)
        assert r["any_clean"] is False
        assert r["any_flagged"] is True  # only rank 0's shard holds NaN: both ranks see it
        assert r["stats_counts"] == [[0, 0, 1], [1, 0, 0]]
