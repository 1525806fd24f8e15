"""torch.ops.nanfast.stats / any_nonfinite and their Python entry points (nanfast.stats,
nanfast.any_nonfinite) on CPU, against the float64 reference in reference.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import (
    FLOAT4_E2M1FN_X2,
    FLOAT8_E8M0FNU,
    MX_DTYPES,
    assert_stats_match,
    reference_any_nonfinite,
    reference_stats,
    unsupported_dtype_tensor,
)

import nanfast

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

# Chunk sizes of the CPU path: where the kernels switch from one segment, item or register to the next.
K_SEGMENT = 4096  # kSegment, csrc/cpu/simd_body.h
K_ITEM = 16384  # kItemElements, csrc/cpu/stats_cpu.cpp
LANE_WIDTHS = (4, 8, 16, 32, 64, 128)  # elements per register (or block of 8 registers), 16 to 64 bytes

EDGE_SIZES = sorted(
    {0, 1, 2, 3}
    | {w * k + d for w in LANE_WIDTHS for k in (1, 3) for d in (-1, 0, 1)}
    | {K_SEGMENT * k + d for k in (1, 2) for d in (-1, 0, 1)}
    | {K_ITEM + d for d in (-1, 0, 1)}
    | {2 * K_ITEM + 3}
)

SMALL_EDGE_SIZES = [n for n in EDGE_SIZES if n <= 2 * K_SEGMENT + 1]

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
FLOAT8_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.float8_e4m3fnuz)
COMPLEX_DTYPES = (torch.complex128, torch.complex64, torch.complex32)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
              torch.uint64, torch.bool)
CPU_ISAS = ("avx512", "avx2", "baseline")  # best first, as nanfast._C.set_cpu_isa caps them
ALL_DTYPES = FLOAT_DTYPES + COMPLEX_DTYPES + FLOAT8_DTYPES + INT_DTYPES + MX_DTYPES

# Negative views of signed types (unsigned ones wrap around: see test_negative_view_of_unsigned_integers).
NEG_VIEW_DTYPES = FLOAT_DTYPES + COMPLEX_DTYPES + (torch.int8, torch.int16, torch.int32, torch.int64) + MX_DTYPES

NONFINITE = (math.nan, math.inf, -math.inf)
VIEWS = ("contiguous", "zero_dim", "transposed", "permuted", "step", "narrow", "rows", "expand_outer",
         "expand_inner", "overlapping")
SIGN_VIEWS = ("none", "neg", "conj", "conj_imag")


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex128: torch.float64, torch.complex64: torch.float32, torch.complex32: torch.float16}.get(
        dtype, dtype
    )


def random_values(draw, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """n float64 values in one of several regimes, relative to dtype's range."""
    finfo = torch.finfo(dtype)
    sign = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
    uniform = torch.rand(n, generator=gen, dtype=torch.float64)
    regimes = {
        "normal": lambda: torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** draw(st.integers(-3, 3)),
        "huge": lambda: sign * finfo.max * (0.25 + 0.75 * uniform),  # squares overflow the dtype
        "subnormal": lambda: sign * finfo.smallest_normal * uniform,
        "zeros": lambda: torch.zeros(n, dtype=torch.float64),
    }
    regime = draw(st.sampled_from(("normal", "huge", "subnormal", "zeros", "mixed")))
    if regime != "mixed":
        return regimes[regime]()
    parts = torch.stack([regimes[r]() for r in ("normal", "huge", "subnormal", "zeros")])
    return parts[torch.randint(0, 4, (n,), generator=gen), torch.arange(n)]


def inject_nonfinite(draw, values: torch.Tensor) -> None:
    """NaN/±inf at positions that matter to the kernels: ends, register, segment and item edges."""
    n = values.numel()
    if n == 0:
        return
    edge = st.sampled_from((K_SEGMENT, K_ITEM) + LANE_WIDTHS).flatmap(
        lambda w: st.tuples(st.integers(1, 3), st.integers(-1, 1)).map(lambda kd: w * kd[0] + kd[1])
    )
    position = st.one_of(st.just(0), st.just(n - 1), st.integers(0, n - 1), edge)
    for _ in range(draw(st.integers(0, 4))):
        values[min(draw(position), n - 1)] = draw(st.sampled_from(NONFINITE))


def random_mx(draw, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """n random bytes as an MX dtype; for float8_e8m0fnu, NaN (0xFF) anywhere, or only where injected."""
    bits = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    if dtype == FLOAT8_E8M0FNU and draw(st.booleans()):
        bits[bits == 0xFF] = 0xFE
        marks = torch.zeros(n, dtype=torch.float64)
        inject_nonfinite(draw, marks)
        bits[~torch.isfinite(marks)] = 0xFF
    return bits.view(dtype)


def random_base(draw, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A contiguous 1-D tensor of n elements of dtype, with non-finite values where the dtype has them."""
    if dtype in MX_DTYPES:
        return random_mx(draw, n, dtype, gen)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype in (torch.int64, torch.uint64):
        full = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
        return full.view(dtype) if draw(st.booleans()) else (full % 1000).to(dtype)
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max + 1, (n,), generator=gen, dtype=torch.int64).to(dtype)
    real = real_dtype(dtype)
    values = random_values(draw, 2 * n if dtype.is_complex else n, real, gen)
    inject_nonfinite(draw, values)
    values = values.to(real)
    return torch.view_as_complex(values.view(n, 2)) if dtype.is_complex else values


def split(draw, n: int) -> tuple[int, int]:
    """(a, b) with a * b <= n and both at least 1; n >= 1."""
    a = draw(st.sampled_from([d for d in (1, 2, 3, 5, 7, 64) if d <= n]))
    return a, n // a


def make_view(draw, base: torch.Tensor, view: str) -> torch.Tensor:
    """A view of `base` (1-D, contiguous) of the given kind; falls back to `base` where n is too small."""
    n = base.numel()
    if view == "zero_dim":
        return base[draw(st.integers(0, n - 1))] if n else base
    if n < 2:
        return base
    if view == "transposed":
        a, b = split(draw, n)
        return base[: a * b].view(a, b).t()
    if view == "permuted" and n >= 8:
        a, b = split(draw, n // 2)
        return base[: 2 * a * b].view(2, a, b).permute(2, 0, 1)
    if view == "step":
        return base[draw(st.integers(0, 2)) :: draw(st.sampled_from((2, 3, 7)))]
    if view == "narrow":
        start = draw(st.integers(0, n - 1))
        return base.narrow(0, start, draw(st.integers(0, n - start)))
    if view == "rows":
        a, b = split(draw, n)
        return base[: a * b].view(a, b)[:, draw(st.integers(0, b - 1)) :]
    if view == "expand_outer":
        return base.expand(draw(st.integers(1, 3)), n)
    if view == "expand_inner":
        m = min(n, 3000)
        return base[:m, None].expand(m, draw(st.integers(1, 3)))
    if view == "overlapping":
        width = draw(st.integers(1, min(n, 9)))
        return base.as_strided((n - width + 1, width), (1, 1), base.storage_offset())
    return base


def make_sign_view(draw, t: torch.Tensor) -> torch.Tensor:
    kind = draw(st.sampled_from(SIGN_VIEWS))
    if kind == "neg" and t.dtype in NEG_VIEW_DTYPES:
        return torch._neg_view(t)
    if kind == "conj" and t.is_complex():
        return t.conj()
    if kind == "conj_imag" and t.is_complex():
        return t.conj().imag  # a real view with the negative bit
    return t


@st.composite
def tensors(draw, dtypes=ALL_DTYPES, sizes=None):
    dtype = draw(st.sampled_from(dtypes))
    n = draw(sizes if sizes is not None else st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, 3000)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    base = random_base(draw, n, dtype, gen)
    if draw(st.booleans()):  # a storage offset, and a base that does not start at an aligned address
        offset = draw(st.integers(1, 65))
        padded = torch.empty(n + offset, dtype=dtype)
        padded[offset:] = base
        base = padded[offset:]
    return make_sign_view(draw, make_view(draw, base, draw(st.sampled_from(VIEWS))))


tensor_lists = st.lists(tensors(), min_size=1, max_size=6)


@st.composite
def many_small_tensors(draw):
    """Up to 2000 small tensors: many share one work item, and items cut across tensors."""
    count = draw(st.one_of(st.integers(1, 40), st.integers(1000, 2000)))
    seed = draw(st.integers(0, 2**32 - 1))
    gen = torch.Generator().manual_seed(seed)
    dtypes = draw(st.lists(st.sampled_from(ALL_DTYPES), min_size=1, max_size=4, unique=True))
    bad_fraction = draw(st.sampled_from((0.0, 0.01, 0.3)))
    out = []
    for i in range(count):
        n = int(torch.randint(0, 70, (), generator=gen)) if i % 97 else SMALL_EDGE_SIZES[i % len(SMALL_EDGE_SIZES)]
        dtype = dtypes[i % len(dtypes)]
        if dtype in MX_DTYPES:
            out.append(torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).view(dtype))
            continue
        t = torch.randn(2 * n if dtype.is_complex else n, generator=gen, dtype=torch.float64)
        if dtype.is_floating_point or dtype.is_complex:
            bad = torch.rand(t.shape, generator=gen) < bad_fraction
            t[bad] = torch.tensor(NONFINITE, dtype=torch.float64)[torch.randint(0, 3, (int(bad.sum()),), generator=gen)]
            t = t.to(real_dtype(dtype))
            out.append(torch.view_as_complex(t.view(n, 2)) if dtype.is_complex else t)
        else:
            out.append((t * 100).to(torch.int64).to(dtype))
    return out


# For tests whose examples cost ~0.5 s (thousands of tensors, or several passes): a quarter of the
# profile's examples (see conftest.py).
fewer_examples = settings(max_examples=max(5, settings().max_examples // 4))


def check_against_reference(tensor_list) -> None:
    counts, norm, absmax = torch.ops.nanfast.stats(tensor_list)
    assert_stats_match(counts, norm, absmax, tensor_list)
    expected_any = reference_any_nonfinite(tensor_list)
    assert bool(torch.ops.nanfast.any_nonfinite(tensor_list)) == expected_any
    s = nanfast.stats(tensor_list)
    assert bool(s.any_nonfinite) == expected_any
    assert bool(nanfast.any_nonfinite(tensor_list)) == expected_any
    assert torch.equal(s.counts, counts) and torch.equal(s.norm, norm) and torch.equal(s.absmax, absmax)


# --- Against the float64 reference ----------------------------------------------------------------


@given(tensor_lists)
def test_matches_reference(tensor_list):
    check_against_reference(tensor_list)


@fewer_examples
@given(many_small_tensors())
def test_many_small_tensors_match_reference(tensor_list):
    check_against_reference(tensor_list)


EDGE_POSITIONS = sorted(
    {0, 1}
    | {w * k + d for w in LANE_WIDTHS for k in (1, 8) for d in (-1, 0)}
    | {K_SEGMENT * k + d for k in (1, 2) for d in (-1, 0, 1)}
    | {K_ITEM + d for d in (-1, 0, 1)}
)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_one_nonfinite_at_each_edge_with_every_cpu_isa(restore_cpu_isa, dtype):
    """A single NaN/+inf/-inf at each register, block, segment and item edge of a contiguous tensor,
    through every ISA's fast path: counted once, in its column, and left out of the norm."""
    n = K_ITEM + 2 * K_SEGMENT + 3
    clean = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)
    for position in EDGE_POSITIONS + [n - 1]:
        for column, value in enumerate(NONFINITE):
            t = clean.clone()
            t[position] = value
            ref = reference_stats(t)
            for isa in CPU_ISAS:
                nanfast._C.set_cpu_isa(isa)
                where = (nanfast._C.cpu_isa(), position, value)
                counts, norm, absmax = torch.ops.nanfast.stats([t])
                assert counts.tolist() == [[int(c == column) for c in range(3)]], where
                assert math.isclose(norm.item(), ref.norm, rel_tol=1e-6) and absmax.item() == ref.absmax, where
                assert torch.ops.nanfast.any_nonfinite([t]).item() is True, where
    for isa in CPU_ISAS:
        nanfast._C.set_cpu_isa(isa)
        assert torch.ops.nanfast.any_nonfinite([clean]).item() is False


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + (torch.float8_e5m2,))
@pytest.mark.parametrize("n", [1, 7, K_SEGMENT + 1, K_ITEM + 1, 3 * K_ITEM + 17])
def test_norm_of_values_at_dtype_max_does_not_overflow(dtype, n):
    """The norm is exact to 1e-6 even where every square overflows the input dtype: max * sqrt(n)."""
    # float64: a 1024th of max, so that the exact norm itself is finite; its squares still overflow.
    big = torch.finfo(dtype).max / (1024 if dtype == torch.float64 else 1)
    t = torch.full((n,), big, dtype=torch.float64)
    t[::2] = -big
    t = t.to(dtype)  # filled in float64: CPU fill_ has no float8 kernel before torch 2.5
    s = nanfast.stats([t, t[1:]])
    assert s.counts.sum().item() == 0
    assert s.absmax.tolist() == [big, big if n > 1 else 0.0]
    for got, m in zip(s.norm.tolist(), (n, n - 1)):
        assert math.isclose(got, big * math.sqrt(m), rel_tol=1e-6), (got, m)
    if dtype != torch.float64:
        assert math.isclose(s.total_norm.item(), big * math.sqrt(2 * n - 1), rel_tol=1e-6)


def test_total_norm_of_float64_norms_near_max_does_not_overflow():
    """Stats.total_norm combines per-tensor norms; each is finite and so is their L2 norm (3e300 * 2)."""
    t = torch.full((1,), 3e300, dtype=torch.float64)
    s = nanfast.stats([t, t, t, t])
    assert s.norm.tolist() == [3e300] * 4
    assert math.isclose(s.total_norm.item(), 6e300, rel_tol=1e-12)


@pytest.mark.parametrize("norms", [
    [0.0, 0.0], [3.0, 4.0], [1e300, 1e300], [5e-324, 5e-324, 1e-310], [0.0, 1e-320], [math.inf, 2.0], [7.5], [],
    [2.0 ** k for k in range(-1074, 1024, 37)], [-3.0, -4.0],
], ids=["zeros", "3-4-5", "near max", "subnormal", "one subnormal", "inf", "one", "empty", "every scale", "negative"])
def test_combine_norms_is_the_norm_of_the_parts(norms):
    """combine_norms (the total of clip_grad_norm_ and of the step summary) against math.hypot, which
    neither overflows nor underflows in between: float64 norms at every scale, 0, +inf."""
    got = nanfast.ops.combine_norms(torch.tensor(norms, dtype=torch.float64))
    assert got.dtype == torch.float64 and got.dim() == 0
    expected = math.hypot(*norms)
    assert got.item() == expected if expected in (0.0, math.inf) else math.isclose(got.item(), expected, rel_tol=1e-13)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16, torch.float16))
def test_subnormal_values(dtype):
    tiny = torch.finfo(dtype).smallest_normal / 8  # a subnormal
    t = torch.full((K_SEGMENT + 5,), tiny, dtype=dtype)
    s = nanfast.stats([t])
    exact = float(t[0]) * math.sqrt(t.numel())
    assert s.absmax.item() == float(t[0]) and s.absmax.item() > 0
    assert math.isclose(s.norm.item(), exact, rel_tol=1e-6)


@pytest.mark.parametrize(
    "values",
    [[1e308], [-torch.finfo(torch.float64).max, 1.0], [2.0**1023, 2.0**-1074], [3e-309], [2.0**-1022],
     [5e-324, 0.0], [0.0] * 5 + [1e-310], [1e-300, 1e300], [1e-200, 1e-250]],
    ids=str,
)
def test_float64_extremes(values):
    """float64 values whose squares overflow or underflow a double, alone and in SIMD segments."""
    t = torch.tensor(values, dtype=torch.float64)
    check_against_reference([t, t.repeat(3), t.repeat(K_SEGMENT + 1), torch.zeros(7, dtype=torch.float64)])


def test_float64_extremes_with_flush_to_zero():
    """The rescaled pass multiplies by 1 / scale: it must stay a normal double, or flush-to-zero (set by
    torch.set_flush_denormal or by fast-math code in the process) would make it 0."""
    values = torch.tensor([1e308, -1.7e308, 3.0, 2.0**-1070], dtype=torch.float64)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        counts, norm, absmax = torch.ops.nanfast.stats([values[:1], values])
    finally:
        torch.set_flush_denormal(False)
    assert counts.abs().sum().item() == 0
    assert norm[0].item() == 1e308 and absmax.tolist() == [1e308, 1.7e308]
    assert math.isclose(norm[1].item(), math.hypot(1e308, 1.7e308), rel_tol=1e-12)


def test_complex_counts_real_and_imaginary_parts():
    z = torch.tensor([complex(1, math.inf), complex(math.nan, -math.inf), complex(3, 4)], dtype=torch.complex64)
    s = nanfast.stats([z])
    assert s.counts.tolist() == [[1, 1, 1]]
    assert math.isclose(s.norm.item(), math.sqrt(1 + 9 + 16), rel_tol=1e-7)
    assert s.absmax.item() == 4.0


def test_expanded_views_count_every_repeat():
    """Expanded dimensions are read once and counted as often as they repeat (see NOTE: [Inputs as the
    kernels see them]), alone and with complex, negative and sliced views."""
    base = torch.tensor([1.5, math.nan, -math.inf, 3.0, math.inf, -2.0])
    views = [base.expand(5, 6), base[:, None].expand(6, 7), base[1].expand(3, 2), base[::2].expand(2, 4, 3),
             torch._neg_view(base).expand(2, 6), torch.view_as_complex(base.view(3, 2)).expand(4, 3),
             base[None, 2:4, None].expand(3, 2, 5), base.expand(0, 6)]
    check_against_reference(views)
    huge = nanfast.stats([base[0].expand(2**40), base[2].expand(2**20, 2**20)])  # 2^40 elements each, one read
    assert huge.counts.tolist() == [[0, 0, 0], [0, 0, 2**40]]
    assert huge.norm.tolist() == [1.5 * 2**20, 0.0] and huge.absmax.tolist() == [1.5, 0.0]


def long_list_of_views(n: int) -> list:
    """n entries of every kind the kernels read: dense, transposed, sliced, negative, complex (and a
    slice of it, whose real view starts mid-storage), expanded and empty, with NaN and infinities."""
    gen = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        base = torch.randn(6, 5, generator=gen)
        base.view(-1)[i % 30] = (math.nan, math.inf, -math.inf, 1.0)[i % 4]
        out.append((base, base.t(), base[1:, ::2], torch._neg_view(base), torch.view_as_complex(base.view(15, 2)),
                    torch.view_as_complex(base.view(15, 2))[3:], base[0].expand(4, 5), base[:0])[i % 8])
    return out


@pytest.mark.parametrize("n", [1023, 1024, 3001])
def test_long_lists_of_views_match_reference(restore_num_threads, n):
    """From 1024 entries their data pointers are read on every thread (see NOTE: [Data pointers on every
    thread]): the results are those of the float64 reference on either side of that, on 1 and 2 threads."""
    tensors = long_list_of_views(n)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        check_against_reference(tensors)


@pytest.mark.parametrize("refused,first", [([2500], 2500), ([1600, 2500], 1600), ([1200, 1600], 1200), ([5], 5)])
def test_a_refused_data_pointer_raises_for_the_first_entry_in_order(restore_num_threads, refused, first):
    """A storage that refuses access to its data raises torch's own error for the first such entry, as a
    read in order would, though the pointers of 3000 entries are read on two threads (one each side of
    1500 in [1200, 1600])."""
    if not hasattr(torch._C, "_set_storage_data_ptr_access_error_msg"):
        pytest.skip("this torch cannot make a storage refuse access to its data (torch 2.14 can)")
    torch.set_num_threads(2)
    tensors = [torch.ones(8) for _ in range(3000)]
    for i in refused:
        torch._C._set_storage_data_ptr_access_error_msg(tensors[i].untyped_storage()._cdata, f"entry {i} refused")
    for op in (torch.ops.nanfast.stats, torch.ops.nanfast.any_nonfinite, nanfast.stats):
        with pytest.raises(RuntimeError, match=f"^entry {first} refused$"):
            op(tensors)


def test_integers_and_bools_are_finite_with_norms_of_their_values():
    ints = [torch.tensor([-3, 4], dtype=torch.int8), torch.tensor([True, False, True]),
            torch.tensor([-(2**63)], dtype=torch.int64), torch.tensor([255], dtype=torch.uint8)]
    s = nanfast.stats(ints)
    assert s.counts.abs().sum().item() == 0 and not nanfast.any_nonfinite(ints).item()
    assert s.norm.tolist() == [5.0, math.sqrt(2), 2.0**63, 255.0]
    assert s.absmax.tolist() == [4.0, 1.0, 2.0**63, 255.0]


def test_stats_attributes():
    t = torch.tensor([1.0, math.nan, math.inf, -math.inf, -math.inf, 2.0])
    u = torch.arange(4, dtype=torch.float32).view(2, 2)
    s = nanfast.stats([t, u])
    assert len(s) == 2
    assert s.nan.tolist() == [1, 0] and s.posinf.tolist() == [1, 0] and s.neginf.tolist() == [2, 0]
    assert s.nonfinite.tolist() == [4, 0] and s.any_nonfinite.item() is True
    assert s.numel.tolist() == [6, 4]
    assert math.isclose(s.total_norm.item(), math.sqrt(1 + 4 + 0 + 1 + 4 + 9), rel_tol=1e-12)
    assert nanfast.stats(u).counts.shape == (1, 3)  # a single tensor is a list of one
    assert nanfast.stats(iter([t, u])).nan.tolist() == [1, 0]  # any iterable


def test_empty_list():
    s = nanfast.stats([])
    assert len(s) == 0 and s.counts.shape == (0, 3) and s.norm.shape == (0,) and s.absmax.shape == (0,)
    assert s.any_nonfinite.item() is False and s.total_norm.item() == 0.0
    out = nanfast.any_nonfinite([])
    assert out.shape == () and out.dtype == torch.bool and out.item() is False


# --- MX dtypes: float8_e8m0fnu (scales) and float4_e2m1fn_x2 (two fp4 values per byte) -------------


def every_byte_and_views(dtype: torch.dtype) -> list[torch.Tensor]:
    """The 256 byte values as dtype, alone (0-dim) and together in views of every kind."""
    t = torch.arange(256, dtype=torch.uint8).view(dtype)
    grid = t.view(16, 16)
    views = [t, t[1:], t[:255], grid.t(), grid[:, ::3], grid[1::2, 2:], t[None].expand(3, 256),
             t.as_strided((250, 7), (1, 1)), torch._neg_view(t), torch._neg_view(grid.t())]
    return list(t) + views


@pytest.mark.parametrize("dtype", MX_DTYPES, ids=str)
def test_every_byte_of_mx_dtypes_with_every_cpu_isa(restore_cpu_isa, dtype):
    tensor_list = every_byte_and_views(dtype)
    for isa in CPU_ISAS:
        nanfast._C.set_cpu_isa(isa)
        check_against_reference(tensor_list)
        for t in tensor_list:
            assert bool(torch.ops.nanfast.any_nonfinite([t])) == reference_any_nonfinite([t]), (isa, t)


def test_float8_e8m0fnu_values_by_definition():
    """2^(e - 127) for e in 0..254; 0xFF is NaN, counted and left out of norm and absmax."""
    t = torch.arange(256, dtype=torch.uint8).view(FLOAT8_E8M0FNU)
    counts, norm, absmax = torch.ops.nanfast.stats(list(t) + [t, t[:255]])
    assert counts.tolist() == [[0, 0, 0]] * 255 + [[1, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert absmax[:255].tolist() == norm[:255].tolist() == [2.0 ** (e - 127) for e in range(255)]
    assert absmax[256:].tolist() == [2.0**127, 2.0**127]
    exact = math.sqrt(math.fsum(4.0 ** (e - 127) for e in range(255)))
    assert norm[256:].tolist() == pytest.approx([exact, exact], rel=1e-12)
    assert torch.ops.nanfast.any_nonfinite([t[:255]]).item() is False
    assert torch.ops.nanfast.any_nonfinite([t[:255], t[255]]).item() is True


def test_float4_e2m1fn_x2_values_by_definition():
    """Byte b holds the e2m1 values of its low nibble, then of its high one: 0, 0.5, 1, 1.5, 2, 3, 4, 6
    and their negatives (bit 3 is the sign), all finite. numel counts bytes, as torch does."""
    if FLOAT4_E2M1FN_X2 is None:
        pytest.skip("torch 2.8 has no copy kernel for float4_e2m1fn_x2")
    magnitudes = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    t = torch.arange(256, dtype=torch.uint8).view(FLOAT4_E2M1FN_X2)
    s = nanfast.stats(list(t) + [t])
    assert s.counts.tolist() == [[0, 0, 0]] * 257
    for b in range(256):
        low, high = magnitudes[b & 7], magnitudes[(b >> 4) & 7]
        assert s.absmax[b].item() == max(low, high), b
        assert s.norm[b].item() == pytest.approx(math.hypot(low, high), rel=1e-15), b
    assert s.absmax[256].item() == 6.0
    assert s.norm[256].item() == pytest.approx(math.sqrt(32 * 2 * sum(m * m for m in magnitudes)), rel=1e-12)
    assert s.numel[256].item() == 256
    assert torch.ops.nanfast.any_nonfinite([t]).item() is False


# --- Negative and conjugate views -----------------------------------------------------------------


def test_negative_view_swaps_infinities():
    t = torch.tensor([math.inf, math.inf, -math.inf, math.nan, 2.0])
    for view in (torch._neg_view(t), torch._neg_view(t)[::2], torch._neg_view(t.view(1, 5).expand(3, 5))):
        assert view.is_neg()
        check_against_reference([view])
    assert nanfast.stats(torch._neg_view(t)).counts.tolist() == [[1, 1, 2]]


def test_conjugate_views_count_the_imaginary_sign():
    z = torch.tensor([complex(1, math.inf), complex(-math.inf, math.inf), complex(math.nan, 2)])
    conj = z.conj()
    assert conj.is_conj()
    # conj: imaginary +inf read as -inf; real parts keep their sign.
    assert nanfast.stats(conj).counts.tolist() == [[1, 0, 3]]
    imag = conj.imag
    assert imag.is_neg()
    assert nanfast.stats(imag).counts.tolist() == [[0, 0, 2]]
    neg_conj = torch._neg_view(conj)
    for view in (conj, imag, conj.real, neg_conj, torch._neg_view(z), conj[::2]):
        check_against_reference([view])


def test_negative_view_of_unsigned_integers():
    """torch's -x of a uint8 wraps around (-1 is 255): read with those values, or refused by name."""
    t = torch._neg_view(torch.tensor([1, 0, 3], dtype=torch.uint8))
    try:
        nanfast.stats([torch.ones(2), t])
    except (ValueError, TypeError, RuntimeError) as e:
        assert "nanfast.stats" in str(e) and names_entry(str(e), 1)
    else:
        check_against_reference([torch.ones(2), t])


def test_negative_views_are_read_in_place(op_recorder):
    """NOTE [Inputs as the kernels see them] in csrc/ops.h: a view with the negative bit is read through
    its memory (+inf and -inf swapped afterwards). torch's Negative fallback would otherwise clone it
    first: a full copy of the tensor on every check."""
    z = torch.randn(100, dtype=torch.complex64)
    inputs = [torch._neg_view(torch.randn(100)), z.conj().imag, torch._neg_view(z)]
    assert all(t.is_neg() for t in inputs)
    with op_recorder() as ops:
        torch.ops.nanfast.stats(inputs)
        torch.ops.nanfast.any_nonfinite(inputs)
    assert dict(ops.counts) == {"nanfast.stats.default": 1, "nanfast.any_nonfinite.default": 1}


# --- Every CPU instruction set --------------------------------------------------------------------


def test_set_cpu_isa_caps_at_the_best_supported(restore_cpu_isa):
    best = nanfast._C.set_cpu_isa("avx512")  # asking for more than the processor has keeps its best
    assert best in CPU_ISAS
    for isa in CPU_ISAS:
        expected = CPU_ISAS[max(CPU_ISAS.index(isa), CPU_ISAS.index(best))]
        assert nanfast._C.set_cpu_isa(isa) == expected
        assert nanfast._C.cpu_isa() == expected
    with pytest.raises(RuntimeError, match="set_cpu_isa's isa is 'sse9', not a CPU instruction set"):
        nanfast._C.set_cpu_isa("sse9")
    assert nanfast._C.cpu_isa() == CPU_ISAS[-1]  # a refused value changes nothing


@fewer_examples
@given(st.lists(tensors(dtypes=FLOAT_DTYPES + (torch.complex64,) + MX_DTYPES), min_size=1, max_size=4))
def test_every_cpu_isa_matches_reference(restore_cpu_isa, tensor_list):
    results = []
    for isa in CPU_ISAS:
        nanfast._C.set_cpu_isa(isa)
        counts, norm, absmax = torch.ops.nanfast.stats(tensor_list)
        assert_stats_match(counts, norm, absmax, tensor_list)
        assert bool(torch.ops.nanfast.any_nonfinite(tensor_list)) == reference_any_nonfinite(tensor_list)
        results.append((counts, absmax))
    for counts, absmax in results[1:]:  # exact across ISAs, not just within the reference's tolerance
        assert torch.equal(counts, results[0][0]) and torch.equal(absmax, results[0][1])


_ISA_PROBE = """
import json, math, torch, nanfast
t = torch.linspace(-3, 3, {n}, dtype=torch.float32)
t[5] = math.nan
t[-1] = -math.inf
s = nanfast.stats([t, t.bfloat16(), t.double()])
print(json.dumps([nanfast._C.cpu_isa(), s.counts.tolist(), s.norm.tolist(), s.absmax.tolist()]))
"""


@pytest.mark.parametrize("isa", ["baseline", "avx2"])
def test_cpu_isa_environment_variable(restore_cpu_isa, isa):
    n = 3 * K_SEGMENT + 5
    env = dict(os.environ, NANFAST_CPU_ISA=isa)
    out = subprocess.run([sys.executable, "-c", _ISA_PROBE.format(n=n)], env=env, capture_output=True,
                         text=True, check=True).stdout
    got_isa, counts, norms, absmax = json.loads(out.strip().splitlines()[-1])
    best = nanfast._C.set_cpu_isa("avx512")
    assert got_isa == CPU_ISAS[max(CPU_ISAS.index(isa), CPU_ISAS.index(best))]
    assert nanfast._C.set_cpu_isa(isa) == got_isa  # the same kernels here give the same results
    t = torch.linspace(-3, 3, n, dtype=torch.float32)
    t[5] = math.nan
    t[-1] = -math.inf
    s = nanfast.stats([t, t.bfloat16(), t.double()])
    assert counts == s.counts.tolist() and norms == s.norm.tolist() and absmax == s.absmax.tolist()


def test_unknown_cpu_isa_environment_variable_is_an_error_at_import():
    """The error came at the first check, put on its first tensor ("nanfast.check_all: 'weight': ...") and
    not naming the variable (a probe, session 43): it comes at import now, naming it. Case does not matter."""
    def run(value: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, NANFAST_CPU_ISA=value)
        return subprocess.run([sys.executable, "-c", "import nanfast; print(nanfast._C.cpu_isa())"], env=env,
                              capture_output=True, text=True)
    out = run("sse9")
    assert out.returncode != 0 and "NANFAST_CPU_ISA is 'sse9', not a CPU instruction set" in out.stderr
    out = run("BASELINE")
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "baseline"


# --- Determinism across thread counts -------------------------------------------------------------


@fewer_examples
@given(st.lists(tensors(sizes=st.sampled_from((K_ITEM - 1, K_ITEM + 1, 2 * K_ITEM + 3))), min_size=2, max_size=4),
       many_small_tensors())
def test_results_do_not_depend_on_thread_count(restore_num_threads, big, small):
    tensor_list = big + small
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results.append(torch.ops.nanfast.stats(tensor_list))
    for counts, norm, absmax in results[1:]:  # bit for bit (and NaN == NaN)
        assert torch.equal(counts, results[0][0])
        assert torch.equal(norm.view(torch.int64), results[0][1].view(torch.int64))
        assert torch.equal(absmax.view(torch.int64), results[0][2].view(torch.int64))


# --- opcheck --------------------------------------------------------------------------------------

# All of opcheck's tests apply, none is left out: the ops are functional (test_schema), have fake kernels
# (test_faketensor, and the aot_dispatch tests, which trace through them with static and dynamic shapes),
# and take inputs that may require grad (test_autograd_registration; and the aot_dispatch tests, which
# trace a backward when an output requires grad: it must not, the statistics are not differentiable).
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                 "test_aot_dispatch_dynamic")


def opcheck_inputs():
    t = torch.randn(5, 7)
    t[1, 2] = math.nan
    return {
        "one": [torch.randn(3)],
        "mixed": [t, t.t(), t[:, ::2], torch.arange(4), torch.randn(2, dtype=torch.complex64), torch.empty(0)],
        "bf16": [torch.randn(K_SEGMENT + 3).bfloat16(), torch.full((2,), math.inf, dtype=torch.float16)],
        "requires_grad": [torch.randn(4, requires_grad=True), torch.randn(3)],
        "mx": [t.view(16, 16).t() for t in (torch.arange(256, dtype=torch.uint8).view(d) for d in MX_DTYPES)],
        # No tensor to dispatch by: the ops raised "no fallback function is registered" (a probe, session
        # 42; NOTE: [A list with no kernel to dispatch to]).
        "empty": [],
    }


@pytest.mark.parametrize("name", ["one", "mixed", "bf16", "requires_grad", "mx", "empty"])
@pytest.mark.parametrize("op", [torch.ops.nanfast.stats.default, torch.ops.nanfast.any_nonfinite.default])
def test_opcheck(op, name):
    # test_schema compares the inputs before and after with torch.allclose, which has no kernel for the
    # MX dtypes; test_mx_inputs_are_not_written checks that directly.
    utils = tuple(u for u in OPCHECK_UTILS if u != "test_schema") if name == "mx" else OPCHECK_UTILS
    torch.library.opcheck(op, (opcheck_inputs()[name],), test_utils=utils)


def test_the_ops_on_an_empty_list_give_what_the_python_api_gives():
    counts, norm, absmax = torch.ops.nanfast.stats([])
    expected = nanfast.stats([])
    assert counts.shape == (0, 3) and counts.dtype == torch.int64 and torch.equal(counts, expected.counts)
    assert norm.dtype == absmax.dtype == torch.float64 and norm.shape == absmax.shape == (0,)
    flag = torch.ops.nanfast.any_nonfinite([])
    assert flag.shape == () and flag.dtype == torch.bool and not flag.item() and not nanfast.any_nonfinite([]).item()


def test_mx_inputs_are_not_written():
    inputs = opcheck_inputs()["mx"]
    before = [t.view(torch.uint8).clone() for t in inputs]
    torch.ops.nanfast.stats(inputs)
    torch.ops.nanfast.any_nonfinite(inputs)
    assert all(torch.equal(t.view(torch.uint8), b) for t, b in zip(inputs, before))


def test_outputs_do_not_require_grad():
    """The statistics are not differentiable: inputs that require grad (parameters) must not give
    outputs with a grad_fn that keeps an autograd graph alive or warns when backpropagated."""
    p = torch.nn.Parameter(torch.randn(4))
    counts, norm, absmax = torch.ops.nanfast.stats([p])
    assert not norm.requires_grad and not absmax.requires_grad and not counts.requires_grad
    assert not nanfast.stats([p]).total_norm.requires_grad


# --- torch.compile --------------------------------------------------------------------------------


def call_op(tensor_list):
    return torch.ops.nanfast.stats(tensor_list)


def call_stats(tensor_list):
    s = nanfast.stats(tensor_list)
    return s.counts, s.nan, s.posinf, s.neginf, s.nonfinite, s.any_nonfinite, s.norm, s.absmax, s.total_norm


def call_any_nonfinite(tensor_list):
    return nanfast.any_nonfinite(tensor_list)


def call_clip_like(tensor_list):
    s = nanfast.stats(tensor_list)
    scale = torch.where(s.any_nonfinite, 0.0, 1.0 / (s.total_norm + 1e-6))
    return [t * scale.to(t.dtype) for t in tensor_list]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fn", [call_op, call_stats, call_any_nonfinite, call_clip_like])
def test_compile_fullgraph_matches_eager(backend, fn):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    clean = [torch.randn(5, 3), torch.randn(7, dtype=torch.float64)]
    bad = [torch.randn(5, 3), torch.tensor([1.0, math.inf, -math.inf, math.nan, 0, 0, 0], dtype=torch.float64)]
    for tensor_list in (clean, bad):
        expected = fn(tensor_list)
        got = compiled(tensor_list)
        expected = expected if isinstance(expected, (tuple, list)) else [expected]
        got = got if isinstance(got, (tuple, list)) else [got]
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


# --- No host sync ---------------------------------------------------------------------------------


def test_no_host_sync(op_recorder):
    tensor_list = [torch.randn(100), torch.tensor([math.nan, math.inf]), torch.arange(3)]
    with op_recorder() as ops:
        s = nanfast.stats(tensor_list)
        _ = (s.counts, s.nan, s.posinf, s.neginf, s.nonfinite, s.any_nonfinite, s.total_norm, s.norm, s.absmax,
             s.numel)
        nanfast.any_nonfinite(tensor_list)
        nanfast.stats([])
        nanfast.any_nonfinite([])
    assert ops.counts["nanfast.stats.default"] == 1 and ops.counts["nanfast.any_nonfinite.default"] == 1
    assert ops.host_syncs == 0
    with op_recorder() as ops:
        bool(s.any_nonfinite)  # the recorder does see a sync
    assert ops.host_syncs == 1


# --- Bad input ------------------------------------------------------------------------------------

API = [("nanfast.stats", nanfast.stats), ("nanfast.any_nonfinite", nanfast.any_nonfinite)]


def names_entry(message: str, index: int) -> bool:
    return f"entry {index}" in message or f"tensors[{index}]" in message


@pytest.mark.parametrize("api,fn", API)
def test_non_tensor_entry(api, fn):
    with pytest.raises(TypeError) as e:
        fn([torch.ones(2), 3.0])
    assert api in str(e.value) and names_entry(str(e.value), 1)
    with pytest.raises(TypeError, match=api):
        fn(3)


@pytest.mark.parametrize("api,fn", API)
def test_container_or_string_instead_of_tensors(api, fn):
    """A dict used to be iterated for its keys, and a str for its characters: both ended in an
    AttributeError ('str' object has no attribute 'is_meta')."""
    with pytest.raises(TypeError) as e:
        fn({"w": torch.ones(2)})
    assert api in str(e.value) and "dict" in str(e.value) and "check_all" in str(e.value)
    with pytest.raises(TypeError) as e:
        fn("abc")
    assert api in str(e.value) and "str" in str(e.value) and "sequence of Tensors" in str(e.value)


@pytest.mark.parametrize("api,fn", API)
def test_first_entry_not_a_tensor(api, fn):
    with pytest.raises(TypeError) as e:
        fn([0.5, torch.ones(2)])
    assert api in str(e.value) and names_entry(str(e.value), 0) and "float" in str(e.value)


def nested_tensors():
    """(nested tensor, plain tensor of the same elements): strided and jagged layouts, and a jagged
    tensor made by narrow() whose buffer holds elements outside it (an inf, which must not count)."""
    a, b = torch.tensor([[math.nan, 1.0], [-3.0, 2.0]]), torch.tensor([[4.0, -math.inf]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the strided layout is a prototype
        strided = torch.nested.nested_tensor([a, b])
    jagged = torch.nested.nested_tensor([a, b], layout=torch.jagged)
    buffer = torch.tensor([[1.0, math.inf, 3.0, 4.0], [5.0, 6.0, 7.0, math.nan]])
    narrowed = torch.nested.narrow(buffer, 1, torch.tensor([0, 1]), torch.tensor([1, 2]), layout=torch.jagged)
    both = torch.cat([a.flatten(), b.flatten()])
    return [(strided, both), (jagged, both), (narrowed, torch.tensor([1.0, 6.0, 7.0]))]


def test_nested_tensors_are_read_through_their_components():
    """Nested tensors used to end in a raw NotImplementedError from the dispatcher (strided layout) or
    a refusal (jagged): each is one entry, counted over its components' elements."""
    pairs = nested_tensors()
    plain = torch.tensor([2.0, math.inf])
    s = nanfast.stats([plain] + [nested for nested, _ in pairs])
    assert_stats_match(s.counts, s.norm, s.absmax, [plain] + [flat for _, flat in pairs])
    assert s.numel.tolist() == [2, 6, 6, 3]
    for nested, flat in pairs:
        assert nanfast.any_nonfinite([nested]).item() is reference_any_nonfinite([flat])
    finite = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    assert nanfast.any_nonfinite([torch.ones(1), finite]).item() is False


def test_nested_tensors_make_no_host_sync(op_recorder):
    strided, jagged, _ = (nested for nested, _ in nested_tensors())  # not the narrowed one: torch syncs there
    with op_recorder() as ops:
        s = nanfast.stats([torch.ones(2), strided, jagged])
        flag = nanfast.any_nonfinite([strided, jagged])
    assert ops.host_syncs == 0
    assert s.nan.tolist() == [0, 1, 1] and flag.item() is True


@pytest.mark.parametrize("api,fn", API)
def test_calls_leave_reference_counts_unchanged(api, fn):
    """The eager bindings borrow their inputs (see NOTE: [Borrowed inputs]): after a call, and after
    one refused for a bad entry, every tensor holds the references it held before."""
    tensors = [torch.ones(3), torch.ones(2, dtype=torch.complex64), torch.ones(4, 4).t(), torch.ones(2).neg().detach()]
    before = [(t._use_count(), sys.getrefcount(t)) for t in tensors]
    fn(tensors)
    with pytest.raises(TypeError):
        fn(tensors + [3.0])
    assert [(t._use_count(), sys.getrefcount(t)) for t in tensors] == before


@pytest.mark.parametrize("api,fn", API)
def test_sparse_entry(api, fn):
    with pytest.raises(ValueError) as e:
        fn([torch.ones(2), torch.ones(2).to_sparse()])
    assert api in str(e.value) and names_entry(str(e.value), 1) and "sparse" in str(e.value)


@pytest.mark.parametrize("api,fn", API)
def test_meta_entry_outside_fake_mode(api, fn):
    with pytest.raises(ValueError) as e:
        fn([torch.ones(2, device="meta"), torch.ones(2, device="meta")])
    assert api in str(e.value) and names_entry(str(e.value), 0) and "meta" in str(e.value)


@pytest.mark.parametrize("api,fn", API)
def test_entries_on_two_devices(api, fn):
    """A meta tensor after a CPU one: the dispatcher picks the Meta kernel (the fake one) for the whole
    list, so without a check there the result would be uninitialized memory."""
    with pytest.raises((ValueError, RuntimeError)) as e:
        fn([torch.ones(2), torch.ones(3), torch.ones(2, device="meta")])
    assert api in str(e.value) and names_entry(str(e.value), 2)


@pytest.mark.parametrize("api,fn", API)
def test_unsupported_dtype(api, fn):
    with pytest.raises(RuntimeError) as e:
        fn([torch.ones(2), unsupported_dtype_tensor()])
    assert api in str(e.value) and names_entry(str(e.value), 1) and "dtype" in str(e.value)


@pytest.mark.parametrize("api,fn", API)
def test_quantized_entry(api, fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises((ValueError, TypeError, RuntimeError)) as e:
        fn([torch.ones(2), q])
    assert api in str(e.value) and names_entry(str(e.value), 1)


def test_fake_tensors_give_fake_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        tensor_list = [torch.empty(3, 4), torch.empty(5, dtype=torch.bfloat16)]
        s = nanfast.stats(tensor_list)
        flag = nanfast.any_nonfinite(tensor_list)
    assert s.counts.shape == (2, 3) and s.counts.dtype == torch.int64
    assert s.norm.shape == (2,) and s.norm.dtype == torch.float64 and s.absmax.shape == (2,)
    assert flag.shape == () and flag.dtype == torch.bool


@pytest.mark.parametrize("api,fn", API)
def test_a_fake_tensor_outside_its_mode_is_refused(api, fn):
    """Alone (or first), a FakeTensor that escaped its mode ran the op through its own dispatch and gave
    fake results, which failed later with an error that named neither nanfast nor the entry (a probe,
    session 52); beside a real tensor first, the op refused it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.full((3,), float("nan"))
    for entries, bad in (([fake], 0), ([fake, torch.ones(2)], 0), ([torch.ones(2), fake], 1)):
        with pytest.raises((ValueError, TypeError)) as e:
            fn(entries)
        assert api in str(e.value) and names_entry(str(e.value), bad) and "FakeTensor" in str(e.value)


# --- More than 2^31 elements (last in the file: frees its 2 GiB when the module ends) -------------


@pytest.fixture(scope="module")
def huge_float8():
    """2^31 + 4096 float8_e5m2 elements (2 GiB): zeros, a few finite values, and NaN/±inf only past 2^31."""
    n = 2**31 + 4096
    t = torch.zeros(n, dtype=torch.uint8).view(torch.float8_e5m2)  # CPU fill_ has no float8 kernel before torch 2.5
    for i, value in ((3, -3.0), (2**31 + 100, 2.0), (2**31 + 5, math.nan), (2**31 + 77, math.inf), (n - 1, -math.inf)):
        t[i] = torch.tensor(value).to(t.dtype)
    return t


def test_more_than_2_31_elements(huge_float8):
    t = huge_float8
    s = nanfast.stats([torch.zeros(3).to(torch.float8_e5m2), t])
    assert s.counts.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert math.isclose(s.norm[1].item(), math.sqrt(9 + 4), rel_tol=1e-12) and s.absmax[1].item() == 3.0
    assert nanfast.any_nonfinite([t]).item() is True


def test_byte_offsets_beyond_2_31(huge_float8):
    t = huge_float8
    views = [
        t[5 :: 2**31],  # two elements 2^31 bytes apart: the strided path
        t[77 :: 2**20],  # 2049 elements, the last at 2^31 + 77
        t[2**31 :],  # a storage offset of 2^31
    ]
    check_against_reference(views)
    assert nanfast.stats(views).counts.tolist() == [[1, 0, 0], [0, 1, 0], [1, 1, 1]]


def test_more_than_2_31_elements_in_a_list():
    """33 references to one 2^26-element tensor: 2^31 + 2^26 elements in the list's index space."""
    t = torch.zeros(2**26, dtype=torch.bfloat16)
    t[-1] = math.nan
    t[7] = 0.5
    s = nanfast.stats([t] * 33 + [torch.tensor([math.inf])])
    assert s.counts.tolist() == [[1, 0, 0]] * 33 + [[0, 1, 0]]
    assert s.norm.tolist() == [0.5] * 33 + [0.0]
    assert nanfast.any_nonfinite([torch.zeros(3)] * 2 + [t] * 33).item() is True
