"""Every collective x dtype x reduce op on 2, 3 and 4 ranks, over both transports.

Each (launcher, world size) runs once: every rank executes all of collective_cases.CASES in one
process group, and each case is reported here as its own test.
"""

import pytest

from tests.support import collective_cases
from tests.support.harness import cached_launch, run_mpiexec, run_spawn

# On one host the node's ranks share memory, so the library's own collectives (Gloo's, MPI's) are
# checked with shared memory turned off ("-noshm"). With it on, the segment carries every op of a
# one-node group, collectives and point to point alike, whichever library the ranks agreed on
# (csrc/backend/host_transports.cpp): the sizes that segment serves are checked under spawn (gloo
# 2, 3, 4), and mpiexec's ranks taking that path once (mpi, 2 ranks); 3 and 4 ranks under mpiexec
# would run the same segment code again.
CONFIGS = [("gloo", 2), ("gloo", 3), ("gloo", 4), ("mpi", 2), ("gloo-noshm", 3), ("mpi-noshm", 3)]


def cases_and_device_case_sets() -> tuple:
    """collective_cases.CASES, then the device case sets on the CPU (below), in the same processes."""
    return collective_cases.run_cases(), device_case_sets_on_cpu()


@cached_launch
def launch_matrix(config: str, size: int):
    transport, _, shm = config.partition("-")
    run = run_spawn if transport == "gloo" else run_mpiexec
    env = {"CHAINERMN_SHM": "0" if shm == "noshm" else "1"}
    if (config, size) == ("gloo", 2):
        # One launch fewer: the 2-rank Gloo job also runs test_device_case_sets_on_cpu's sets.
        return run(cases_and_device_case_sets, size, env=env, timeout=600)
    return [(outcome, None) for outcome in run(collective_cases.run_cases, size, env=env, timeout=600)]


def matrix(config: str, size: int):
    return [outcome for outcome, _ in launch_matrix(config, size)]


@pytest.mark.parametrize(
    "transport,size",
    [
        pytest.param(t, n, id=f"{t}-{n}ranks", marks=[pytest.mark.mpi] if t.startswith("mpi") else [])
        for t, n in CONFIGS
    ],
)
@pytest.mark.parametrize("case", list(collective_cases.CASES))
def test_collective(transport, size, case):
    results = matrix(transport, size)
    expected = (transport.partition("-")[0], not transport.endswith("noshm"))
    assert all(r["__transport__"] == expected for r in results), [r["__transport__"] for r in results]
    failures = [f"rank {rank}:\n{r[case]}" for rank, r in enumerate(results) if r[case]]
    assert not failures, "\n".join(failures)


# The case sets tests/test_cuda_collectives.py runs on CUDA tensors (every reduction with every op,
# point to point in orders NCCL can serve), built here for the CPU: their expectations hold on every
# machine, not only on one with a GPU.
def device_case_sets_on_cpu():
    dtypes = collective_cases.NCCL_DTYPES
    cases = {
        **collective_cases.device_collective_cases("cpu", dtypes),
        **collective_cases.device_point_to_point_cases("cpu", dtypes),
    }
    return collective_cases.run_cases(cases=cases)


def test_device_case_sets_on_cpu():
    results = [device for _, device in launch_matrix("gloo", 2)]  # 2 ranks, spawn, shared memory on
    failures = [
        f"rank {rank} {case}:\n{error}"
        for rank, r in enumerate(results)
        for case, error in r.items()
        if error and not case.startswith("__")
    ]
    assert len(results[0]) > 150, sorted(results[0])  # the sets are really there
    assert not failures, "\n".join(failures[:5])
