import pytest
import torch


def pytest_configure(config):
    import torch_chainermn

    if not hasattr(torch_chainermn._C, "testing"):
        raise pytest.UsageError("torch_chainermn._C was built without its test harnesses: build it with "
                                "CHAINERMN_TESTING=1 (`make install` does; tools/build_sources.py)")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped on machines without one)")
    config.addinivalue_line("markers", "mpi: runs ranks under Open MPI's mpiexec")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(no_gpu)
