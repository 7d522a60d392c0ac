"""A rank that leaves its group on purpose, and the survivors going on without the lost ranks:
ProcessGroup.abort() reaches the peers at once, named; dist.shrink_group gives the survivors a new
group (torchft and elastic training's ways to survive a lost rank without a restart)."""
import datetime
import os
import time

import torch
import torch.distributed as dist

from tests.support.harness import run_spawn


def aborted_by_one_rank():
    """Rank 1 aborts the group (ProcessGroup.abort(), as torchft does to a failed replica) while rank 0
    waits in an all_reduce on it; then each issues another op on the group."""
    group = dist.new_group([0, 1], backend="chainermn", timeout=datetime.timedelta(seconds=60))
    dist.barrier(group=group)
    outcome = {}
    if dist.get_rank() == 1:
        time.sleep(0.5)  # rank 0 is in its all_reduce by now
        group.abort()
    else:
        try:
            dist.all_reduce(torch.ones(10), group=group)
            outcome["pending"] = "completed"
        except dist.DistBackendError as error:
            outcome["pending"] = str(error)
    try:
        dist.all_reduce(torch.ones(10), group=group)
        outcome["later"] = "completed"
    except dist.DistBackendError as error:
        outcome["later"] = str(error)
    return outcome


def test_an_abort_reaches_the_peers_at_once_named():
    """A group aborted on one rank fails the op its peer waits in with the abort's reason (within
    about a second, where the timeout is 60 s: the message says so, not "timed out"), and every later
    op on either rank fails with it too."""
    aborter, waiter = run_spawn(aborted_by_one_rank, 2, timeout=120)[::-1]
    said = "rank 1 aborted the group (ProcessGroup.abort())"
    assert said in waiter["pending"] and "timed out" not in waiter["pending"], waiter
    assert said in waiter["later"], waiter
    assert said in aborter["later"] and "not run" in aborter["later"], aborter


def survivors_shrink(abort_first: bool):
    """Rank 2 of 3 dies; the survivors' all_reduce fails naming it; they shrink the default group
    without it (SHRINK_ABORT or not) and train on: the new group's ranks, size and an all_reduce."""
    rank = dist.get_rank()
    dist.barrier()
    if rank == 2:
        os._exit(0)
    outcome = {}
    try:
        dist.all_reduce(torch.ones(10))
        outcome["failed"] = "completed"
    except dist.DistBackendError as error:
        outcome["failed"] = str(error)
    flags = dist.distributed_c10d.SHRINK_ABORT if abort_first else dist.distributed_c10d.SHRINK_DEFAULT
    group = dist.shrink_group([2], shrink_flags=flags)
    value = torch.full((10,), float(rank + 1))
    dist.all_reduce(value)  # the new default group
    outcome.update(rank=group.rank(), size=group.size(), world=dist.get_world_size(), sum=value[0].item(),
                   backend=dist.get_backend(group))
    return outcome


def test_survivors_shrink_the_group_and_go_on():
    """dist.shrink_group([dead rank]) on a chainermn group: the survivors get a group of their own
    (renumbered, the default group, chainermn again) whose collectives work, with and without
    SHRINK_ABORT."""
    for abort_first in (False, True):
        outcomes = run_spawn(survivors_shrink, 3, abort_first, timeout=120, op_timeout=60, may_exit=(2,))
        for rank in (0, 1):
            got = outcomes[rank]
            assert "rank 2" in got["failed"], got
            assert (got["rank"], got["size"], got["world"]) == (rank, 2, 2), got
            assert got["sum"] == 3.0 and got["backend"] == "chainermn", got
