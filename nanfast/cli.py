"""`python -m nanfast <command>`: each command is a module with add_arguments(parser) and run(args)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

# command -> (module under nanfast, one-line help)
COMMANDS = {
    "bench": ("bench", "benchmark nanfast against the pure-torch ways of finding NaN/inf"),
    "scan": ("scan", "check checkpoint files for NaN/inf without running pickled code"),
    "demo": ("demo", "train a small model with a planted fault: watch catches it, locate names the op"),
}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanfast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(f"nanfast.{module}")
        mod.add_arguments(sub.add_parser(name, help=help_text, description=mod.__doc__))
    args = parser.parse_args(argv)
    module = importlib.import_module(f"nanfast.{COMMANDS[args.command][0]}")
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
