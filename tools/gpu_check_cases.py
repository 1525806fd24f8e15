"""The GPU workloads of tools/gpu-check, one per subcommand; each exits non-zero on a failure.

    python tools/gpu_check_cases.py hard-cases   # stats / any_nonfinite over hard inputs, against the CPU
    python tools/gpu_check_cases.py sync-step    # a watched training step under sync debug mode "error"
    python tools/gpu_check_cases.py graph        # the ops captured in a CUDA graph and replayed

hard-cases is small on purpose: tools/gpu-check runs it under compute-sanitizer (10-100x slower)."""

from __future__ import annotations

import math
import sys

import torch

import nanfast

K_CHUNK = 65536  # kChunkElements of csrc/cuda/stats_cuda.cu


def hard_inputs() -> list[torch.Tensor]:
    """CPU tensors that take every path of the kernels: every dtype group, chunk edges, misaligned
    starts, views read in place, expanded and 0-dim tensors, float64 chunks that need rescaling, and
    more tensors and chunks than one launch holds."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2 * K_CHUNK + 17, generator=gen)
    base[[0, 15, 16, K_CHUNK - 1, K_CHUNK, 2 * K_CHUNK + 16]] = torch.tensor([math.nan, math.inf, -math.inf] * 2)
    grid = base[: 300 * 400].view(300, 400)
    out = [base, base[1:], base[3:-1], grid.t(), grid[:, 1:], grid[1::2, ::5], base[5], base[2:3].expand(7, 9),
           base[: 4000].as_strided((3996, 5), (1, 1)), torch.empty(0), torch.empty(3, 0)]
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn,
                  torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool):
        out += [base[: K_CHUNK + 9].to(dtype), base[1: K_CHUNK + 9].to(dtype)]
    out.append(torch.view_as_complex(base[: 2 * K_CHUNK].view(-1, 2)))
    huge = torch.full((K_CHUNK + 3,), 1e300, dtype=torch.float64)
    tiny = torch.full((K_CHUNK + 3,), 1e-300, dtype=torch.float64)
    out += [huge, tiny, huge[1:].view(-1, 2)[:, 0]]
    out += [torch.randn(int(n), generator=gen) for n in torch.randint(1, 300, (200,), generator=gen)]
    out.append(torch.randn(360 * K_CHUNK // 8, generator=gen).to(torch.float8_e5m2))  # 45 chunks
    return out


def hard_cases() -> None:
    cpu = hard_inputs()
    cuda = [t.cuda() for t in cpu]
    counts, norm, absmax = torch.ops.nanfast.stats(cuda)
    expected = torch.ops.nanfast.stats(cpu)
    assert torch.equal(counts.cpu(), expected[0]), "counts differ from the CPU kernels'"
    assert torch.equal(absmax.cpu(), expected[2]), "absmax differs from the CPU kernels'"
    torch.testing.assert_close(norm.cpu(), expected[1], rtol=1e-6, atol=0)
    assert torch.ops.nanfast.any_nonfinite(cuda).item() is True
    clean = [t for t, row in zip(cuda, expected[0]) if row.sum() == 0]
    assert torch.ops.nanfast.any_nonfinite(clean).item() is False
    # The watch's per-step summary: the one-block kernel against the CPU kernel's, both over the CPU
    # kernels' results (the norms above differ in their last bits, and a summary of them would too).
    groups = torch.arange(len(cpu) - 2) % 3
    # The records' rows in two parts, every other cell counted (NOTE: [Cells a record does not count]).
    summaries = [torch.ops.nanfast.step_summary(
        [c[:4], c[4:]], torch.arange(c.numel(), device=c.device).reshape(c.shape) % 2, c, n, a, 2, None, False, None,
        None, [torch.full((), 1.5, dtype=torch.float64, device=c.device)], [1], None, groups.to(c.device), 3)
        for c, n, a in ([r.cuda() for r in expected], expected)]
    torch.testing.assert_close(summaries[0].cpu(), summaries[1], rtol=1e-12, atol=0, equal_nan=True)
    torch.cuda.synchronize()
    print(f"hard cases: {len(cpu)} tensors, results equal to the CPU kernels' (the step summary too)")


def sync_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 10)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    with nanfast.watch(model, optimizer, action="raise") as w:
        for step in range(3):
            optimizer.zero_grad()
            # The hooks enqueue their checks on the device: forward and backward never sync the host.
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            optimizer.step()  # the step's one host read, by design
        assert w.last is None, f"a healthy model raised an event: {w.last}"
    print("watched steps: forward and backward made no host sync")


def graph() -> None:
    x = torch.randn(1000, device="cuda")
    y = torch.randn(3 * K_CHUNK + 5, device="cuda", dtype=torch.bfloat16)[1:]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        nanfast.stats([x, y])
        nanfast.any_nonfinite([x, y])
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        s = nanfast.stats([x, y])
        found = nanfast.any_nonfinite([x, y])
    for planted in (None, (3, math.nan), (7, math.inf)):
        if planted is not None:
            x[planted[0]] = planted[1]
        g.replay()
        eager = nanfast.stats([x, y])
        assert torch.equal(s.counts, eager.counts) and torch.equal(s.norm, eager.norm)
        assert found.item() == (planted is not None)
    print("CUDA graph: captured, replays read the inputs' current values")


CASES = {"hard-cases": hard_cases, "sync-step": sync_step, "graph": graph}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        sys.exit(f"usage: python {sys.argv[0]} {{{','.join(CASES)}}}")
    if not torch.cuda.is_available():
        sys.exit("gpu_check_cases: no CUDA GPU visible")
    CASES[sys.argv[1]]()
