"""Plants known kinds of CUDA kernel bugs into a copy of csrc/cuda/stats_cuda.cu, one at a time, builds
each with the CPU emulation of CUDA (tests/cuda_emulation) and runs the emulated CUDA tests on it:
every mutant must be caught, by the build or by a test under some thread order. A developer tool, not
run in CI (a build per mutant: about a minute each on 2 cores).

    python tools/cuda_mutations.py [--only NAME ...] [--keep DIR]

Prints a Markdown table (mutant, what caught it, the first error line) and exits 1 if one survived."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL = Path("cuda/stats_cuda.cu")


@dataclass(frozen=True)
class Mutant:
    name: str
    old: str  # text of stats_cuda.cu that must occur exactly `count` times
    new: str
    count: int = 1
    huge: bool = False  # only the opt-in 2^31-element test can see it


MUTANTS = (
    Mutant("first barrier of block_reduce removed", "  shared[tid] = value;\n  __syncthreads();\n",
           "  shared[tid] = value;\n"),
    Mutant("barrier of the reduction loop removed",
           "      combine(shared[tid], shared[tid + width]);\n    }\n    __syncthreads();\n",
           "      combine(shared[tid], shared[tid + width]);\n    }\n"),
    Mutant("barrier in a non-uniform branch (rescaled pass)", "if (needs_rescale(total)) {",
           "if (needs_rescale(total) && threadIdx.x % 2 == 0) {"),
    Mutant("missing launch check (finishing kernel)",
           "        absmax.mutable_data_ptr<double>());\n    C10_CUDA_KERNEL_LAUNCH_CHECK();\n",
           "        absmax.mutable_data_ptr<double>());\n"),
    Mutant("zero-block grid (flush without tensors)", "    if (batch.num_tensors > 0) {\n", "    {\n"),
    Mutant("off-by-one in a block's tensor (binary search)", "if (batch.first_block[mid] <= block) {",
           "if (batch.first_block[mid] < block) {"),
    Mutant("off-by-one in the scalar loop", "i < len; i += kThreads) {\n      for_each_value(data[i], fn);",
           "i <= len; i += kThreads) {\n      for_each_value(data[i], fn);"),
    Mutant("off-by-one in the last chunk's length", "numel - begin < kChunkElements ? numel - begin",
           "numel - begin < kChunkElements ? numel - begin - 1"),
    Mutant("default stream", "<<<static_cast<unsigned>(num_blocks), kThreads, 0, stream>>>",
           "<<<static_cast<unsigned>(num_blocks), kThreads>>>"),
    Mutant("missing device guard (stats)",
           "  const c10::cuda::CUDAGuard device_guard(tensors[0].device());\n"
           "  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();\n  const at::TensorOptions",
           "  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();\n  const at::TensorOptions"),
    Mutant("unaligned 16-byte loads", "if (reinterpret_cast<uintptr_t>(data) % sizeof(Packet<T>) == 0) {",
           "if (true) {"),
    Mutant("kernel arguments over 4 KB (file's own check removed)",
           "constexpr int64_t kFinishTensors = 480;", "constexpr int64_t kFinishTensors = 512;"),
    Mutant("32-bit chunk offsets (dense kernel)",
           "  const int64_t begin = chunk * kChunkElements;\n  op(DenseChunk<T>",
           "  const int64_t begin = static_cast<int32_t>(chunk * kChunkElements);\n  op(DenseChunk<T>", huge=True),
    Mutant("summary: off-by-one in the pass's rows", "  for (int64_t i = tid; i < a.rows; i += kThreads) {",
           "  for (int64_t i = tid; i < a.rows - 1; i += kThreads) {"),
    Mutant("summary: a module's last gradient left out", "    for (int64_t i = 0; i < grads; ++i) {\n      if (a.groups[i] == g)",
           "    for (int64_t i = 0; i < grads - 1; ++i) {\n      if (a.groups[i] == g)"),
    Mutant("summary: barrier in a non-uniform branch", "  if (n == 0) {  // uniform", "  if (n == 0 || threadIdx.x == 5) {  // uniform"),
    Mutant("summary: the records' last part left out", "  for (int p = 0; p < a.recorded_parts; ++p) {",
           "  for (int p = 0; p + 1 < a.recorded_parts; ++p) {"),
    Mutant("summary: the counted cells not advanced past a part",
           "      weights += 3 * a.recorded_rows[p];\n", ""),
    Mutant("summary: every loss read as the first", "*a.losses[i];", "*a.losses[0];"),
    Mutant("summary: missing launch check",
           "(args, out.mutable_data_ptr<double>());\n  C10_CUDA_KERNEL_LAUNCH_CHECK();\n",
           "(args, out.mutable_data_ptr<double>());\n"),
)

# The file's own static_assert on FinishBatch would catch the 4 KB mutant first: it goes with it, so
# that the emulation's own check is what is exercised.
_FINISH_ASSERT = re.compile(r"static_assert\(sizeof\(FinishBatch\)[^;]*;\n")


def mutate(source: str, mutant: Mutant) -> str:
    found = source.count(mutant.old)
    if found != mutant.count:
        raise SystemExit(f"mutant '{mutant.name}': its text occurs {found} times in stats_cuda.cu, not {mutant.count}")
    out = source.replace(mutant.old, mutant.new)
    return _FINISH_ASSERT.sub("", out) if "kFinishTensors = 512" in mutant.new else out


def first_error(output: str) -> str:
    for pattern in (r"error: (.*)", r"(CUDA emulation: .*)", r"runtime error: (.*)", r"^E\s+(\S.*)",
                    r"(FAILED .*)"):
        match = re.search(pattern, output, re.MULTILINE)
        if match:
            return match.group(1).strip()[:160]
    return output.strip().splitlines()[-1][:160] if output.strip() else "(no output)"


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)


def check(mutant: Mutant, work: Path) -> tuple[str, str]:
    """Builds and tests one mutant; returns (what caught it, the first error)."""
    csrc = work / "csrc"
    shutil.rmtree(csrc, ignore_errors=True)
    shutil.copytree(ROOT / "csrc", csrc)
    (csrc / KERNEL).write_text(mutate((ROOT / "csrc" / KERNEL).read_text(), mutant))
    env = dict(os.environ, NANFAST_CSRC=str(csrc), NANFAST_CUDA_EMU_BUILD=str(work / "build"),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    built = run([sys.executable, "-c", "import cuda_emulation; cuda_emulation.build()"], env)
    if built.returncode != 0:
        return "build", first_error(built.stdout + built.stderr)
    selection = "emulated and 2_31" if mutant.huge else "emulated"
    if mutant.huge:
        env["NANFAST_TEST_HUGE"] = "1"
    for order in ("forward", "reverse", "shuffled"):
        env["NANFAST_CUDA_EMU_ORDER"] = order
        # --capture=sys: UBSan's report on the process's stderr survives the abort
        tested = run([sys.executable, "-m", "pytest", "-q", "-x", "--capture=sys", "-p", "no:cacheprovider",
                      "tests/test_cuda.py", "tests/test_cuda_step_summary.py", "-k", selection], env)
        if tested.returncode != 0:
            failed = re.search(r"^FAILED (\S+)", tested.stdout, re.MULTILINE)
            where = failed.group(1).split("::")[-1] if failed else f"pytest exit {tested.returncode}"
            return f"{order} order: {where}", first_error(tested.stdout + tested.stderr)
    return "SURVIVED", ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run the mutants whose name contains one of these")
    parser.add_argument("--keep", type=Path, help="work in this folder (kept) instead of a temporary one")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if not args.only or any(word in m.name for word in args.only)]
    work = args.keep or Path(tempfile.mkdtemp(prefix="nanfast-mutants-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, survived = [], 0
    try:
        for mutant in mutants:
            caught, error = check(mutant, work)
            survived += caught == "SURVIVED"
            rows.append(f"| {mutant.name} | {caught} | {error.replace('|', '/')} |")
            print(rows[-1], flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| mutant | caught by | first error |\n|---|---|---|\n" + "\n".join(rows))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
