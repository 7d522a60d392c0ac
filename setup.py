"""Build torch-chainermn's C++ backend as a PyTorch C++ extension.

MPI support is compiled in when `mpicc` is found (Open MPI's wrapper tells us its flags);
without it the backend still builds and runs on Gloo.
"""
import glob
import os
import shutil
import subprocess

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension


def mpi_flags():
    """Compile and link flags of the MPI found on PATH, or None when there is none."""
    if os.environ.get("CHAINERMN_NO_MPI") == "1" or shutil.which("mpicc") is None:
        return None
    try:
        compile_args = subprocess.check_output(["mpicc", "--showme:compile"], text=True).split()
        link_args = subprocess.check_output(["mpicc", "--showme:link"], text=True).split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return compile_args, link_args


sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
define_macros = []
extra_compile_args = ["-O3", "-std=c++17", "-Wall", "-Wno-unused-parameter"]
extra_link_args = []

flags = mpi_flags()
if flags is None:
    sources = [s for s in sources if not s.endswith("comm/mpi.cpp")]
else:
    define_macros.append(("CHAINERMN_WITH_MPI", "1"))
    # Only MPI's C API: keep the deprecated C++ bindings out of the link.
    define_macros += [("OMPI_SKIP_MPICXX", "1"), ("MPICH_SKIP_MPICXX", "1")]
    extra_compile_args += flags[0]
    extra_link_args += flags[1]

setup(
    name="torch-chainermn",
    version="0.1.0",
    description="ChainerMN's distributed training strategies as a torch.distributed backend",
    packages=find_packages(include=["torch_chainermn", "torch_chainermn.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy"],
    ext_modules=[
        CppExtension(
            name="torch_chainermn._C",
            sources=sources,
            include_dirs=[os.path.abspath("csrc")],
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
