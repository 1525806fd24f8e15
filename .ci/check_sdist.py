"""Fails unless the sdist holds every file git tracks that a build from it or its tests need: the
sources and headers under csrc/, the package, the tests, CMakeLists.txt, the LICENSE and README
(python3 .ci/check_sdist.py dist/nanfast-X.tar.gz)."""

import subprocess
import sys
import tarfile

NEEDED = ("csrc/", "nanfast/", "tests/", "CMakeLists.txt", "LICENSE", "README.md", "setup.py", "pyproject.toml")

sdist = sys.argv[1]
with tarfile.open(sdist) as tar:
    # Members are "nanfast-X/<path>".
    inside = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout.split()
missing = [path for path in tracked if path.startswith(NEEDED) and path not in inside]
if missing:
    sys.exit(f"{sdist} lacks {len(missing)} tracked files: " + ", ".join(missing))
stray = sorted(path for path in inside if path.endswith((".so", "_build.py")))
if stray:
    sys.exit(f"{sdist} holds build outputs: " + ", ".join(stray))
print(f"{sdist}: every tracked source, header and test is inside ({len(inside)} files)")
