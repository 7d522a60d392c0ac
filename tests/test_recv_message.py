"""The backend's receive of a message of any size (ProcessGroupChainerMN.recv_message), which the
model-parallel functions' messages use: whatever count and dtype the sender sent arrives, on each
host transport (shared memory, Gloo, MPI), in order on a (peer, tag) pair."""
import pytest
import torch
import torch.distributed as dist

from tests.harness import run_mpiexec, run_spawn
from torch_chainermn import _backend

# (tag, tensor): sent in this order; received in another order of tags, so some wait aside.
MESSAGES = [(3, torch.arange(10, dtype=torch.float64)), (3, torch.zeros(0, dtype=torch.uint8)),
            (4, torch.arange(3_000_000, dtype=torch.int32)), (5, torch.tensor([True, False, True])),
            (4, torch.full((2, 3), 7, dtype=torch.int16))]


def messages_of_any_size():
    backend = _backend.backend_of(None)
    if dist.get_rank() == 0:
        works = [dist.isend(tensor, 1, tag=tag) for tag, tensor in MESSAGES]
        for work in works:
            work.wait()
        try:
            backend.recv_message(2, 3)
        except ValueError as error:
            return str(error)
        return "no error"
    received = {}
    for tag in (5, 4, 3, 4, 3):  # tag 5 first: the messages before it wait aside (or in the ring)
        work = backend.recv_message(0, tag)
        work.wait()
        received.setdefault(tag, []).append(work.get_future().value()[0])
    expected = {}
    for tag, tensor in MESSAGES:
        expected.setdefault(tag, []).append(tensor.reshape(-1))
    return all(len(received[t]) == len(expected[t]) and all(
        got.dtype == want.dtype and torch.equal(got, want) for got, want in zip(received[t], expected[t]))
        for t in expected)


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_messages_of_any_size(shm):
    error, ok = run_spawn(messages_of_any_size, 2, env={"CHAINERMN_SHM": shm})
    assert ok is True
    assert "recv_message: src 2 is not a rank of this group (size 2)" in error, error


@pytest.mark.mpi
def test_messages_of_any_size_over_mpi():
    error, ok = run_mpiexec(messages_of_any_size, 2, env={"CHAINERMN_SHM": "0"})
    assert ok is True and "recv_message" in error, error

