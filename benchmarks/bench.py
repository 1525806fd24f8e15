"""The benchmark from a checkout: `python benchmarks/bench.py [options]` runs `python -m nanfast bench
[options]` (the code lives in nanfast/cli/bench.py, bench_watch.py and bench_locate.py, so that an
installed nanfast carries it too), then checks the core suite's CPU results against the project's
acceptance targets: printed as the README's "Targets" list and added to results.json under "targets".
Targets are the project's, not the package's: they live here. results/ holds the JSON of the runs the
README's tables come from."""

import argparse
import json
import os
import sys

from nanfast import cli
from nanfast.cli import bench


def targets(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """The core issue's CPU targets: (what, met, measured)."""
    def row(workload, method):
        return next((r for r in rows if r["workload"] == workload and r["method"] == method), None)

    checks = []
    s = row("gpt2-fp32", "nanfast.stats")
    if s:
        checks += [("stats gpt2-fp32 >= 0.8x the read ceiling", s["vs_ceiling"] >= 0.8, f"{s['vs_ceiling']:.2f}x"),
                   ("stats gpt2-fp32 >= 25x faster than per-tensor assert", s["speedup_vs_assert"] >= 25,
                    f"{s['speedup_vs_assert']:.1f}x"),
                   ("stats gpt2-fp32 >= 1.3x faster than amp check", s["speedup_vs_amp"] >= 1.3,
                    f"{s['speedup_vs_amp']:.2f}x")]
    s = row("gpt2-bf16", "nanfast.stats")
    if s:
        checks.append(("stats gpt2-bf16 >= 0.7x the read ceiling", s["vs_ceiling"] >= 0.7, f"{s['vs_ceiling']:.2f}x"))
    s = row("5000x1024-fp32", "nanfast.stats")
    if s:
        checks += [("stats 5000 small >= 50x faster than per-tensor assert", s["speedup_vs_assert"] >= 50,
                    f"{s['speedup_vs_assert']:.1f}x"),
                   ("stats 5000 small >= 3x faster than amp check", s["speedup_vs_amp"] >= 3, f"{s['speedup_vs_amp']:.1f}x")]
    return checks


def main(argv: list[str]) -> int:
    """Runs the benchmark, then prints and records the targets of a CPU core run.

    Args:
        argv: the options of `python -m nanfast bench`.

    Returns:
        The benchmark's exit code."""
    code = cli.main(["bench", *argv])
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(argv)
    path = os.path.join(args.out, "results.json")
    if code != 0 or args.device != "cpu" or not os.path.exists(path):
        return code
    with open(path) as f:
        results = json.load(f)
    checks = targets(results.get("core", []))
    if checks:
        print("Targets (CPU):\n")
        for what, met, measured in checks:
            print(f"- [{'x' if met else ' '}] {what}: {measured}")
        results["targets"] = [{"target": w, "met": m, "measured": v} for w, m, v in checks]
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
