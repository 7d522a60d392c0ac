"""Collectives their caller waits for at once (async_op=False) run on the caller's thread over shared
memory when the group's worker is idle (backend/funnel.cpp, Worker::runIfIdle): no hop to the worker
and back. They keep the issue order with async ops in flight, async ops stay on the worker, and they
end as an op on the worker does when the group breaks: the break aborts the segment's waits, since
nothing else can free a caller that waits in them. A dead peer and a peer's abort are covered by
test_failures.py and test_survival.py, whose ops wait at once; an async op whose peers come only
after it returned by collective_cases.wait_with_timeout_case."""

import datetime

import pytest
import torch
import torch.distributed as dist

import torch_chainermn
from torch_chainermn import _C
from tests.support.harness import cached_launch, run_spawn


@pytest.mark.parametrize("how, said", [("timeout", "timed out"), ("abort", "the test aborted the group")])
def test_a_caller_waiting_in_shared_memory_is_freed_when_the_group_breaks(how, said):
    # In process, ranks as threads: rank 0's barrier runs on its caller's thread and rank 1 never
    # comes. The transport's own wait is 60 s; the op's deadline (0.3 s) or another thread's abort
    # must end it, from inside the transport.
    outcome = _C.testing.caller_op_outcome(how)
    assert outcome["ran_on_caller"] == "yes", outcome
    assert "the group was aborted" in outcome["transport"], outcome
    assert said in outcome["wait"], outcome


def test_an_op_behind_the_workers_is_not_run_on_the_caller():
    # The worker is busy: the op queues behind (issue order), runs on the worker, and the abort frees
    # the worker from the same wait.
    outcome = _C.testing.caller_op_outcome("worker-busy")
    assert outcome["ran_on_caller"] == "no", outcome
    assert "the group was aborted" in outcome["transport"], outcome
    assert "the test aborted the group" in outcome["wait"], outcome


def issue_order_with_ops_in_flight():
    """Every rank issues the same ops; the counts of ops run on the caller, and the results."""
    rank, size = dist.get_rank(), dist.get_world_size()
    backend = torch_chainermn._backend.backend_of()
    out = {}

    start = backend.ops_run_on_caller()
    small = torch.full((16,), float(rank + 1))
    dist.all_reduce(small)
    out["idle_small"] = (backend.ops_run_on_caller() - start, small.tolist())
    start = backend.ops_run_on_caller()
    dist.all_reduce(small, async_op=True).wait()
    out["async_small"] = (backend.ops_run_on_caller() - start, small.tolist())

    # An async all_reduce (the worker's) then a blocking MAX on a slice of the same tensor: the MAX
    # must wait its turn. In order, x[:4] is max(sum) = sum; overtaking, sum(max).
    x = torch.full((1 << 18,), float(rank + 1))
    start = backend.ops_run_on_caller()
    large = dist.all_reduce(x, async_op=True)
    dist.all_reduce(x[:4], op=dist.ReduceOp.MAX)
    large.wait()
    out["behind_large"] = (x[:4].tolist(), x[4:].unique().tolist())

    # A receive in flight (the worker tests it) while small collectives run, then its send.
    peer_next, peer_prev = (rank + 1) % size, (rank - 1) % size
    received = torch.zeros(3)
    recv = dist.irecv(received, src=peer_prev)
    gathered = [torch.empty(2) for _ in range(size)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    root = torch.full((5,), float(rank))
    dist.broadcast(root, src=size - 1)
    dist.send(torch.full((3,), float(rank)), dst=peer_next)
    recv.wait()
    out["with_receive_in_flight"] = ([g.tolist() for g in gathered], root.tolist(), received.tolist())
    out["on_caller_since"] = backend.ops_run_on_caller() - start
    return out


def issue_order_then_a_short_timeout():
    """Both jobs of the real-process tests in one launch: the second breaks a group of its own."""
    return issue_order_with_ops_in_flight(), barrier_with_a_short_timeout()


@cached_launch
def launched():
    return run_spawn(issue_order_then_a_short_timeout, 2, timeout=60, env={"CHAINERMN_SHM": "1"})


def test_small_collectives_run_on_the_caller_and_keep_the_issue_order():
    for rank, (out, _) in enumerate(launched()):
        assert out["idle_small"] == (1, [3.0] * 16), out
        assert out["async_small"] == (0, [6.0] * 16), out
        assert out["behind_large"] == ([3.0] * 4, [3.0]), out
        gathered, root, received = out["with_receive_in_flight"]
        assert gathered == [[0.0, 0.0], [1.0, 1.0]] and root == [1.0] * 5, out
        assert received == [float(1 - rank)] * 3, out
        # The broadcast at least: the worker is idle once the all_gather is over, the receive in flight
        # aside (the MAX, the all_gather and the send may find it busy with the transfers).
        assert out["on_caller_since"] >= 1, out


def barrier_with_a_short_timeout():
    """A group made with a 60 s timeout; rank 0 enters a barrier with a 1 s timeout that rank 1 never
    joins."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
    dist.barrier(group=group)
    outcome = "did not wait"
    if dist.get_rank() == 0:
        backend = torch_chainermn._backend.backend_of(group)
        before = backend.ops_run_on_caller()
        try:
            dist.barrier(group=group, timeout=datetime.timedelta(seconds=1))
            outcome = "completed"
        except dist.DistBackendError as error:
            outcome = str(error)
        outcome = (outcome, backend.ops_run_on_caller() - before)
    dist.barrier()  # the default group: rank 1 waits here until rank 0 is through
    return outcome


def test_an_op_on_the_caller_fails_at_its_own_timeout():
    # The segment's waits are bounded by the 60 s the group was made with; the op's 1 s deadline is
    # the watchdog's, which must reach into the transport. The harness gives the ranks 60 s in all.
    message, on_caller = launched()[0][1]
    assert on_caller == 1, launched()[0]
    assert "barrier" in message and "timed out" in message and "1000 ms" in message, message
