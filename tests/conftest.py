import fnmatch
import pathlib

import pytest
import torch

SMOKE_SELECTION = pathlib.Path(__file__).with_name("smoke.txt")


def smoke_patterns():
    """tests/smoke.txt's patterns: a line each, # comments and blank lines left out."""
    lines = (line.strip() for line in SMOKE_SELECTION.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def pytest_configure(config):
    import torch_chainermn

    if not hasattr(torch_chainermn._C, "testing"):
        raise pytest.UsageError(
            "torch_chainermn._C was built without its test harnesses: build it with "
            "CHAINERMN_TESTING=1 (`make install` does; tools/build_sources.py)"
        )
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped on machines without one)")
    config.addinivalue_line("markers", "mpi: runs ranks under Open MPI's mpiexec")
    config.addinivalue_line("markers", "smoke: the selection run on other torch releases (tests/smoke.txt)")


def pytest_collection_modifyitems(config, items):
    mark_smoke_selection(config, items)
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(no_gpu)


def mark_smoke_selection(config, items):
    """Mark the tests tests/smoke.txt names `smoke`. Under `-m smoke`, a pattern that matches no
    collected test is an error: the selection must not shrink when a test is renamed."""
    unmatched = []
    for pattern in smoke_patterns():
        matched = [item for item in items if fnmatch.fnmatchcase(item.nodeid, pattern)]
        for item in matched:
            item.add_marker(pytest.mark.smoke)
        # Only a pattern of a file this run collected: `pytest tests/test_ddp.py -m smoke` is fine.
        collected = any(item.nodeid.startswith(pattern.split("::")[0] + "::") for item in items)
        if not matched and collected:
            unmatched.append(pattern)
    if unmatched and config.getoption("markexpr") == "smoke":
        raise pytest.UsageError("tests/smoke.txt names tests that do not exist: " + ", ".join(unmatched))


def pytest_terminal_summary(terminalreporter, config):
    """tests/test_docs.py's count of the docs' code blocks, with every reason one is not run."""
    report = getattr(config, "docs_snippets_report", None)
    if report:
        terminalreporter.write_sep("-", "docs")
        terminalreporter.write_line(report)
