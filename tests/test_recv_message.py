"""The backend's receive of a message of any size (ProcessGroupChainerMN.recv_message), which the
model-parallel functions' messages use: whatever count and dtype the sender sent arrives, on each
host transport (shared memory, Gloo, MPI), in order on a (peer, tag) pair."""

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_mpiexec, run_spawn
from torch_chainermn import _backend

# (tag, tensor): sent in this order; received in another order of tags, so some wait aside.
MESSAGES = [
    (3, torch.arange(10, dtype=torch.float64)),
    (3, torch.zeros(0, dtype=torch.uint8)),
    (4, torch.arange(3_000_000, dtype=torch.int32)),
    (5, torch.tensor([True, False, True])),
    (4, torch.full((2, 3), 7, dtype=torch.int16)),
]


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
    return all(
        len(received[t]) == len(expected[t])
        and all(got.dtype == want.dtype and torch.equal(got, want) for got, want in zip(received[t], expected[t]))
        for t in expected
    )


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_messages_of_any_size(shm):
    error, ok = run_spawn(messages_of_any_size, 2, env={"CHAINERMN_SHM": shm})
    assert ok is True
    assert "recv_message: src 2 is not a rank of this group (size 2)" in error, error


@pytest.mark.mpi
def test_messages_of_any_size_over_mpi():
    error, ok = run_mpiexec(messages_of_any_size, 2, env={"CHAINERMN_SHM": "0"})
    assert ok is True and "recv_message" in error, error


def messages_sent_from_parts():
    """send_message: parts at offsets with zeros between; the parts may change once it returns (a
    message larger than the ring is partly copied); in order behind an isend on the same tag."""
    backend = _backend.backend_of(None)
    head = torch.arange(10, dtype=torch.uint8)
    values = torch.arange(5, dtype=torch.float32)
    big = torch.arange(1_000_000, dtype=torch.int32)  # 4 MB: more than a shared-memory ring holds
    if dist.get_rank() == 0:
        first = dist.isend(torch.arange(300_000, dtype=torch.int64), 1, tag=7)
        works = [
            backend.send_message([head], [0], 12, 1, 7),
            backend.send_message([head, values.view(torch.uint8)], [0, 16], 40, 1, 3),
            backend.send_message([big.view(torch.uint8)], [0], big.numel() * 4, 1, 4),
        ]
        big.fill_(-1)  # after the send returned, before the receiver took the message
        dist.barrier()
        errors = []
        for parts, offsets, size in (
            ([head, values.view(torch.uint8)], [0, 8], 40),  # overlapping
            ([values.view(torch.uint8)], [30], 40),  # past the end
            ([torch.zeros(4, 4).t()], [0], 64),
        ):  # not contiguous
            try:
                backend.send_message(parts, offsets, size, 1, 9)
                errors.append("no error")
            except ValueError as error:
                errors.append(str(error))
        for work in [first, *works]:
            work.wait()
        return errors
    dist.barrier()
    got = {}
    for tag in (4, 3, 7, 7):
        work = backend.recv_message(0, tag)
        work.wait()
        got.setdefault(tag, []).append(work.get_future().value()[0])
    expect_small = torch.cat(
        [head, torch.zeros(6, dtype=torch.uint8), values.view(torch.uint8), torch.zeros(4, dtype=torch.uint8)]
    )
    return (
        torch.equal(got[4][0].view(torch.int32), torch.arange(1_000_000, dtype=torch.int32)),
        torch.equal(got[3][0], expect_small),
        got[7][0].numel() == 300_000 and torch.equal(got[7][1], torch.cat([head, torch.zeros(2, dtype=torch.uint8)])),
    )


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_messages_sent_from_parts(shm):
    errors, checks = run_spawn(messages_sent_from_parts, 2, env={"CHAINERMN_SHM": shm})
    assert checks == (True, True, True)
    assert "send_message: parts[1] on rank 0" in errors[0] and "overlaps" in errors[0], errors
    assert "send_message: parts[0] on rank 0" in errors[1] and "ends past" in errors[1], errors
    assert "not contiguous" in errors[2], errors
