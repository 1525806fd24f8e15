"""Prints the floor of every requirement of the named extras of pyproject.toml, pinned: `name>=v`
becomes `name==v` (CI installs these to run the framework callbacks' tests at the oldest versions the
extras allow).

    python .ci/extra_floors.py transformers lightning"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def main(extras: list[str]) -> int:
    """Prints the pins, space-separated. Args: extras, the extras' names. Returns: the exit code.
    Raises: SystemExit when an extra is missing or a requirement has no `>=` floor."""
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    pins = []
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise SystemExit(f"extra_floors: pyproject.toml has no extra {extra!r}")
        for requirement in project["optional-dependencies"][extra]:
            floor = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][A-Za-z0-9.]*)", requirement)
            if floor is None:
                raise SystemExit(f"extra_floors: {extra}'s requirement {requirement!r} has no `>=` floor to test")
            pins.append(f"{floor.group(1)}=={floor.group(2)}")
    print(" ".join(pins))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
