"""Builds nanfast._C: the CPU kernels always, the CUDA kernels when torch is a CUDA build and a CUDA
toolkit of torch's major CUDA version is found (no GPU is needed to build); without one it warns and
builds the CPU kernels only.

Environment:
  CUDA_HOME              toolkit to use (else CUDA_PATH, else /usr/local/cuda)
  TORCH_CUDA_ARCH_LIST   GPU architectures (default: the visible GPUs, else DEFAULT_CUDA_ARCHS)
  NANFAST_CPU_ONLY=1     skip the CUDA kernels
  NANFAST_WERROR=1       treat compiler warnings in csrc/ as errors (CI)
  NANFAST_ISOLATED_BUILD=1  build against the torch of pip's isolated build environment (refused by default)
"""

import glob
import os
import re
import subprocess
import sys
import tempfile

from setuptools import find_packages, setup

DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0;12.0+PTX"


def find_cuda_home():
    # torch guesses the toolkit from the nvcc on PATH; where that nvcc is a wrapper script
    # (e.g. /usr/local/bin/nvcc) it guesses /usr/local, so look for the headers ourselves.
    for variable in ("CUDA_HOME", "CUDA_PATH", None):
        home = os.environ.get(variable) if variable else "/usr/local/cuda"
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            return home
        if home and variable:  # a mistyped path must not be passed over in silence
            print(f"WARNING: nanfast: {variable}={home} holds no CUDA toolkit (bin/nvcc and include/cuda_runtime.h): "
                  "looking further", file=sys.stderr)
    return None


cpu_only = os.environ.get("NANFAST_CPU_ONLY") == "1"
cuda_home = None if cpu_only else find_cuda_home()
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home  # read once, when torch.utils.cpp_extension is imported

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

# NOTE: [The torch a build runs against]
# The extension works only with the torch it was compiled against. A plain `pip install .` builds in an
# isolated environment, into which pip installs the newest torch the requirement admits: on a machine
# with torch 2.13.0 (CPU), 2.14.1 with CUDA (5 GB) was fetched and a CUDA build begun, with no word of
# it, for an extension that would not load beside the user's torch (a probe, session 45). So a build
# whose torch lies in such an environment stops at once and says what to run instead; and the package
# requires the torch it was built against, so that a wheel does not pull in another one.
def isolated_build_environment(path: str) -> bool:
    """Whether `path` lies in a build environment pip or `python -m build` made for this build: a
    temporary folder named pip-build-env-* or build-env-* (a venv of one's own so named is not one)."""
    temporary = os.path.realpath(tempfile.gettempdir()) + os.sep
    path = os.path.realpath(path)
    return path.startswith(temporary) and path[len(temporary):].startswith(("pip-build-env-", "build-env-"))


if isolated_build_environment(torch.__file__) and os.environ.get("NANFAST_ISOLATED_BUILD") != "1":
    sys.exit(f"nanfast: this build would compile against torch {torch.__version__}, which pip installed into an "
             f"isolated build environment ({os.path.dirname(torch.__file__)}), not against the torch you run: the "
             "extension only loads beside the torch it was built for. Install torch first, then build against it: "
             "pip install --no-build-isolation .  (python -m build --no-isolation for a wheel; set "
             "NANFAST_ISOLATED_BUILD=1 to build against the isolated environment's torch anyway)")
TORCH_RELEASE = torch.__version__.split("+")[0]  # 2.14.1+cu130 -> 2.14.1 (any local build of it)


def cuda_skip_reason():
    """Why the CUDA kernels cannot be built for this CUDA build of torch, or None."""
    if cuda_home is None:
        return "no CUDA toolkit found (set CUDA_HOME)"
    nvcc = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True)
    release = re.search(r"release (\d+\.\d+)", nvcc.stdout)
    torch_major = torch.version.cuda.split(".")[0]
    # torch.utils.cpp_extension refuses a toolkit whose major version is not torch's: fail over to CPU instead.
    if release and release.group(1).split(".")[0] != torch_major:
        return (f"the CUDA toolkit at {cuda_home} is CUDA {release.group(1)} but torch {torch.__version__} was built "
                f"with CUDA {torch.version.cuda} (point CUDA_HOME at a CUDA {torch_major}.x toolkit)")
    return None


skip_reason = None if cpu_only or torch.version.cuda is None else cuda_skip_reason()
if skip_reason:
    print(f"WARNING: nanfast: building the CPU kernels only: {skip_reason}", file=sys.stderr)
with_cuda = not cpu_only and torch.version.cuda is not None and skip_reason is None
if with_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS

werror = os.environ.get("NANFAST_WERROR") == "1"
cxx_flags = ["-O3", "-fopenmp", "-Wall", "-Wextra", "-Wno-unused-parameter"] + (["-Werror"] if werror else [])
# No --use_fast_math: it flushes subnormals, which the kernels must classify and sum exactly.
nvcc_flags = ["-O3", "-Xcompiler", "-Wall"] + (["-Werror", "all-warnings", "-Xcompiler", "-Werror"] if werror else [])
# NOTE: [The process's one libstdc++]
# The extension must use the libstdc++ that torch and Python loaded, never a copy of its own. On a GPU
# machine's image, g++ was a wrapper around GCC 13 (-B into GCC's own folders; why it linked statically
# was not established); its link copied the stream and locale code into _C.so (no libstdc++ among its
# NEEDED), that copy's locale was never initialised, and the first TORCH_CHECK that formatted a number
# into its message crashed the process. Adding -lstdc++ changed nothing there, so the extension links
# the very file this process loaded (torch needs it), by path; the driver's own -lstdc++ then has
# nothing left to add.
# tests/cuda_emulation links its build the same way.
def loaded_libstdcxx() -> list[str]:
    """The path of the libstdc++ this process mapped (empty where there is none, or no /proc)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})[:1]
    except OSError:
        return []


link_flags = ["-fopenmp"] + loaded_libstdcxx()


def write_build_record(path: str) -> None:
    """nanfast/_build.py: what this build was made from and for, for `nanfast --version`."""
    if with_cuda:
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or ";".join(sorted(
            {"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))
    record = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if with_cuda else None,
        "cuda_archs": archs if with_cuda else None,
        "cuda_skipped": "NANFAST_CPU_ONLY=1" if cpu_only else skip_reason or (None if with_cuda else "a CPU build of torch"),
    }
    with open(path, "w") as f:
        f.write("# Written by setup.py when the extension was built; read by `nanfast --version`.\n")
        f.write(f"BUILD = {record!r}\n")


class BuildExtensionWithRecord(BuildExtension):
    """torch's BuildExtension, then the build record beside the extension it built (only a build writes
    it: `sdist` or `egg_info` build nothing)."""

    def run(self) -> None:
        super().run()
        package_dir = "nanfast" if self.inplace else os.path.join(self.build_lib, "nanfast")
        write_build_record(os.path.join(package_dir, "_build.py"))

sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp") + glob.glob("csrc/python/*.cpp"))
extension = CppExtension
extra_compile_args = {"cxx": cxx_flags}
define_macros = []
if with_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    extension = CUDAExtension
    extra_compile_args["nvcc"] = nvcc_flags
    define_macros.append(("NANFAST_WITH_CUDA", None))

setup(
    install_requires=[f"torch=={TORCH_RELEASE}"],  # the torch it was built against (see the NOTE above)
    packages=find_packages(include=["nanfast", "nanfast.*"]),
    ext_modules=[
        extension(
            "nanfast._C",
            sources,
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=link_flags,
        )
    ],
    cmdclass={"build_ext": BuildExtensionWithRecord},
)
