"""Prints the README's command marked `<!-- ci:NAME -->`: the indented command block right after the
mark, so CI runs exactly what a new user copies from the README (python3 .ci/readme_command.py setup)."""

import pathlib
import sys


def readme_command(name: str, text: str) -> str:
    lines = text.splitlines()
    mark = f"<!-- ci:{name} -->"
    starts = [i for i, line in enumerate(lines) if line.strip() == mark]
    if len(starts) != 1:
        raise SystemExit(f"README.md: expected one '{mark}', found {len(starts)}")
    block = []
    for line in lines[starts[0] + 1:]:
        if not line.strip() and not block:
            continue
        if not line.startswith("    "):
            break
        block.append(line[4:])
    if not block:
        raise SystemExit(f"README.md: no indented command after '{mark}'")
    return "\n".join(block)


if __name__ == "__main__":
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    print(readme_command(sys.argv[1], readme.read_text()))
