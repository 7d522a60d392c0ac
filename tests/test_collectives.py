"""Every collective x dtype x reduce op on 2, 3 and 4 ranks, over both transports.

Each (launcher, world size) runs once: every rank executes all of collective_cases.CASES in one
process group, and each case is reported here as its own test.
"""
import functools

import pytest

from tests import collective_cases
from tests.harness import run_mpiexec, run_spawn

CONFIGS = [("gloo", 2), ("gloo", 3), ("gloo", 4), ("mpi", 2), ("mpi", 3), ("mpi", 4)]


@functools.lru_cache(maxsize=None)
def matrix(transport: str, size: int):
    run = run_spawn if transport == "gloo" else run_mpiexec
    return run(collective_cases.run_cases, size, timeout=600)


@pytest.mark.parametrize(
    "transport,size",
    [pytest.param(t, n, id=f"{t}-{n}ranks", marks=[pytest.mark.mpi] if t == "mpi" else []) for t, n in CONFIGS],
)
@pytest.mark.parametrize("case", list(collective_cases.CASES))
def test_collective(transport, size, case):
    results = matrix(transport, size)
    assert all(r["__transport__"] == transport for r in results), [r["__transport__"] for r in results]
    failures = [f"rank {rank}:\n{r[case]}" for rank, r in enumerate(results) if r[case]]
    assert not failures, "\n".join(failures)
