"""The backend's helper threads (the group's worker and watchdog) sleep until there is something for
them: a thread woken per op or polling a transfer preempts the rank's own computation when the rank
is bound to one core (mpiexec binds each rank to one), and costs a thread switch per small op. Counted
with the threads' voluntary context switches (/proc), against what the old behaviour gave."""

import glob
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_spawn


def _wakeups(thread: str) -> int:
    """Voluntary context switches of this process's threads named `thread` so far (each sleep is one)."""
    total = 0
    for task in glob.glob("/proc/self/task/*"):
        try:
            if open(f"{task}/comm").read().strip() == thread:
                status = open(f"{task}/status").read()
                total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        except OSError:  # the thread ended meanwhile
            pass
    return total


def a_receive_in_flight_does_not_wake_the_worker():
    """While a receive waits for a message that is half a second away, the worker sleeps: the
    transport wakes it when the message is there (it used to poll every millisecond, and each poll
    preempted the rank's computation on its core)."""
    tensor = torch.zeros(4)
    if dist.get_rank() == 0:
        dist.barrier()
        time.sleep(0.5)
        dist.send(torch.ones(4), 1, tag=9)
        return None
    work = dist.irecv(tensor, 0, tag=9)
    dist.barrier()
    before = _wakeups("cmn-worker")
    time.sleep(0.4)
    wakeups = _wakeups("cmn-worker") - before
    work.wait()
    return wakeups, tensor.tolist()


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_a_receive_in_flight_does_not_wake_the_worker(shm):
    _, (wakeups, received) = run_spawn(a_receive_in_flight_does_not_wake_the_worker, 2, env={"CHAINERMN_SHM": shm})
    assert received == [1.0] * 4
    assert wakeups < 40, f"the worker woke {wakeups} times in 0.4 s while a receive was in flight"


def small_ops_do_not_wake_the_watchdog():
    tensor = torch.ones(1024)
    for _ in range(100):
        dist.all_reduce(tensor)
    before = _wakeups("cmn-watchdog")
    for _ in range(2000):
        dist.all_reduce(tensor)
    return _wakeups("cmn-watchdog") - before


def test_small_ops_do_not_wake_the_watchdog():
    """It wakes by itself at least once a second and sees each op's deadline then; an op wakes it
    only when its deadline comes sooner (it woke for every op: 2000 wakeups here)."""
    wakeups = run_spawn(small_ops_do_not_wake_the_watchdog, 2)
    assert all(w < 100 for w in wakeups), f"the watchdogs woke {wakeups} times in 2000 all_reduces"
