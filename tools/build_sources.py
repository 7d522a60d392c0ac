#!/usr/bin/env python3
"""The one list of sources of torch_chainermn._C, read by every build description.

setup.py imports this module; CMakeLists.txt and tools/check_cuda_compile.sh run it
(`--format cmake` / `--format lines`). It needs nothing but the standard library (no torch).

Which build compiles which file under csrc/:
  csrc/cuda/**         CUDA builds only (CUDA tensors, NCCL, the .cu kernels). Every .cu lives here.
  csrc/comm/mpi*.cpp   MPI builds only (mpicc found).
  csrc/testing/**      test builds only (CHAINERMN_TESTING=1, which `make install` sets): the
                       in-process harnesses of torch_chainermn._C.testing. A user's install
                       (pip install .) leaves them out.
  everything else      every build.

Every source must compile to an object of its own: `object_names` derives object paths exactly as
torch.utils.cpp_extension.BuildExtension does (with or without ninja) and refuses a list in which
two sources map to the same object (csrc/kernels/pack.cpp and pack.cu were both pack.o once).

    python3 tools/build_sources.py --cuda --mpi --testing --format lines    # one path per line
    python3 tools/build_sources.py --format cmake                 # a CMake list (a;b;c)
    python3 tools/build_sources.py --cuda --mpi --objects         # source -> object, checked
"""

import argparse
import fnmatch
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = "csrc"
CUDA_ONLY = "csrc/cuda/*"  # fnmatch: "*" matches "/" too, so this is the whole subtree
MPI_ONLY = "csrc/comm/mpi*.cpp"
TESTING_ONLY = ("csrc/testing/*",)
SOURCE_SUFFIXES = (".cpp", ".cu")

# What BuildExtension's compiler accepts and how it names objects: distutils' UnixCCompiler
# (src_extensions, obj_extension ".o") plus the extensions BuildExtension.build_extensions adds.
COMPILER_SUFFIXES = (".c", ".C", ".cc", ".cxx", ".cpp", ".m", ".cu", ".cuh", ".hip", ".sycl", ".mm")
OBJECT_SUFFIX = ".o"


class BuildSourceError(ValueError):
    """The sources under csrc/ cannot be built as laid out (a clash, a misplaced file)."""


def all_sources(root=ROOT):
    """Every .cpp and .cu under csrc/, as sorted root-relative POSIX paths."""
    base = pathlib.Path(root)
    return sorted(
        p.relative_to(base).as_posix() for p in (base / CSRC).rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()
    )


def is_cuda_only(path):
    return fnmatch.fnmatchcase(path, CUDA_ONLY)


def is_mpi_only(path):
    return fnmatch.fnmatchcase(path, MPI_ONLY)


def is_testing_only(path):
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in TESTING_ONLY)


def selected(path, cuda, mpi, testing=False):
    """Whether the build with (cuda, mpi, testing) compiles `path` (a root-relative POSIX path)."""
    if path.endswith(".cu") and not is_cuda_only(path):
        raise BuildSourceError(
            f"{path}: CUDA sources belong in csrc/cuda/ (the CPU build compiles everything outside it)"
        )
    return (
        (cuda or not is_cuda_only(path)) and (mpi or not is_mpi_only(path)) and (testing or not is_testing_only(path))
    )


def sources(cuda, mpi, testing=False, root=ROOT):
    """The sources of the build with CUDA and/or MPI (and the test harnesses with `testing`), sorted,
    relative to the repository root.

    The list is checked: it raises BuildSourceError if two of them would share an object file.
    """
    chosen = [p for p in all_sources(root) if selected(p, cuda, mpi, testing)]
    object_names(chosen)
    return chosen


def object_name(source, build_temp=""):
    """The object BuildExtension compiles `source` to, under `build_temp`.

    distutils' CCompiler._make_out_path_exts, which BuildExtension's ninja path
    (unix_wrap_ninja_compile -> _setup_compile -> object_filenames) and its plain path both use:
    the source path made relative (its anchor dropped), its last suffix replaced by ".o",
    joined to the build directory. So the directories are kept and only the suffix goes:
    a/x.cpp and a/x.cu are both a/x.o.
    """
    src = pathlib.PurePath(source)
    if src.suffix not in COMPILER_SUFFIXES:
        raise BuildSourceError(f"unknown file type {src.suffix!r} (from {source!r})")
    base = src.relative_to(src.anchor)
    return os.path.join(build_temp, base.with_suffix(OBJECT_SUFFIX))


def object_names(srcs, build_temp=""):
    """The objects of `srcs`, one per source, in order; BuildSourceError if two coincide."""
    objects = [object_name(s, build_temp) for s in srcs]
    owner = {}
    for src, obj in zip(srcs, objects):
        # Compare absolute, normalised paths, as ninja sees them (BuildExtension makes both absolute).
        key = os.path.normpath(os.path.abspath(obj))
        if key in owner:
            raise BuildSourceError(
                f"{owner[key]} and {src} would both compile to {obj}; "
                "give one of them another name (every source needs an object of its own)"
            )
        owner[key] = src
    return objects


def _main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda", action="store_true", help="the CUDA build's sources")
    parser.add_argument("--mpi", action="store_true", help="the MPI build's sources")
    parser.add_argument("--testing", action="store_true", help="the test build's sources (the harnesses too)")
    parser.add_argument(
        "--format", choices=("lines", "cmake"), default="lines", help="one path per line, or a CMake list (a;b;c)"
    )
    parser.add_argument("--absolute", action="store_true", help="absolute paths")
    parser.add_argument(
        "--objects", action="store_true", help="print 'source object' pairs (objects relative to the build directory)"
    )
    args = parser.parse_args(argv)
    try:
        srcs = sources(cuda=args.cuda, mpi=args.mpi, testing=args.testing)
    except BuildSourceError as e:
        print(f"build_sources.py: error: {e}", file=sys.stderr)
        return 1
    if args.objects:
        for src, obj in zip(srcs, object_names(srcs)):
            print(src, obj)
        return 0
    if args.absolute:
        srcs = [(ROOT / s).as_posix() for s in srcs]
    print(";".join(srcs) if args.format == "cmake" else "\n".join(srcs))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
