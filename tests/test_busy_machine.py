"""A busy machine (csrc/os/spin.h: waits that sleep rather than spin or yield once the machine is seen
busy): every collective finishes with the right result while the cores are oversubscribed, small ops
keep the issue order behind ops in flight, an async op never waits for its peers, and a wait with its
own timeout keeps it. (Running a queued op on the thread that waits for it was tried and left out:
a late rank's op then waited for its transport's timeout instead of failing on its peers' word, and
an async op run too early waits for its peers: docs/benchmarks.md.)"""

import datetime
import subprocess
import sys

import torch
import torch.distributed as dist

from tests.support.harness import run_spawn


def async_ops_do_not_wait_for_the_peers():
    """Rank 0 issues an async all_reduce and only then tells rank 1, through the store, to issue its
    own: an async op must return before its peers come (as on gloo and nccl)."""
    store = dist.distributed_c10d._get_default_store()
    tensor = torch.full((1024,), float(dist.get_rank() + 1))
    if dist.get_rank() == 0:
        work = dist.all_reduce(tensor, async_op=True)
        store.set("busy-machine/issued", "1")
    else:
        store.wait(["busy-machine/issued"])
        work = dist.all_reduce(tensor, async_op=True)
    work.wait()
    return tensor[0].item()


def test_an_async_op_returns_before_its_peers_come():
    assert run_spawn(async_ops_do_not_wait_for_the_peers, 2, env={"CHAINERMN_SHM": "1"}, timeout=90) == [3.0, 3.0]


def a_wait_with_its_own_timeout():
    """wait(timeout) on an op whose peer comes only once that wait has returned (told through the
    store) gives up after the caller's timeout, not the group's; the op then completes when the peer
    comes."""
    tensor = torch.ones(1024)
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        store.wait(["rank 0's wait returned"])
        dist.all_reduce(tensor)
        return tensor[0].item()
    work = dist.all_reduce(tensor, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(milliseconds=500))
        outcome = "completed"
    except dist.DistBackendError as error:
        outcome = str(error)
    store.set("rank 0's wait returned", "1")
    work.get_future().wait()
    return {"outcome": outcome, "sum": tensor[0].item()}


def test_a_wait_with_its_own_timeout_keeps_it():
    # A wait that ignored its own timeout would end at the group's (60 s), saying so.
    first, second = run_spawn(a_wait_with_its_own_timeout, 2, env={"CHAINERMN_SHM": "1"}, timeout=90)
    assert "timed out after 500 ms" in first["outcome"], first
    assert first["sum"] == 2.0, first
    assert second == 2.0


def order_behind_ops_in_flight():
    """A 16 MiB all_reduce in flight on the worker, then small ones that must not overtake it: MAX
    then SUM of [rank + 1] is 4 in this order (SUM then MAX would be 3), and a reordering on one rank
    only would also fail the cross-rank check."""
    large = torch.ones(4 << 20)
    work = dist.all_reduce(large, async_op=True)
    small = torch.full((4,), float(dist.get_rank() + 1))
    first = dist.all_reduce(small, op=dist.ReduceOp.MAX, async_op=True)
    second = dist.all_reduce(small, op=dist.ReduceOp.SUM, async_op=True)
    for w in (work, first, second):
        w.wait()
    return {"large": large[0].item(), "small": small.tolist()}


def test_small_collectives_keep_the_issue_order_behind_ops_in_flight():
    for outcome in run_spawn(order_behind_ops_in_flight, 2, env={"CHAINERMN_SHM": "1"}):
        assert outcome == {"large": 2.0, "small": [4.0] * 4}


def collectives_on_oversubscribed_cores(spinners: int):
    """`spinners` processes that only compute, beside each rank, so that the runnable threads far
    outnumber the cores: all_reduce, broadcast and all_gather of 4 KiB to 8 MiB, each checked."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
    try:
        rank, size = dist.get_rank(), dist.get_world_size()
        wrong = []
        for count in (1024, 1 << 18, 1 << 21):
            for _ in range(3):
                tensor = torch.full((count,), float(rank + 1))
                dist.all_reduce(tensor)
                if not torch.all(tensor == size * (size + 1) / 2):
                    wrong.append(("all_reduce", count))
                tensor = torch.full((count,), float(rank))
                dist.broadcast(tensor, src=size - 1)
                if not torch.all(tensor == size - 1):
                    wrong.append(("broadcast", count))
                gathered = [torch.empty(count) for _ in range(size)]
                dist.all_gather(gathered, torch.full((count,), float(rank)))
                if any(not torch.all(g == r) for r, g in enumerate(gathered)):
                    wrong.append(("all_gather", count))
        return wrong
    finally:
        for process in busy:
            process.kill()
            process.wait()


def test_collectives_finish_right_when_the_cores_are_oversubscribed():
    # 2 ranks and 4 processes that only compute on this 2-core machine (more on a larger one).
    outcomes = run_spawn(collectives_on_oversubscribed_cores, 2, 2, env={"CHAINERMN_SHM": "1"}, timeout=180)
    assert outcomes == [[], []]
