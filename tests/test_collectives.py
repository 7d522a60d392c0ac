"""Every collective x dtype x reduce op on 2, 3 and 4 ranks, over both transports.

Each (launcher, world size) runs once: every rank executes all of collective_cases.CASES in one
process group, and each case is reported here as its own test.
"""
import functools

import pytest

from tests import collective_cases
from tests.harness import run_mpiexec, run_spawn

# On one host the node's ranks share memory, so the library's own collectives (Gloo's, MPI's) are
# checked with shared memory turned off ("-noshm").
CONFIGS = [("gloo", 2), ("gloo", 3), ("gloo", 4), ("mpi", 2), ("mpi", 3), ("mpi", 4),
           ("gloo-noshm", 3), ("mpi-noshm", 3)]


@functools.lru_cache(maxsize=None)
def matrix(config: str, size: int):
    transport, _, shm = config.partition("-")
    run = run_spawn if transport == "gloo" else run_mpiexec
    env = {"CHAINERMN_SHM": "0" if shm == "noshm" else "1"}
    return run(collective_cases.run_cases, size, env=env, timeout=600)


@pytest.mark.parametrize(
    "transport,size",
    [pytest.param(t, n, id=f"{t}-{n}ranks", marks=[pytest.mark.mpi] if t.startswith("mpi") else [])
     for t, n in CONFIGS],
)
@pytest.mark.parametrize("case", list(collective_cases.CASES))
def test_collective(transport, size, case):
    results = matrix(transport, size)
    expected = (transport.partition("-")[0], not transport.endswith("noshm"))
    assert all(r["__transport__"] == expected for r in results), [r["__transport__"] for r in results]
    failures = [f"rank {rank}:\n{r[case]}" for rank, r in enumerate(results) if r[case]]
    assert not failures, "\n".join(failures)
