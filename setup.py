"""Builds nanfast._C: the CPU kernels always, the CUDA kernels when torch is a CUDA build and a CUDA
toolkit is found (no GPU is needed to build).

Environment:
  CUDA_HOME              toolkit to use (else CUDA_PATH, else /usr/local/cuda)
  TORCH_CUDA_ARCH_LIST   GPU architectures (default: the visible GPUs, else DEFAULT_CUDA_ARCHS)
  NANFAST_CPU_ONLY=1     skip the CUDA kernels
  NANFAST_WERROR=1       treat compiler warnings in csrc/ as errors (CI)
"""

import glob
import os

from setuptools import find_packages, setup

DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0;12.0+PTX"


def find_cuda_home():
    # torch guesses the toolkit from the nvcc on PATH; where that nvcc is a wrapper script
    # (e.g. /usr/local/bin/nvcc) it guesses /usr/local, so look for the headers ourselves.
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            return home
    return None


cuda_home = None if os.environ.get("NANFAST_CPU_ONLY") == "1" else find_cuda_home()
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home  # read once, when torch.utils.cpp_extension is imported

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

with_cuda = cuda_home is not None and torch.version.cuda is not None
if with_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS

werror = os.environ.get("NANFAST_WERROR") == "1"
cxx_flags = ["-O3", "-fopenmp", "-Wall", "-Wextra", "-Wno-unused-parameter"] + (["-Werror"] if werror else [])
# No --use_fast_math: it flushes subnormals, which the kernels must classify and sum exactly.
nvcc_flags = ["-O3", "-Xcompiler", "-Wall"] + (["-Werror", "all-warnings", "-Xcompiler", "-Werror"] if werror else [])

sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
extension = CppExtension
extra_compile_args = {"cxx": cxx_flags}
define_macros = []
if with_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    extension = CUDAExtension
    extra_compile_args["nvcc"] = nvcc_flags
    define_macros.append(("NANFAST_WITH_CUDA", None))

setup(
    packages=find_packages(include=["nanfast", "nanfast.*"]),
    ext_modules=[
        extension(
            "nanfast._C",
            sources,
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
