"""`python -m nanfast <command>`: each command is a module with add_arguments(parser) and run(args)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

# command -> (the module with its add_arguments and run, one-line help). nanfast/locator/source.py names
# cli/demo.py as user code (see NOTE: [demo code is user code]).
COMMANDS = {
    "bench": ("nanfast.cli.bench", "benchmark nanfast against the pure-torch ways of finding NaN/inf"),
    "scan": ("nanfast.cli.scan", "check checkpoint files for NaN/inf without running pickled code"),
    "plot": ("nanfast.cli.plot", "draw a health timeline (loss, grad norm, headroom, events) from a watch's JSONL file"),
    "demo": ("nanfast.cli.demo", "train a small model with a planted fault: watch catches it, locate names the op"),
}


class _VersionAction(argparse.Action):
    """--version: the build description, imported only when asked for."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from ..build_info import describe

        print(describe())
        parser.exit()


def main(argv: Optional[list[str]] = None) -> int:
    """Runs one command of `python -m nanfast` (also the `nanfast` console script).

    Args:
        argv: the command line after the program name; None reads sys.argv.

    Returns:
        The command's exit code.

    Raises:
        SystemExit: for --help, --version and a command line argparse rejects."""
    parser = argparse.ArgumentParser(prog="python -m nanfast", description=__doc__)
    parser.add_argument("--version", action=_VersionAction,
                        help="print nanfast's and torch's versions, the CPU ISA and the CUDA architectures built")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        mod.add_arguments(sub.add_parser(name, help=help_text, description=mod.__doc__))
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
