"""The build's source selection (tools/build_sources.py), checked on the CPU-only CI without compiling.

The CUDA build once failed because csrc/kernels/pack.cpp and pack.cu both became pack.o. These tests
run setup.py's own code for every (CUDA, MPI) combination (CUDA and mpicc faked), hand the extension
it builds to torch's BuildExtension and stop it where it gives ninja the object list: so they see the
objects exactly as a real build would, and fail if two sources share one.
"""

import importlib.util
import os
import pathlib
import runpy
import subprocess
import sys

import pytest
import setuptools
import torch
import torch.utils.cpp_extension as cpp_extension

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILDS = [(False, False), (False, True), (True, False), (True, True)]
BUILD_IDS = ["cpu", "cpu+mpi", "cuda+nompi", "cuda+mpi"]


def _load_build_sources():
    spec = importlib.util.spec_from_file_location("build_sources", ROOT / "tools" / "build_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_sources = _load_build_sources()


def csrc_sources():
    """Every .cpp/.cu under csrc/, found here independently of the module under test."""
    found = []
    for dirpath, _, files in os.walk(ROOT / "csrc"):
        for name in files:
            if name.endswith((".cpp", ".cu")):
                found.append((pathlib.Path(dirpath) / name).relative_to(ROOT).as_posix())
    return sorted(found)


class _StopBeforeCompiling(Exception):
    pass


def setup_py_extension(monkeypatch, tmp_path, cuda, mpi, testing=True, arch_list="9.0", cuda_home=None):
    """The Extension setup.py passes to setup() for this (cuda, mpi, testing), without building anything."""
    (ext,) = setup_py_arguments(monkeypatch, tmp_path, cuda, mpi, testing, arch_list, cuda_home)["ext_modules"]
    return ext


def setup_py_arguments(monkeypatch, tmp_path, cuda=False, mpi=False, testing=True, arch_list="9.0", cuda_home=None):
    """Everything setup.py passes to setup() for this (cuda, mpi, testing), without building anything.
    A CUDA build gets TORCH_CUDA_ARCH_LIST=`arch_list` (None: unset, as on a build node) and a toolkit
    (`cuda_home`, or a folder made here with the header setup.py checks)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("CHAINERMN_TESTING", "1" if testing else "0")
    monkeypatch.setattr(sys, "path", list(sys.path))  # setup.py prepends tools/
    monkeypatch.delenv("CHAINERMN_NO_CUDA", raising=False)
    if mpi:  # an mpicc that answers --showme:compile / --showme:link (made once per test)
        fake = tmp_path / "bin"
        if not fake.exists():
            fake.mkdir()
            (fake / "mpicc").write_text("#!/bin/sh\necho -I/nonexistent/mpi/include\n")
            (fake / "mpicc").chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("CHAINERMN_NO_MPI", raising=False)
    else:
        monkeypatch.setenv("CHAINERMN_NO_MPI", "1")
    if cuda:  # a CUDA torch, as setup.py asks for one (torch.version.cuda and CUDA_HOME)
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        toolkit = tmp_path / "cuda"  # a toolkit with the header setup.py looks for
        (toolkit / "include").mkdir(parents=True, exist_ok=True)
        (toolkit / "include" / "cuda_runtime.h").touch()
        monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(cuda_home or toolkit))
        if arch_list is None:
            monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
        else:
            monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)  # no GPU to ask
    else:
        monkeypatch.setenv("CHAINERMN_NO_CUDA", "1")
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    return captured


def build_extension_objects(monkeypatch, tmp_path, ext):
    """The object files torch's BuildExtension (ninja) would compile `ext`'s sources to."""
    captured = {}

    def write_ninja_file_and_compile_objects(sources, objects, **kwargs):
        captured["sources"], captured["objects"] = list(sources), list(objects)
        raise _StopBeforeCompiling

    monkeypatch.setattr(cpp_extension, "_write_ninja_file_and_compile_objects", write_ninja_file_and_compile_objects)
    monkeypatch.setattr(cpp_extension, "_check_cuda_version", lambda *args: None)
    dist = setuptools.Distribution({"name": "torch-chainermn", "ext_modules": [ext]})
    cmd = cpp_extension.BuildExtension(dist)
    cmd.use_ninja = True  # the path pip and setup.py take (ninja is installed with the venv)
    cmd.build_temp = str(tmp_path / "temp")
    cmd.build_lib = str(tmp_path / "lib")
    cmd.ensure_finalized()
    with pytest.raises(_StopBeforeCompiling):
        cmd.run()
    return captured["sources"], captured["objects"], cmd.build_temp


@pytest.mark.parametrize("testing", [True, False], ids=["test build", "user build"])
@pytest.mark.parametrize("cuda,mpi", BUILDS, ids=BUILD_IDS)
def test_setup_py_builds_the_shared_list(monkeypatch, tmp_path, cuda, mpi, testing):
    ext = setup_py_extension(monkeypatch, tmp_path, cuda, mpi, testing)
    assert ext.sources == build_sources.sources(cuda=cuda, mpi=mpi, testing=testing)
    assert isinstance(ext.extra_compile_args, dict) == cuda  # CUDAExtension's {"cxx", "nvcc"}
    macros = dict(ext.define_macros)
    assert ("CHAINERMN_WITH_MPI" in macros) == mpi
    assert ("CHAINERMN_WITH_CUDA" in macros) == cuda
    # A test build compiles every common source exactly as a user's build does (it only links the
    # harnesses in: csrc/python/submodules.h), so the two share objects and a wheel only relinks.
    user = setup_py_extension(monkeypatch, tmp_path, cuda, mpi, testing=False)
    assert (ext.define_macros, ext.extra_compile_args) == (user.define_macros, user.extra_compile_args)


@pytest.mark.parametrize("cuda,mpi", BUILDS, ids=BUILD_IDS)
def test_every_source_compiles_to_its_own_object(monkeypatch, tmp_path, cuda, mpi):
    ext = setup_py_extension(monkeypatch, tmp_path, cuda, mpi)
    sources, objects, build_temp = build_extension_objects(monkeypatch, tmp_path, ext)
    assert sources == ext.sources
    clashes = {o: [s for s, o2 in zip(sources, objects) if o2 == o] for o in objects}
    assert {o: s for o, s in clashes.items() if len(s) > 1} == {}
    # The module predicts BuildExtension's object names exactly (so setup.py's early check is real).
    assert build_sources.object_names(sources, build_temp) == objects


def test_a_user_build_has_no_test_harness():
    """What `pip install .` compiles (no CHAINERMN_TESTING) leaves out csrc/testing/ and the
    _C.testing bindings, and the test build has every one of them; nothing else differs."""
    harness = {s for s in csrc_sources() if s.startswith("csrc/testing/")}
    assert harness
    for cuda, mpi in BUILDS:
        user = set(build_sources.sources(cuda=cuda, mpi=mpi))
        test = set(build_sources.sources(cuda=cuda, mpi=mpi, testing=True))
        assert not user & harness and test - user == harness
    # The module's init knows no harness by name: the harness registers itself where it is linked.
    bindings = (ROOT / "csrc" / "python" / "bindings.cpp").read_text()
    assert "testing/bindings.h" not in bindings and "bindTesting" not in bindings
    assert 'registerSubmodule("testing"' in (ROOT / "csrc" / "testing" / "bindings.cpp").read_text()


def test_each_source_is_in_the_builds_it_belongs_to():
    selections = {build: set(build_sources.sources(cuda=build[0], mpi=build[1], testing=True)) for build in BUILDS}
    all_sources = csrc_sources()
    assert any(s.startswith("csrc/cuda/") for s in all_sources)
    for src in all_sources:
        in_builds = {build for build, chosen in selections.items() if src in chosen}
        cuda_only = src.startswith("csrc/cuda/")
        mpi_only = src.startswith("csrc/comm/mpi") and src.endswith(".cpp")
        expected = {(cuda, mpi) for cuda, mpi in BUILDS if (cuda or not cuda_only) and (mpi or not mpi_only)}
        assert in_builds == expected, src
        if src.endswith(".cu"):
            assert cuda_only, f"{src}: .cu files belong in csrc/cuda/"
    assert set().union(*selections.values()) == set(all_sources)


def test_a_colliding_list_is_refused_naming_both():
    with pytest.raises(build_sources.BuildSourceError) as info:
        build_sources.object_names(["csrc/a.cpp", "csrc/kernels/pack.cpp", "csrc/kernels/pack.cu"])
    assert "csrc/kernels/pack.cpp" in str(info.value) and "csrc/kernels/pack.cu" in str(info.value)
    assert build_sources.object_names(["csrc/kernels/pack.cpp", "csrc/cuda/pack.cu"], "b") == [
        os.path.join("b", "csrc/kernels/pack.o"),
        os.path.join("b", "csrc/cuda/pack.o"),
    ]


def test_a_colliding_tree_is_refused_and_cu_files_stay_in_csrc_cuda(tmp_path):
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    (tmp_path / "csrc" / "cuda" / "pack.cpp").write_text("")
    (tmp_path / "csrc" / "cuda" / "pack.cu").write_text("")
    assert build_sources.sources(cuda=False, mpi=True, root=tmp_path) == []
    with pytest.raises(build_sources.BuildSourceError, match="csrc/cuda/pack.cpp and csrc/cuda/pack.cu"):
        build_sources.sources(cuda=True, mpi=False, root=tmp_path)
    (tmp_path / "csrc" / "cuda" / "pack.cu").rename(tmp_path / "csrc" / "pack.cu")
    with pytest.raises(build_sources.BuildSourceError, match="csrc/pack.cu: CUDA sources belong"):
        build_sources.sources(cuda=False, mpi=False, root=tmp_path)


def test_cli_and_compile_check_script_list_the_same_sources():
    cli = [sys.executable, str(ROOT / "tools" / "build_sources.py")]
    for cuda, mpi in BUILDS:
        flags = ["--cuda"] * cuda + ["--mpi"] * mpi + ["--testing"]
        expected = build_sources.sources(cuda=cuda, mpi=mpi, testing=True)
        out = subprocess.run(cli + flags + ["--format", "cmake"], check=True, capture_output=True, text=True).stdout
        assert out.strip().split(";") == expected
    dry = subprocess.run(
        [str(ROOT / "tools" / "check_cuda_compile.sh"), "--dry-run"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "MPI": "1", "PYTHON": sys.executable},
    ).stdout
    listed = [line.split()[2] for line in dry.splitlines() if line.startswith("would compile")]
    assert sorted(listed) == build_sources.sources(cuda=True, mpi=True, testing=True)
