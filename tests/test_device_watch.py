"""The watchdog's CUDA path without a GPU: a group's Worker fed ops that end on a scripted device.

A CUDA collective's Work completes when its kernels are queued (wait() orders the caller's stream and
returns, as ProcessGroupNCCL's does), so only the device can tell that one hangs or failed. The
watchdog watches each op's end, polls the transports' asynchronous errors (ncclCommGetAsyncError on
a GPU) and, on a timeout or an error, aborts them (ncclCommAbort: the kernels return) and fails the
op naming it. torch_chainermn._C.testing.DeviceQueue scripts the device: `finish(n)` is the event
of op n being reached, `set_error` what NCCL would report. tests/test_cuda.py kills a real peer.
"""

import time

import pytest
import torch.distributed as dist

from torch_chainermn._C import testing


def eventually(condition, within=10.0):
    """Whether `condition()` holds within `within` seconds (the watchdog polls the device every 100 ms)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def watched_after(queue, polls):
    """Waits until the watchdog has asked the device about an unfinished op twice more than `polls` times:
    whatever it would do with what it knew before, it has done."""
    assert eventually(lambda: queue.end_polls >= polls + 2)


def test_a_queued_op_completes_when_the_device_reaches_its_end():
    queue = testing.DeviceQueue()
    first, second = queue.post(), queue.post()
    assert first.wait() and second.wait()  # queued: wait() returns without the device
    assert not first.is_completed() and not second.is_completed()
    queue.finish(1)
    assert eventually(first.is_completed)
    assert not second.is_completed()
    queue.finish(2)
    assert eventually(second.is_completed)
    assert second.is_success() and first.wait()
    assert queue.aborts == 0


def test_an_asynchronous_error_fails_the_op_aborts_and_breaks_the_group():
    queue = testing.DeviceQueue()
    finished, hung = queue.post(), queue.post()
    queue.finish(1)
    assert eventually(finished.is_completed)
    queue.set_error("NCCL reported an asynchronous error on rank 0 of 2: remote process exited")
    assert eventually(hung.is_completed)
    assert queue.aborts >= 1
    with pytest.raises(dist.DistBackendError) as raised:
        hung.wait()
    message = str(raised.value)
    assert "all_reduce (seq 2, rank 0 of 1, nccl" in message
    assert "failed on the GPU" in message and "remote process exited" in message
    assert finished.wait()  # it ended before the error
    later = queue.post()
    with pytest.raises(dist.DistBackendError, match="not run, the group is unusable after all_reduce .seq 2"):
        later.wait()


def test_an_op_the_device_never_finishes_times_out_and_aborts():
    queue = testing.DeviceQueue(timeout=0.5)
    work = queue.post()
    assert work.wait()
    assert eventually(work.is_completed)
    assert queue.aborts >= 1
    with pytest.raises(
        dist.DistBackendError, match=r"all_reduce \(seq 1, rank 0 of 1, nccl, timeout 500 ms\) timed out"
    ):
        work.wait()


# ---- launched on the caller's thread (over NCCL), its cross-rank check beside the kernels -------------


def test_a_launched_op_completes_only_once_the_device_and_its_check_are_through():
    queue = testing.DeviceQueue()
    work = queue.launch(checked=True)
    assert work.wait()  # queued at once: the launch did not wait for the check
    queue.finish(1)
    assert eventually(lambda: queue.verdicts_awaited >= 1)  # the device is through, the check is under way ...
    assert not work.is_completed()  # ... and the op waits for it
    queue.check(0)
    assert eventually(work.is_completed)
    assert work.is_success() and queue.aborts == 0


def test_a_check_that_passes_first_still_waits_for_the_device():
    queue = testing.DeviceQueue()
    work = queue.launch(checked=True)
    queue.check(0)
    assert eventually(lambda: queue.verdicts_taken >= 1)  # the worker has the verdict ...
    watched_after(queue, queue.end_polls)
    assert not work.is_completed()  # ... and the op still waits for the device
    queue.finish(1)
    assert eventually(work.is_completed) and work.is_success()


def test_a_failed_check_fails_the_queued_op_aborts_the_device_and_breaks_the_group():
    queue = testing.DeviceQueue()
    mismatched, behind = queue.launch(checked=True), queue.launch(checked=True)
    queue.check(0, "the ranks disagree on all_reduce: count 4 on rank 0, 8 on rank 1")
    assert eventually(mismatched.is_completed)
    with pytest.raises(ValueError, match="count 4 on rank 0, 8 on rank 1"):
        mismatched.wait()
    assert queue.aborts >= 1  # the mismatched kernels would wait forever, or reduce the wrong data
    assert eventually(behind.is_completed)
    with pytest.raises(dist.DistBackendError, match="failed its cross-rank check"):
        behind.wait()
    with pytest.raises(dist.DistBackendError, match="the group is unusable"):
        queue.launch(checked=False).wait()


def test_drain_waits_for_the_device():
    queue = testing.DeviceQueue()
    work = queue.launch(checked=False)
    queue.finish(1)
    queue.drain()
    assert work.is_completed() and work.is_success()
