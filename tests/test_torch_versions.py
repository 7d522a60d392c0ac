"""The torch releases the build supports (tools/torch_support.py), through setup.py's own code: the C++
standard each gets, the clear stop for any other, the CUDA architectures without a GPU, and the version
a wheel's name carries. No compiling: the torch is faked where it is not the installed one."""

import os
import re

import pytest
import torch

from tests.test_build import setup_py_arguments, setup_py_extension

SUPPORTED = ["2.12.1+cu130", "2.13.0+cpu", "2.13.0", "2.14.1+cu130"]


def standards(ext):
    """Every -std flag of `ext`, for the host compiler and nvcc."""
    args = ext.extra_compile_args
    flat = args["cxx"] + args["nvcc"] if isinstance(args, dict) else args
    return {flag for flag in flat if flag.startswith("-std=")}


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
@pytest.mark.parametrize("version", SUPPORTED)
def test_each_supported_torch_gets_the_standard_its_headers_require(monkeypatch, tmp_path, version, cuda):
    monkeypatch.setattr(torch, "__version__", version)
    ext = setup_py_extension(monkeypatch, tmp_path, cuda=cuda, mpi=False)
    # torch 2.14's ATen.h: "#error C++20 or later compatible compiler is required"; 2.12 and 2.13: C++17.
    expected = "-std=c++20" if version.startswith("2.14") else "-std=c++17"
    assert standards(ext) == {expected}


@pytest.mark.parametrize("version", ["2.11.0", "2.15.0+cu130", "3.0.0"])
def test_another_torch_stops_the_build_saying_which_are_supported(monkeypatch, tmp_path, version):
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.delenv("CHAINERMN_UNSUPPORTED_TORCH", raising=False)
    with pytest.raises(SystemExit) as stop:
        setup_py_arguments(monkeypatch, tmp_path)
    message = str(stop.value.code)
    assert message.startswith("error: ") and version in message
    assert "2.12, 2.13, 2.14" in message and "CHAINERMN_UNSUPPORTED_TORCH=1" in message


def test_the_override_builds_against_a_newer_torch_with_the_newest_standard(monkeypatch, tmp_path):
    monkeypatch.setattr(torch, "__version__", "2.15.0+cu130")
    monkeypatch.setenv("CHAINERMN_UNSUPPORTED_TORCH", "1")
    assert standards(setup_py_extension(monkeypatch, tmp_path, cuda=False, mpi=False)) == {"-std=c++20"}


def test_without_a_gpu_the_cuda_build_targets_the_installed_torchs_architectures(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # What torch compiled in; torch.cuda.get_arch_list() says [] without a GPU before 2.14.
    monkeypatch.setattr(torch._C, "_cuda_getArchFlags", lambda: "sm_80 sm_90 sm_100 compute_120", raising=False)
    setup_py_extension(monkeypatch, tmp_path, cuda=True, mpi=False, arch_list=None)
    # Read by torch's BuildExtension when it compiles (the monkeypatched environment is restored after).
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0"


def test_an_explicit_arch_list_wins(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getArchFlags", lambda: "sm_80 sm_90", raising=False)
    setup_py_extension(monkeypatch, tmp_path, cuda=True, mpi=False, arch_list="12.0")
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "12.0"


def test_a_torch_that_names_no_architecture_asks_for_the_list(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getArchFlags", lambda: None, raising=False)
    with pytest.raises(SystemExit, match="TORCH_CUDA_ARCH_LIST"):
        setup_py_extension(monkeypatch, tmp_path, cuda=True, mpi=False, arch_list=None)


def test_a_toolkit_without_cuda_runtime_h_is_named_before_compiling(monkeypatch, tmp_path):
    """torch guesses CUDA_HOME from nvcc's place (/usr/local for a wrapper on PATH): a clear stop, not
    a compiler error on every CUDA source."""
    with pytest.raises(SystemExit, match=r"CUDA_HOME=/usr/local has no include/cuda_runtime.h.*CHAINERMN_NO_CUDA=1"):
        setup_py_extension(monkeypatch, tmp_path, cuda=True, mpi=False, cuda_home="/usr/local")


@pytest.mark.parametrize(
    "version, cuda, label",
    [
        ("2.14.1+cu130", True, "torch2.14.cu130"),
        ("2.14.1+cu130", False, "torch2.14"),  # CHAINERMN_NO_CUDA=1: a CPU build of a CUDA torch
        ("2.12.1", False, "torch2.12"),
    ],
)
def test_the_distribution_version_names_the_torch_and_cuda(monkeypatch, tmp_path, version, cuda, label):
    monkeypatch.setattr(torch, "__version__", version)
    arguments = setup_py_arguments(monkeypatch, tmp_path, cuda=cuda)
    public, _, local = arguments["version"].partition("+")
    assert re.fullmatch(r"\d+(\.\d+)*", public) and local == label
