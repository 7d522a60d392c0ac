"""A rank that leaves its group on purpose, and the survivors going on without the lost ranks:
ProcessGroup.abort() reaches the peers at once, named; dist.shrink_group gives the survivors a new
group (torchft and elastic training's ways to survive a lost rank without a restart)."""

import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import torch_chainermn
from torch_chainermn import _backend
from tests.support.harness import run_mpiexec, run_spawn


def left_by_one_rank(how: str, outcome: dict, key: str) -> dist.ProcessGroup:
    """Rank 1 leaves a new group of both ranks (`how`: "abort", ProcessGroup.abort(), as torchft
    does to a failed replica; "destroy", destroy_process_group(group), whose shutdown() tells the
    peers) while rank 0 waits in an all_reduce on it; what rank 0's all_reduce said goes to outcome.
    The abort is waited for in a blocking all_reduce (over shared memory, on rank 0's own thread:
    backend/funnel.cpp), the shutdown in an async one (on the group's worker)."""
    group = dist.new_group([0, 1], backend="chainermn", timeout=datetime.timedelta(seconds=60))
    dist.barrier(group=group)
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        store.wait([f"{key}: posted"])  # rank 0's all_reduce is posted, and waits for us
        if how == "abort":
            group.abort()
        else:
            dist.destroy_process_group(group)
    else:
        backend = _backend.backend_of(group)
        before = backend.ops_run_on_caller()
        if how == "abort":
            # A blocking op on this thread cannot say it has begun: another thread watches the group's
            # sequence number (collectives posted) and tells rank 1 once it moves.
            posted = backend._get_sequence_number_for_group() + 1
            watcher = threading.Thread(target=_say_when_posted, args=(backend, posted, store, f"{key}: posted"))
            watcher.start()
        try:
            work = dist.all_reduce(torch.ones(10), group=group, async_op=how != "abort")
            if work is not None:
                store.set(f"{key}: posted", "1")
                work.wait()
            outcome[key] = "completed"
        except dist.DistBackendError as error:
            outcome[key] = str(error)
        outcome[key + " on the caller"] = backend.ops_run_on_caller() - before
        if how == "abort":
            watcher.join()
    return group


def _say_when_posted(backend, posted: int, store, key: str) -> None:
    while backend._get_sequence_number_for_group() < posted:
        time.sleep(0.001)
    store.set(key, "1")


def aborted_by_one_rank():
    """A group aborted by rank 1 while rank 0 waits in it, then another op on it on each rank; a group
    destroyed by rank 1 (its process alive) while rank 0 waits in it."""
    outcome = {}
    group = left_by_one_rank("abort", outcome, "pending")
    try:
        dist.all_reduce(torch.ones(10), group=group)
        outcome["later"] = "completed"
    except dist.DistBackendError as error:
        outcome["later"] = str(error)
    left_by_one_rank("destroy", outcome, "destroyed")
    return outcome


def test_an_abort_or_a_shutdown_reaches_the_peers_at_once_named():
    """A group aborted on one rank fails the op its peer waits in with the abort's reason (within
    about a second, where the timeout is 60 s: the message says so, not "timed out"), and every later
    op on either rank fails with it too. A group that rank 1 destroys (shutdown()) while rank 0 waits
    in it fails rank 0's op naming rank 1 as exited, also within about a second."""
    aborter, waiter = run_spawn(aborted_by_one_rank, 2, timeout=120)[::-1]
    said = "rank 1 aborted the group (ProcessGroup.abort())"
    assert said in waiter["pending"] and "timed out" not in waiter["pending"], waiter
    assert waiter["pending on the caller"] == 1 and waiter["destroyed on the caller"] == 0, waiter
    assert "rank 1 (host" in waiter["destroyed"] and "exited" in waiter["destroyed"], waiter
    assert "timed out" not in waiter["destroyed"], waiter
    assert said in waiter["later"], waiter
    assert said in aborter["later"] and "not run" in aborter["later"], aborter


def shrink_without_the_last_rank(state: str):
    """The last rank leaves in `state` and the others shrink the default group without it:
    - "idle": it stays alive and never joins; the survivors shrink at once. torch refuses the calls
      that make no sense (an empty list, a rank out of range: ValueError; the excluded rank itself:
      RuntimeError) on the rank that makes them, before the backend is asked.
    - "exited": it destroys its groups (shutdown()) and exits while the survivors wait in an
      all_reduce, which must fail naming it as exited.
    - "killed": it is SIGKILLed while the survivors wait in an all_reduce, which must fail naming it.
    The survivors then shrink (SHRINK_ABORT after a kill, the default flags otherwise) and all_reduce
    and all_gather on the new group, none of it waiting for the group's timeout (the test's run ends
    long before it: see SURVIVE_BEFORE_S)."""
    import signal

    rank, size = dist.get_rank(), dist.get_world_size()
    last = size - 1
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    outcome = {}
    if state == "idle":
        if rank == last:
            try:
                dist.shrink_group([last])
            except RuntimeError as error:
                outcome["refused"] = str(error)
            store.wait(["survivors done"], datetime.timedelta(seconds=60))
            dist.destroy_process_group()  # its old group: the survivors' default group is another now
            return outcome
        for bad in ([], [size]):
            try:
                dist.shrink_group(bad)
            except ValueError as error:
                outcome.setdefault("bad lists", []).append(str(error))
    elif rank == last:
        store.wait([f"rank {r} posted" for r in range(last)])  # the survivors wait in their all_reduce
        if state == "exited":
            dist.destroy_process_group()
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        backend = _backend.backend_of(dist.group.WORLD)
        posted = backend._get_sequence_number_for_group() + 1
        watcher = threading.Thread(target=_say_when_posted, args=(backend, posted, store, f"rank {rank} posted"))
        watcher.start()
        try:
            dist.all_reduce(torch.ones(10))
            outcome["failed"] = "completed"
        except dist.DistBackendError as error:
            outcome["failed"] = str(error)
        watcher.join()
    # SHRINK_ABORT where an op may still be pending on the old group; without it, shrinking must not
    # wait for the excluded rank either.
    flags = dist.distributed_c10d.SHRINK_ABORT if state == "killed" else dist.distributed_c10d.SHRINK_DEFAULT
    group = dist.shrink_group([last], shrink_flags=flags)
    value = torch.full((10,), float(rank + 1))
    dist.all_reduce(value)  # the new default group
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size())]
    dist.all_gather(gathered, torch.tensor([group.rank()]))
    outcome.update(
        rank=group.rank(),
        size=group.size(),
        sum=value[0].item(),
        backend=dist.get_backend(group),
        gathered=[t.item() for t in gathered],
        transport=torch_chainermn.transport(),
        shared_memory=_backend.backend_of(group).shared_memory,
        cuda=type(group._get_backend(torch.device("cuda"))).__name__,
    )
    dist.barrier()
    if rank == 0:
        store.set("survivors done", "1")
    return outcome


# Each state once, each host path (shared memory, Gloo alone) at least once; 3 ranks under mpiexec below.
# How the last rank ends in each state (idle: it lives, and returns).
DIES = {
    "idle": lambda last: {},
    "exited": lambda last: {last: "exit code 0"},
    "killed": lambda last: {last: "killed by SIGKILL"},
}
# The survivors' bound: the run must end within SURVIVE_BEFORE_S while the group's timeout is GROUP_TIMEOUT_S,
# so a survivor that waits for the timeout anywhere (the failed all_reduce, the shrink, the first ops on the
# new group) is still running at the deadline and fails the run, without a clock in the assertions.
SURVIVE_BEFORE_S, GROUP_TIMEOUT_S = 120, 600
SHRINK_CASES = [("shm", 4, "idle"), ("shm", 4, "killed"), ("gloo", 4, "exited")]


@pytest.mark.parametrize("transport,world_size,state", SHRINK_CASES, ids=["-".join(map(str, c)) for c in SHRINK_CASES])
def test_shrink_without_a_rank_idle_exited_or_killed(transport, world_size, state):
    """The survivors of every case get a group of world_size - 1 ranks, renumbered in order, with the
    old group's transports (Gloo, with shared memory on or off) made anew among them, whose all_reduce and
    all_gather are right, well before the group's timeout; a rank that exited is named as exited and a
    killed one as the rank at fault, not a timeout."""
    env = {"CHAINERMN_SHM": "1" if transport == "shm" else "0"}
    last = world_size - 1
    outcomes = run_spawn(
        shrink_without_the_last_rank,
        world_size,
        state,
        env=env,
        timeout=SURVIVE_BEFORE_S,
        op_timeout=GROUP_TIMEOUT_S,
        dies=DIES[state](last),
    )
    survivors = world_size - 1
    for rank in range(survivors):
        got = outcomes[rank]
        assert (got["rank"], got["size"], got["backend"]) == (rank, survivors, "chainermn"), got
        assert got["sum"] == survivors * (survivors + 1) / 2 and got["gathered"] == list(range(survivors)), got
        assert (got["transport"], got["shared_memory"]) == ("gloo", transport == "shm"), got
        assert got["cuda"] == "ProcessGroupChainerMN", got  # torch registers one device type; it serves both
        if state == "idle":
            assert len(got["bad lists"]) == 2 and "cannot be empty" in got["bad lists"][0], got
            assert "out of bounds" in got["bad lists"][1], got
        else:
            assert f"rank {last}" in got["failed"] and "timed out" not in got["failed"], got
            if state == "exited":
                assert "exited" in got["failed"], got
    if state == "idle":
        assert "is in the exclusion list" in outcomes[last]["refused"], outcomes[last]


def shrink_under_mpiexec():
    """3 ranks under mpiexec (MPI between ranks, shared memory off): rank 2 is excluded alive and idle
    until the others are done; ranks 0 and 1 shrink without it and all_reduce on the new group's MPI
    communicator."""
    rank = dist.get_rank()
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if rank == 2:
        store.wait(["survivors done"], datetime.timedelta(seconds=60))
        dist.destroy_process_group()
        return {}
    group = dist.shrink_group([2])
    value = torch.full((10,), float(rank + 1))
    dist.all_reduce(value)
    outcome = {
        "rank": group.rank(),
        "size": group.size(),
        "sum": value[0].item(),
        "transport": torch_chainermn.transport(),
    }
    dist.barrier()
    if rank == 0:
        store.set("survivors done", "1")
    return outcome


@pytest.mark.mpi
def test_shrink_under_mpiexec_makes_an_mpi_group_of_the_survivors():
    """Under mpiexec the survivors' new group talks MPI among themselves alone (a killed rank ends an
    mpiexec job: Open MPI's launcher aborts the others, so only a live excluded rank is tried)."""
    outcomes = run_mpiexec(shrink_under_mpiexec, 3, env={"CHAINERMN_SHM": "0"}, timeout=120)
    for rank in (0, 1):
        assert outcomes[rank] == {"rank": rank, "size": 2, "sum": 3.0, "transport": "mpi"}, outcomes
