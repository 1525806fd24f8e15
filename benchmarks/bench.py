"""The benchmark from a checkout: `python benchmarks/bench.py [options]` is `python -m nanfast bench
[options]`. The code lives in nanfast/bench.py (and bench_watch.py, bench_locate.py for the other
suites), so that an installed nanfast carries it too. results/ holds the JSON of the runs the README's
tables come from."""

import sys

from nanfast import cli

if __name__ == "__main__":
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
