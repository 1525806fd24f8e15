"""The CUDA kernels of torch.ops.nanfast.stats / any_nonfinite: the same inputs (views, sign bits and
the memory around them included) on CUDA and on CPU give the same results, which match the float64
reference; launches, streams and host syncs.

Each kernel test runs on two backends: `gpu` (skipped without one) and `emulated`, the same
csrc/cuda/stats_cuda.cu built for the CPU emulation of the CUDA execution model (tests/cuda_emulation),
which runs in every CI run. CUDA-only properties (streams, host syncs, graphs, devices) are GPU-only.
NANFAST_TEST_HUGE=1 adds the emulated 2^31-element case (slow, ~5 GB of memory)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import cuda_emulation
import pytest
import torch
from reference import MX_DTYPES, assert_stats_match, reference_any_nonfinite

import nanfast

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# csrc/cuda/stats_cuda.cu: elements per chunk (one block each), the tensors one launch takes, and the
# dimensions a view may keep after merging. A 16-byte load holds 16 / itemsize elements.
K_CHUNK = 65536  # kChunkElements
K_BATCH_TENSORS = 128  # kBatchTensors
K_MAX_DIMS = 16  # kMaxDims

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
FLOAT8_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.float8_e4m3fnuz)
COMPLEX_DTYPES = (torch.complex128, torch.complex64, torch.complex32)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
              torch.uint64, torch.bool)
ALL_DTYPES = FLOAT_DTYPES + FLOAT8_DTYPES + COMPLEX_DTYPES + INT_DTYPES + MX_DTYPES
REAL_DTYPE = {torch.complex128: torch.float64, torch.complex64: torch.float32, torch.complex32: torch.float16}
# Where the reference can resolve a negative view: torch has a neg kernel, or (MX) it decodes the bytes.
# Unsigned ones are refused (their values wrap around): see test_negative_view_of_an_unsigned_tensor.
NEG_VIEW_DTYPES = FLOAT_DTYPES + COMPLEX_DTYPES + (torch.int8, torch.int16, torch.int32, torch.int64) + MX_DTYPES
NONFINITE = (math.nan, math.inf, -math.inf)
EDGE_SIZES = (0, 1, 15, 17, K_CHUNK - 1, K_CHUNK + 1, 2 * K_CHUNK + 3)


@dataclass(frozen=True)
class Backend:
    """Where the CUDA kernels run: their ops, and the device their inputs and outputs are on."""

    name: str
    device: torch.device
    stats: Callable
    any_nonfinite: Callable


def current_gpu() -> torch.device:
    """The current GPU with its index: a tensor's device has one, and torch.device("cuda") != "cuda:0"."""
    return torch.device("cuda", torch.cuda.current_device())


def gpu_backend() -> Backend:
    return Backend("gpu", current_gpu(), torch.ops.nanfast.stats, torch.ops.nanfast.any_nonfinite)


@pytest.fixture(scope="module", params=["gpu", "emulated"])
def backend(request) -> Backend:
    if request.param == "gpu":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        return gpu_backend()
    ops = cuda_emulation.ops_for_test()
    return Backend("emulated", torch.device("cpu"), ops.stats, ops.any_nonfinite)


@pytest.fixture
def emulated(backend) -> Backend:
    """The emulated backend only, for what the emulation can observe (launch counts, thread orders)."""
    if backend.name != "emulated":
        pytest.skip("observes the emulation")
    yield backend
    order, seed = os.environ.get("NANFAST_CUDA_EMU_ORDER", "forward"), os.environ.get("NANFAST_CUDA_EMU_SEED", "0")
    torch.ops.nanfast_emu.configure(order, int(seed))  # the order the run was started with


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t's view (sizes, strides, offset, conjugate and negative bits) over a copy of its whole storage on
    `device`: the memory around the view travels too, so reading outside the view would show. On the
    CPU (the emulation) t itself: the kernels read the very memory the CPU kernels read."""
    if t.device == device:
        return t
    raw = torch._neg_view(t) if t.is_neg() else t
    raw = raw.conj() if raw.is_conj() else raw
    storage = torch.UntypedStorage(raw.untyped_storage().nbytes(), device=device)
    storage.copy_(raw.untyped_storage())
    out = torch.empty(0, dtype=raw.dtype, device=device)
    out.set_(storage, raw.storage_offset(), raw.shape, raw.stride())
    out = out.conj() if t.is_conj() else out
    return torch._neg_view(out) if t.is_neg() else out


def on_cuda(t: torch.Tensor) -> torch.Tensor:
    return on_device(t, current_gpu())


def check_matches_cpu(backend: Backend, cpu_list: list[torch.Tensor]) -> None:
    """On `backend`, counts and absmax equal the CPU kernels' and norms agree to 1e-6; on the GPU both
    match the reference too (the emulation leaves that to test_ops.py, which holds the CPU kernels to
    it: the reference is most of the time of these tests, and CI runs them emulated)."""
    device_list = [on_device(t, backend.device) for t in cpu_list]
    counts, norm, absmax = backend.stats(device_list)
    assert counts.device == norm.device == absmax.device == backend.device
    if backend.name == "gpu":
        assert_stats_match(counts, norm, absmax, cpu_list)
    cpu_counts, cpu_norm, cpu_absmax = torch.ops.nanfast.stats(cpu_list)
    assert torch.equal(counts.cpu(), cpu_counts)
    assert torch.equal(absmax.cpu(), cpu_absmax)
    torch.testing.assert_close(norm.cpu(), cpu_norm, rtol=1e-6, atol=0)
    found = backend.any_nonfinite(device_list)
    assert found.device == backend.device and found.shape == () and found.dtype == torch.bool
    assert found.item() == torch.ops.nanfast.any_nonfinite(cpu_list).item()
    if backend.name == "gpu":
        assert found.item() == reference_any_nonfinite(cpu_list)


def random_tensor(n: int, dtype: torch.dtype, gen: torch.Generator, nonfinite_fraction: float = 0.01):
    """n elements of dtype over several magnitudes; NaN, +inf and -inf at about nonfinite_fraction of
    the positions where the dtype has them (a float8 type may turn some into NaN). MX dtypes: random bytes."""
    if dtype in MX_DTYPES:
        return torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).view(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype in (torch.int64, torch.uint64):
        return torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen, dtype=torch.int64).view(dtype)
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max + 1, (n,), generator=gen, dtype=torch.int64).to(dtype)
    count = 2 * n if dtype.is_complex else n
    values = torch.randn(count, generator=gen, dtype=torch.float64)
    values *= 10.0 ** torch.randint(-3, 4, (count,), generator=gen).double()
    bad = torch.rand(count, generator=gen) < nonfinite_fraction
    values[bad] = torch.tensor(NONFINITE, dtype=torch.float64)[torch.randint(0, 3, (int(bad.sum()),), generator=gen)]
    values = values.to(REAL_DTYPE.get(dtype, dtype))
    return torch.view_as_complex(values.view(n, 2)) if dtype.is_complex else values


def views_of(base: torch.Tensor) -> list[torch.Tensor]:
    """base (1-D, contiguous) and views of it: dense ones (read as one run) and others (read in place)."""
    n = base.numel()
    rows = max(1, math.isqrt(n))
    grid = base[: rows * (n // rows)].view(rows, n // rows)
    views = [base, base[1:], base[3:], grid.t(), base[1::3], grid[:, 1:], grid[1::2, ::5],
             base[: min(n, 3000)].view(-1, 1).expand(-1, 3)]
    if n:
        views.append(base[n // 2])  # 0-dim
    if n >= 5:
        views.append(base.as_strided((n - 4, 5), (1, 1)))  # overlapping rows
    signed = []
    for v in views[:3]:
        if v.dtype in NEG_VIEW_DTYPES:
            signed.append(torch._neg_view(v))
        if v.is_complex():
            signed += [v.conj(), v.conj().imag]  # conj().imag is a real view with the negative bit
    return views + signed


# --- against the CPU kernels and the reference ----------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_size_and_view(dtype, backend):
    """Sizes at chunk and 16-byte-load edges, from aligned and misaligned starts, as views of every kind."""
    gen = torch.Generator().manual_seed(0)
    for n in EDGE_SIZES:
        check_matches_cpu(backend, views_of(random_tensor(n, dtype, gen)))


@pytest.mark.parametrize("dtype", MX_DTYPES, ids=str)
def test_every_byte_of_mx_dtypes(dtype, backend):
    """The 256 byte values of float8_e8m0fnu (0xFF is NaN) and float4_e2m1fn_x2 (two fp4 values each),
    alone and in views of every kind."""
    t = torch.arange(256, dtype=torch.uint8).view(dtype)
    check_matches_cpu(backend, list(t) + views_of(t))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FLOAT8_DTYPES + (torch.complex64,), ids=str)
def test_one_nonfinite_at_each_chunk_edge(dtype, backend):
    """A single NaN, +inf or -inf at the first and last element of chunks, and of 16-byte loads."""
    n = 2 * K_CHUNK + 40
    clean = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    cases = []
    for k, position in enumerate((0, 7, 8, 15, 16, K_CHUNK - 1, K_CHUNK, K_CHUNK + 1, 2 * K_CHUNK, n - 1)):
        t = clean.clone()
        t[position] = NONFINITE[k % 3]
        cases += [t, t[1:], t[position:]]
    check_matches_cpu(backend, cases + [clean])


@pytest.mark.parametrize("count", [1, 3, K_BATCH_TENSORS - 1, K_BATCH_TENSORS, K_BATCH_TENSORS + 1, 2000])
def test_lists_of_many_tensors(count, backend):
    """Lists of mixed dtypes, sizes and views: several dtypes and several launches per call."""
    gen = torch.Generator().manual_seed(count)
    tensor_list = []
    for i in range(count):
        dtype = ALL_DTYPES[int(torch.randint(0, len(ALL_DTYPES), (), generator=gen))]
        n = EDGE_SIZES[i % 5] if i % 50 == 0 else int(torch.randint(0, 3000, (), generator=gen))
        views = views_of(random_tensor(n, dtype, gen, nonfinite_fraction=0.001))
        tensor_list.append(views[int(torch.randint(0, len(views), (), generator=gen))])
    check_matches_cpu(backend, tensor_list)


def test_empty_and_zero_dim_tensors(backend):
    check_matches_cpu(
        backend,
        [torch.tensor(math.nan), torch.empty(0), torch.tensor(3.0, dtype=torch.float64), torch.empty(0, 5).t(),
         torch.tensor(-math.inf, dtype=torch.bfloat16), torch.tensor(7, dtype=torch.int16), torch.empty(3, 0, 2)]
    )


@pytest.mark.parametrize(
    "values",
    [[1e300], [1e-300], [1e-200, 1e300], [2.0**1023, 2.0**-1074], [5e-324, 0.0], [1e-310, 3e-309]],
    ids=str,
)
def test_float64_chunks_that_need_rescaling(values, backend):
    """float64 squares beyond a double's range: a block sums its chunk a second time, rescaled. Next to
    chunks that need no rescaling, with a NaN, and as a view (the strided kernel does the same)."""
    t = torch.randn(2 * K_CHUNK + 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    chunk = t[K_CHUNK : 2 * K_CHUNK]
    chunk.fill_(values[0])
    chunk[: len(values)] = torch.tensor(values, dtype=torch.float64)
    chunk[100] = math.nan
    check_matches_cpu(
        backend,
        [t, chunk, chunk.view(-1, 1).expand(-1, 2), torch.tensor(values, dtype=torch.float64).repeat(5)]
    )


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.float16, torch.bfloat16), ids=str)
def test_subnormals_are_not_flushed(dtype, backend):
    """Built without fast math: subnormal inputs keep their values in absmax and norm."""
    tiny = torch.finfo(dtype).smallest_normal / 8
    t = torch.full((K_CHUNK + 5,), tiny, dtype=dtype)
    _, norm, absmax = backend.stats([on_device(t, backend.device)])
    assert absmax.item() == float(t[0]) > 0
    assert math.isclose(norm.item(), float(t[0]) * math.sqrt(t.numel()), rel_tol=1e-9)
    check_matches_cpu(backend, [t, t[1:]])


# --- views, read in place ------------------------------------------------------------------------


def test_views_read_only_their_elements(backend):
    """NaN fills the memory around and between the views' elements: none of it is read."""
    base = torch.full((4 * K_CHUNK + 64,), math.nan)
    grid = base[: 4 * K_CHUNK].view(512, 512)
    views = [base[1::2], grid[:, 3:200], grid[10:300:3, 1::5], grid[:, :100].t()]
    for view in views:
        view.copy_(torch.randn(view.shape))
    base[7] = 2.0
    base[4 * K_CHUNK : 4 * K_CHUNK + 40] = torch.randn(40)
    views += [base[7:8].expand(3, 5000), base[4 * K_CHUNK : 4 * K_CHUNK + 40].as_strided((31, 10), (1, 1))]
    assert base.isnan().any() and not any(v.isnan().any() for v in views)
    check_matches_cpu(backend, views)
    device_views = [on_device(v, backend.device) for v in views]
    assert backend.stats(device_views)[0].sum().item() == 0
    assert backend.any_nonfinite(device_views).item() is False


def test_view_with_more_dimensions_than_the_kernels_take(backend):
    """A view whose dimensions do not merge (odd strides: none is twice the next) is read with up to
    K_MAX_DIMS of them; one more is refused with an error naming the entry."""
    base = torch.randn(400)
    base[0] = math.inf

    def odd_strided(ndim: int) -> torch.Tensor:
        return base.as_strided((2,) * ndim, tuple(range(2 * ndim - 1, 0, -2)))

    check_matches_cpu(backend, [odd_strided(K_MAX_DIMS), odd_strided(3)])
    too_many = [torch.zeros(3, device=backend.device), on_device(odd_strided(K_MAX_DIMS + 1), backend.device)]
    for op in (backend.stats, backend.any_nonfinite):
        with pytest.raises(RuntimeError, match=r"tensors\[1\] is a view whose strides leave 17 dimensions"):
            op(too_many)


# --- launches: batching, determinism, streams, sizes -----------------------------------------------


def test_results_do_not_depend_on_batching(backend):
    """A tensor's results are the same bit for bit alone and after other tensors (which move its
    chunks to other launches and other blocks), and from call to call."""
    gen = torch.Generator().manual_seed(3)
    big = random_tensor(40 * K_CHUNK + 5, torch.float32, gen, nonfinite_fraction=1e-6)
    mid = random_tensor(3 * K_CHUNK + 1, torch.float64, gen)
    sizes = torch.randint(1, 3000, (K_BATCH_TENSORS + 5,), generator=gen).tolist()  # none empty: each takes a place
    small = [random_tensor(n, torch.float16, gen) for n in sizes]
    check_matches_cpu(backend, [big, mid] + small)
    big, mid = on_device(big, backend.device), on_device(mid, backend.device)
    small = [on_device(t, backend.device) for t in small]
    alone = backend.stats([big, mid])
    # The last: big is the last tensor of a full launch, mid the first of the next.
    orders = ([big, mid], small + [big, mid], small[:1] + [big] + small[1:50] + [mid],
              small[:K_BATCH_TENSORS - 1] + [big, mid])
    for tensor_list in orders:
        counts, norm, absmax = backend.stats(tensor_list)
        rows = [i for i, t in enumerate(tensor_list) if t is big or t is mid]
        assert torch.equal(counts[rows], alone[0])
        assert torch.equal(norm[rows].view(torch.int64), alone[1].view(torch.int64))
        assert torch.equal(absmax[rows].view(torch.int64), alone[2].view(torch.int64))


def test_negative_view_of_an_unsigned_tensor(backend):
    """A negative view of an unsigned tensor is refused, naming the entry (its values wrap around)."""
    tensors = [torch.zeros(3, device=backend.device), torch._neg_view(torch.arange(5, dtype=torch.uint8, device=backend.device))]
    for op in (backend.stats, backend.any_nonfinite):
        with pytest.raises(RuntimeError, match=r"tensors\[1\] is a negative view of an unsigned Byte tensor"):
            op(tensors)


def expected_launches(chunks: list[int]) -> tuple[int, int]:
    """[launches, blocks] of nanfast_emu.stats over dense float32 tensors of these chunk counts: the
    batching rule of launch_chunks() (a launch takes up to K_BATCH_TENSORS whole non-empty tensors, one
    block per chunk), then one finishing block per tensor, 480 tensors a launch."""
    non_empty = sum(1 for count in chunks if count > 0)
    return math.ceil(non_empty / K_BATCH_TENSORS) + math.ceil(len(chunks) / 480), sum(chunks) + len(chunks)


@pytest.mark.parametrize(
    "chunks",
    [[1] * (K_BATCH_TENSORS + 1), [300], [3, 200, 1, 2], [2, 0] * K_BATCH_TENSORS, [1] * 500, [0, 0, 1, 0]],
    ids=["tensors+1", "one-big", "uneven", "pairs-and-empties", "480+finish", "empty"],
)
def test_launch_batching(emulated, chunks):
    """More tensors than one launch's ChunkBatch holds, and tensors of many chunks: the launches the
    batching rule plans (each block finds its tensor among the batch's), and results equal to the CPU
    kernels'."""
    gen = torch.Generator().manual_seed(len(chunks))
    sizes = [max(0, (c - 1) * K_CHUNK + 1 + i % 50) for i, c in enumerate(chunks)]
    tensors = [torch.randn(n, generator=gen) for n in sizes]
    for i, t in enumerate(tensors[::7]):
        if t.numel():
            t[i * 7919 % t.numel()] = NONFINITE[i % 3]
    check_matches_cpu(emulated, tensors)
    emulated.stats(tensors)
    assert torch.ops.nanfast_emu.last_launches() == list(expected_launches(chunks))


@pytest.mark.parametrize("order", ["reverse", "shuffled"])
def test_thread_and_block_orders(emulated, order):
    """The results do not depend on the order in which threads and blocks run (bit for bit), and match
    the CPU kernels under every order."""
    gen = torch.Generator().manual_seed(5)
    tensors = [random_tensor(3 * K_CHUNK + 7, torch.float64, gen), random_tensor(K_CHUNK, torch.float16, gen)]
    tensors += [views_of(random_tensor(2000, torch.bfloat16, gen))[k] for k in (1, 4, 6)]
    tensors.append(torch.full((K_CHUNK + 1,), 1e300, dtype=torch.float64))  # rescaled: a uniform branch
    forward = emulated.stats(tensors)
    for seed in range(3):
        torch.ops.nanfast_emu.configure(order, seed)
        check_matches_cpu(emulated, tensors)
        for a, b in zip(emulated.stats(tensors), forward):
            assert torch.equal(a.view(torch.int64), b.view(torch.int64))


@needs_gpu
def test_runs_on_the_current_stream():
    """The op reads its inputs after the work queued before it on the current stream."""
    t = on_cuda(random_tensor(5 * K_CHUNK, torch.float16, torch.Generator().manual_seed(4)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # keeps `stream` busy: a kernel on another stream would read t first
        t.mul_(2)
        counts, norm, absmax = torch.ops.nanfast.stats([t])
        found = torch.ops.nanfast.any_nonfinite([t])
    stream.synchronize()
    cpu_counts, cpu_norm, cpu_absmax = torch.ops.nanfast.stats([t.cpu()])
    assert torch.equal(counts.cpu(), cpu_counts) and torch.equal(absmax.cpu(), cpu_absmax)
    torch.testing.assert_close(norm.cpu(), cpu_norm, rtol=1e-6, atol=0)
    assert found.item() is True


def test_more_than_2_31_elements(backend):
    """64-bit indexing: values past element 2^31, dense (float8) and as a strided view read in place
    (overlapping rows: expanded dimensions would be read once). Emulated only with NANFAST_TEST_HUGE=1."""
    if backend.name == "emulated" and os.environ.get("NANFAST_TEST_HUGE") != "1":
        pytest.skip("slow on the CPU emulation: set NANFAST_TEST_HUGE=1")
    n = 2**31 + 4096
    positions = torch.tensor([3, 2**31 + 100, 2**31 + 5, 2**31 + 77, n - 1], device=backend.device)
    values = torch.tensor([-3.0, 2.0, math.nan, math.inf, -math.inf]).to(torch.float8_e5m2)
    dense = torch.zeros(n, dtype=torch.uint8, device=backend.device)  # set as bytes: no float8 kernels needed
    dense[positions] = values.view(torch.uint8).to(backend.device)
    dense = dense.view(torch.float8_e5m2)
    base = torch.ones(2**30 + 2, dtype=torch.float16, device=backend.device)
    base[2**30 - 1] = math.nan  # element (i, j) of the view is base[i + j]: the NaN is at 3 places near the end
    overlapping = base.as_strided((2**30, 3), (1, 1))  # 3 * 2^30 elements
    counts, norm, absmax = backend.stats([dense, overlapping])
    assert counts.tolist() == [[1, 1, 1], [3, 0, 0]]
    assert absmax.tolist() == [3.0, 1.0]
    assert math.isclose(norm[0].item(), math.sqrt(13), rel_tol=1e-12)
    assert math.isclose(norm[1].item(), math.sqrt(3 * 2**30 - 3), rel_tol=1e-9)
    assert backend.any_nonfinite([dense]).item() is True
    assert backend.any_nonfinite([dense[: 2**31]]).item() is False


def test_any_nonfinite_with_integers_and_the_last_element(backend):
    ints = [torch.arange(K_CHUNK + 3, device=backend.device).to(dtype) for dtype in INT_DTYPES]
    t = torch.zeros(3 * K_CHUNK + 1, device=backend.device)
    assert backend.any_nonfinite(ints + [t]).item() is False
    t[-1] = math.inf
    assert backend.any_nonfinite(ints + [t]).item() is True
    assert backend.any_nonfinite([t[:-1]]).item() is False
    assert backend.any_nonfinite(ints + [t[:-1], t[-1:].expand(4, 2)]).item() is True


# --- op contract -----------------------------------------------------------------------------------


def opcheck_inputs():
    t = torch.randn(5, 7, device="cuda")
    t[1, 2] = math.nan
    cuda = torch.device("cuda")
    return {
        "one": [torch.randn(3, device=cuda)],
        "mixed": [t, t.t(), t[:, ::2], torch.arange(4, device=cuda), torch.randn(2, dtype=torch.complex64, device=cuda),
                  torch.empty(0, device=cuda)],
        "half": [torch.randn(K_CHUNK + 3, device=cuda).bfloat16(),
                 torch.full((2,), math.inf, dtype=torch.half, device=cuda)],
        "requires_grad": [torch.randn(4, device=cuda, requires_grad=True), torch.randn(3, device=cuda)],
    }


@needs_gpu
@pytest.mark.parametrize("name", ["one", "mixed", "half", "requires_grad"])
@pytest.mark.parametrize("op", [torch.ops.nanfast.stats.default, torch.ops.nanfast.any_nonfinite.default])
def test_opcheck(op, name):
    torch.library.opcheck(op, (opcheck_inputs()[name],))


@needs_gpu
def test_no_host_sync(op_recorder):
    """No sync inside the ops: CUDA's sync debug mode raises on one, and the recorder counts .item()s.
    The inputs take every path: batches, views, float64, integers, negative and conjugate bits."""
    z = torch.randn(300, dtype=torch.complex64, device="cuda")
    tensor_list = [torch.randn(2 * K_CHUNK + 1, device="cuda"), torch.randn(40, 30, device="cuda")[:, ::3],
                   torch.tensor([math.nan, math.inf], dtype=torch.float64, device="cuda"),
                   torch.arange(5, device="cuda"), z.conj(), z.conj().imag,
                   torch._neg_view(torch.randn(7, device="cuda"))] + [torch.randn(3, device="cuda")] * 200
    nanfast.stats(tensor_list)  # the first calls set up the allocator's pools: not the op's doing
    nanfast.any_nonfinite(tensor_list)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with op_recorder() as ops:
            s = nanfast.stats(tensor_list)
            found = nanfast.any_nonfinite(tensor_list)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ops.counts["nanfast.stats.default"] == 1 and ops.counts["nanfast.any_nonfinite.default"] == 1
    assert ops.host_syncs == 0
    assert found.item() is True and s.counts.sum().item() == 2


@needs_gpu
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_stats_over_several_devices_keep_the_input_order(device):
    """nanfast._C.stats_on (the watch's fused pass and its recorder): one call per device, each row back
    at its input's position, every result on `device`."""
    tensors = [torch.tensor([1.0, math.nan]), torch.tensor([-math.inf, 3.0], device="cuda"),
               torch.tensor([math.inf, 4.0], dtype=torch.float64), torch.tensor([2.0, 0.5], device="cuda")]
    counts, norm, absmax = nanfast._C.stats_on(tensors, torch.device(device))
    assert counts.device.type == norm.device.type == absmax.device.type == device
    expected = torch.ops.nanfast.stats([t.cpu() for t in tensors])
    assert torch.equal(counts.cpu(), expected[0]) and torch.equal(absmax.cpu(), expected[2])
    torch.testing.assert_close(norm.cpu(), expected[1], rtol=1e-12, atol=0)
