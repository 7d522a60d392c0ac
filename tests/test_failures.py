"""A peer that never comes, or dies, ends in an error that names the op: never a hang. A peer that is
only slow is waited for."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import torch_chainermn

from tests.support.harness import run_mpiexec, run_spawn


def missing_peer():
    """Rank 0 calls all_reduce on a group with a 3 s timeout; rank 1 never does."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    outcome = {}
    if rank == 0:
        work = dist.all_reduce(torch.ones(8), group=group, async_op=True)
        try:
            work.wait()
            outcome["first"] = "completed"
        except dist.DistBackendError as error:
            outcome["first"] = str(error)
        future_error = None
        try:
            work.get_future().wait()
        except Exception as error:  # noqa: BLE001
            future_error = str(error)
        outcome["future"] = future_error
        try:
            dist.all_reduce(torch.ones(2), group=group)
            outcome["second"] = "completed"
        except dist.DistBackendError as error:
            outcome["second"] = str(error)
    # The default group is untouched by the other group's failure.
    check = torch.ones(1)
    dist.all_reduce(check)
    outcome["default_group_after"] = check.item()
    return outcome


def check_missing_peer(outcome):
    assert "all_reduce" in outcome["first"] and "timed out" in outcome["first"], outcome["first"]
    assert "3000 ms" in outcome["first"], outcome["first"]
    assert outcome["future"] is not None and "all_reduce" in outcome["future"]
    assert "all_reduce" in outcome["second"] and "unusable" in outcome["second"], outcome["second"]
    assert outcome["default_group_after"] == 2.0


def test_missing_peer_times_out_over_gloo():
    outcomes = run_spawn(missing_peer, 2, timeout=90)
    check_missing_peer(outcomes[0])


@pytest.mark.mpi
def test_missing_peer_times_out_over_mpi():
    # Rank 0's MPI call can never return, so it exits without MPI_Finalize and mpiexec reports the
    # job as failed: what matters is that every rank got its error and the job ended.
    outcomes = run_mpiexec(missing_peer, 2, timeout=90, allow_abnormal_exit=True)
    check_missing_peer(outcomes[0])


def peer_goes(how: str):
    """Rank 1 goes after a barrier: `dies` (os._exit, as a crash: nothing runs) or `leaves` (destroys
    the group, then its process ends normally); rank 0's all_reduce says what it saw, and whether it
    ran on rank 0's own thread (a blocking op over shared memory: backend/funnel.cpp)."""
    dist.barrier()
    if dist.get_rank() == 1:
        if how == "dies":
            os._exit(0)
        dist.destroy_process_group()
        return "left"
    backend = torch_chainermn._backend.backend_of()
    before = backend.ops_run_on_caller()
    try:
        dist.all_reduce(torch.ones(4))
        said = "completed"
    except dist.DistBackendError as error:
        said = str(error)
    return said, backend.ops_run_on_caller() - before


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_dead_peer_gives_an_error(shm):
    # Well before the 60 s group timeout: the transport notices the death, and says which rank.
    outcomes = run_spawn(
        peer_goes, 2, "dies", timeout=50, op_timeout=60, dies={1: "exit code 0"}, env={"CHAINERMN_SHM": shm}
    )
    said, on_caller = outcomes[0]
    assert "all_reduce" in said, said
    assert "rank 1 (host" in said and "died" in said, said  # named over Gloo too
    # Over shared memory the op ran on the caller's thread: the segment's wait saw the death itself.
    assert on_caller == (1 if shm == "1" else 0), outcomes[0]
    if shm == "1":
        assert "local rank 1" in said, said


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_a_peer_that_left_on_purpose_is_named_as_exited_not_dead(shm):
    # Rank 0's default group breaks at rank 1's departure, which is no death: the test says it may.
    outcomes = run_spawn(
        peer_goes, 2, "leaves", timeout=50, op_timeout=20, env={"CHAINERMN_SHM": shm}, group_may_break=True
    )
    assert outcomes[1] == "left"
    said, _ = outcomes[0]
    assert "rank 1 (host" in said and "exited" in said, said
    assert "died" not in said, said


def slow_peer():
    """Rank 1 arrives 0.2 s late at each all_reduce (3 chunks of shared memory each): rank 0 spins,
    yields, then sleeps on rank 1's futex until rank 1's flags wake it, at every barrier."""
    import time

    rank = dist.get_rank()
    results = []
    for step in range(3):
        if rank == 1:
            time.sleep(0.2)
        tensor = torch.full((3 * 2**18 + 5,), float(rank + 1 + step))  # 3 MiB and a bit: 4 chunks
        dist.all_reduce(tensor)
        results.append(sorted(set(tensor.tolist())))
    return results


def test_slow_peer_is_waited_for_over_shared_memory():
    results = run_spawn(slow_peer, 2, env={"CHAINERMN_SHM": "1"})
    expected = [[float(3 + 2 * step)] for step in range(3)]
    assert results == [expected, expected], results
