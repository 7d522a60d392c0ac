"""A failure seen by one rank reaches every rank of the group, naming the rank at fault: a death on
another (simulated) node, a stalled rank at a timeout, and the rank that arrives after its peers gave up."""

import datetime
import os
import time

import torch
import torch.distributed as dist

import torch_chainermn

from tests.support.harness import cached_launch, run_spawn


def dead_rank_on_another_node():
    """Rank 3 dies; ranks 0 and 1 (the other node) are told who died, long before the timeout."""
    rank = dist.get_rank()
    dist.barrier()
    if rank == 3:
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000))
        return "completed", time.monotonic() - start
    except dist.DistBackendError as error:
        return str(error), time.monotonic() - start


def test_a_death_reaches_every_node_named():
    outcomes = run_spawn(
        dead_rank_on_another_node,
        4,
        env={"CHAINERMN_RANKS_PER_NODE": "2"},
        timeout=120,
        op_timeout=60,
        dies={3: "exit code 0"},
    )
    for rank in (0, 1, 2):
        message, waited = outcomes[rank]
        assert "rank 3 (host" in message and "died" in message, (rank, message)
        assert waited < 30, (rank, waited, message)  # told, not timed out (the timeout is 60 s)


def monitored_barriers(rank):
    """torch's monitored_barrier semantics: all arrive; then ranks 1 and 2 come 2.5 s late."""
    outcomes = []
    for late in (False, True):
        if late and rank != 0:
            time.sleep(2.5)
        try:
            timeout = datetime.timedelta(seconds=1 if late else 20)
            torch_chainermn.monitored_barrier(timeout=timeout, wait_all_ranks=True)
            outcomes.append("passed")
        except dist.DistBackendError as error:
            outcomes.append(str(error))
    return outcomes


def stalled_rank():
    """Rank 2 reaches the all_reduce 6 s late on a group with a 3 s timeout (after monitored barriers)."""
    rank = dist.get_rank()
    barriers = monitored_barriers(rank)
    group = dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=3))
    if rank == 2:
        time.sleep(6)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8), group=group)
        outcome = "completed"
    except dist.DistBackendError as error:
        outcome = str(error)
    return outcome, time.monotonic() - start, barriers


def test_monitored_barrier_names_the_late_ranks_on_every_rank():
    for rank in range(3):
        passed, late = stalled_outcomes()[rank][2]
        assert passed == "passed", passed
        assert "Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms" in late, (rank, late)


@cached_launch
def stalled_outcomes():
    """One launch for the two tests that read it (its failure too)."""
    return run_spawn(stalled_rank, 3, timeout=120, op_timeout=60)


def test_a_timeout_says_who_waited_and_the_late_rank_fails_at_once():
    outcomes = stalled_outcomes()
    for rank in (0, 1):
        message, _, _ = outcomes[rank]
        assert "timed out" in message and "ranks 0,1 waited in all_reduce seq 1" in message, message
        assert "rank 2 (host" in message and "never waited" in message, message
    late, waited, _ = outcomes[2]
    assert "aborted" in late and "timed out" in late and "rank 2 (host" in late, late
    assert waited < 3, waited  # failed on the peers' word, before its own 3 s timeout
