"""Shared test setup: hypothesis profiles, fixtures that restore global state, and an op recorder.

Hypothesis profiles (HYPOTHESIS_PROFILE picks one; the default is "ci" when CI=true, else "dev"):
  ci        derandomized, so a CI failure reproduces exactly; no deadline (2 shared cores are slow)
  dev       random examples, same budget
  thorough  many more examples, for a long local run"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import nanfast
from op_recorder import OpRecorder

# Building tensors of up to ~10^5 elements inside a strategy is legitimately slower than hypothesis expects,
# and the function-scoped fixtures below only restore global state once the whole test is over.
_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile("ci", max_examples=60, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=60, **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") == "true" else "dev"))



@pytest.fixture
def restore_cpu_isa():
    """Restores the CPU kernels' instruction set and prefetch setting a test changes with
    nanfast._C.set_cpu_isa and nanfast._C.set_cpu_prefetch."""
    isa, prefetch = nanfast._C.cpu_isa(), nanfast._C.cpu_prefetch()
    yield isa
    nanfast._C.set_cpu_isa(isa)
    nanfast._C.set_cpu_prefetch(prefetch)


@pytest.fixture
def restore_num_threads():
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


@pytest.fixture
def op_recorder():
    return OpRecorder


@pytest.fixture(params=[False, True], ids=["counts on host", "counts as tensors"])
def recorder_counts(request, monkeypatch):
    """Runs a test with the watch's recorder keeping each record's counts as numbers on the host, as a
    CPU watch does, and as the tensors its calls gave, as a GPU watch does (Records::counts_on_host in
    csrc/python/watch_records.h): the device's bookkeeping, run on a CPU."""
    if request.param:
        monkeypatch.setattr(nanfast._C, "WatchRecorder", functools.partial(nanfast._C.WatchRecorder, counts_as_tensors=True))
    return request.param
