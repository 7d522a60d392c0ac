"""The C++ layers in one process, ranks as threads (torch_chainermn._C.testing, csrc/testing/).

Every strategy x topology x size x dtype x reduction runs in seconds, against a reference computed
here from every rank's input; the thread transport itself (collectives on each level, point to point,
agreement and aliasing checks, timeouts) is tested directly. The multi-process tests
(test_strategies.py, test_collectives.py) cover the real transports.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch
import torch.distributed as dist

from tests.support.collective_cases import reference_reduce
from torch_chainermn._C import testing

TOPOLOGIES = {
    "1x1": ["a"],
    "1x2": ["a", "a"],
    "1x4": ["a"] * 4,
    "2x2": ["a", "a", "b", "b"],
    "2x2-interleaved": ["a", "b", "a", "b"],  # a node's ranks need not be consecutive
    "4x1": ["a", "b", "c", "d"],
    "3+1": ["a", "a", "a", "b"],  # nodes of unequal size
    "1+2+2": ["a", "b", "b", "c", "c"],
    "3x2": ["a", "a", "b", "b", "c", "c"],
}
STRATEGIES = ["naive", "flat", "hierarchical", "two_dimensional", "single_node"]
DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
]
SIZES = [0, 1, 7, 1000, 65537]
FLOAT_OPS = ["sum", "product", "min", "max"]
INT_OPS = FLOAT_OPS + ["band", "bor", "bxor"]
# The size does not meet the reduction below the transports, so the largest size runs fewer of them.
LARGE, LARGE_OPS = 65537, {"sum", "max", "bxor"}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The ranks are threads already: torch's own intra-op threads would only fight them for the cores
    (ten times slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def one_node(names):
    return len(set(names)) == 1


def strategies_for(names):
    return [s for s in STRATEGIES if s != "single_node" or one_node(names)]


def inputs(size: int, n: int, dtype: torch.dtype, op: str) -> list[torch.Tensor]:
    """Random values whose every partial reduction is exact in `dtype`, so any order of reduction (each
    strategy has its own) gives the reference's result: products of {1, 2, 3} below 256 until the last
    step, sums below 256 in magnitude, the full range of the type for bit operations."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{size} {n} {dtype} {op}".encode()))
    if op in ("band", "bor", "bxor"):
        info = torch.iinfo(dtype)
        low, high = max(info.min, -(1 << 31)), min(info.max, (1 << 31) - 1)
    elif op == "product":
        low, high = 1, 3
    else:
        low, high = (0 if dtype == torch.uint8 else -20), 20
    return [torch.randint(low, high + 1, (n,), generator=generator).to(dtype) for _ in range(size)]


def cases(size: int, dtype: torch.dtype, sizes=SIZES):
    """(what, op, every rank's input, expected result) for each size and reduction."""
    out = []
    for n in sizes:
        for op in FLOAT_OPS if dtype.is_floating_point else INT_OPS:
            if n == LARGE and op not in LARGE_OPS:
                continue
            given = inputs(size, n, dtype, op)
            out.append((f"{op} of {n} {dtype}", op, given, reference_reduce(given, op.upper())))
    return out


def check_strategies(names, table, shared_memory=False, shm_chunk_bytes=1 << 20):
    """Every strategy of these nodes on every case of `table`, one run (one set of threads) per strategy."""
    for strategy in strategies_for(names):
        results = testing.allreduce_cases(
            strategy, names, [(op, given) for _, op, given, _ in table], shared_memory, shm_chunk_bytes=shm_chunk_bytes
        )
        for (what, _, _, expected), result in zip(table, results):
            assert_reduced(result, expected, f"{strategy} on {names}: {what}")


def assert_reduced(results, expected, what):
    for rank, result in enumerate(results):
        if torch.equal(result, expected):
            continue  # exact, as inputs() makes every case; 16-bit floats would be allowed 1% of rounding
        assert result.dtype == expected.dtype and result.shape == expected.shape, f"{what}, rank {rank}: {result}"
        assert expected.dtype in (torch.float16, torch.bfloat16), f"{what}, rank {rank}: {result} != {expected}"
        torch.testing.assert_close(result, expected, rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}, rank {rank}: {m}")


# ---- strategies --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_strategy_size_and_reduction(topology, dtype):
    names = TOPOLOGIES[topology]
    check_strategies(names, cases(len(names), dtype))


@pytest.mark.parametrize("topology", [t for t, names in TOPOLOGIES.items() if len(names) > len(set(names))])
def test_strategies_over_shared_memory(topology):
    # Small chunks, so that a few thousand elements take several rounds through the segment.
    names = TOPOLOGIES[topology]
    check_strategies(
        names,
        [case for dtype in DTYPES for case in cases(len(names), dtype, sizes=(0, 7, 5001))],
        shared_memory=True,
        shm_chunk_bytes=4096,
    )


def test_inputs_are_not_modified():
    given = [torch.full((5,), float(r)) for r in range(4)]
    testing.allreduce("two_dimensional", TOPOLOGIES["2x2"], given)
    assert all(torch.equal(t, torch.full((5,), float(r))) for r, t in enumerate(given))


def test_two_dimensional_runs_as_hierarchical_on_unequal_nodes():
    assert testing.algorithm("two_dimensional", TOPOLOGIES["3x2"]) == "two_dimensional"
    for topology in ("3+1", "1+2+2"):
        assert testing.algorithm("two_dimensional", TOPOLOGIES[topology]) == "hierarchical"


@pytest.mark.parametrize("topology", ["2x2", "4x1", "1+2+2"])
def test_single_node_refuses_several_nodes(topology):
    nodes = len(set(TOPOLOGIES[topology]))
    with pytest.raises(ValueError, match=f"single_node.*{nodes} nodes"):
        testing.allreduce("single_node", TOPOLOGIES[topology], [torch.ones(3)] * len(TOPOLOGIES[topology]))


def test_unknown_strategy_and_reduction():
    with pytest.raises(ValueError, match="unknown chainermn communicator 'ring'"):
        testing.allreduce("ring", ["a", "a"], [torch.ones(3)] * 2)
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        testing.allreduce("flat", ["a", "a"], [torch.ones(3)] * 2, op="avg")


# ---- the thread transport ----------------------------------------------------------------------------


def check_collectives(t, dtype):
    """Every collective of transport `t` on this rank, checked against what transport.h promises."""
    me, size = t.rank, t.size
    last = size - 1

    def ramp(n, offset=0):
        return torch.arange(n, dtype=torch.int64).add(offset).to(dtype)

    x = ramp(5, me)
    t.allreduce(x)
    assert torch.equal(x, ramp(5).mul(size).add(size * last // 2)), x
    x = torch.full((4,), me, dtype=dtype)
    t.broadcast(x, root=last)
    assert torch.equal(x, torch.full((4,), last, dtype=dtype)), x
    x = ramp(6, me)
    recv = torch.zeros(6, dtype=dtype) if me == last else None
    t.reduce(x, recv, "max", root=last)
    assert me != last or torch.equal(recv, ramp(6, last)), recv
    t.reduce(x, x, "min", root=0)  # in place on the root; x is not touched elsewhere
    assert torch.equal(x, ramp(6, 0 if me == 0 else me)), x
    gathered = torch.zeros(3 * size, dtype=dtype)
    t.allgather(torch.full((3,), me, dtype=dtype), gathered)
    assert torch.equal(gathered, torch.arange(size).repeat_interleave(3).to(dtype)), gathered
    gathered = torch.zeros(2 * size, dtype=dtype) if me == 0 else None
    t.gather(torch.full((2,), me, dtype=dtype), gathered, 0)
    assert me != 0 or torch.equal(gathered, torch.arange(size).repeat_interleave(2).to(dtype)), gathered
    part = torch.zeros(2, dtype=dtype)
    t.scatter(ramp(2 * size) if me == last else None, part, last)
    assert torch.equal(part, ramp(2, 2 * me)), part
    part = torch.zeros(3, dtype=dtype)
    t.reduce_scatter(ramp(3 * size, me), part)
    assert torch.equal(part, ramp(3, 3 * me).mul(size).add(size * last // 2)), part
    # Rank me sends p + 1 elements valued 10 * me + p to rank p.
    send = torch.cat([torch.full((p + 1,), 10 * me + p) for p in range(size)]).to(dtype)
    recv = torch.zeros(size * (me + 1), dtype=dtype)
    t.alltoallv(send, [p + 1 for p in range(size)], recv, [me + 1] * size)
    assert torch.equal(recv, torch.tensor([10 * p + me for p in range(size)]).repeat_interleave(me + 1).to(dtype))
    t.barrier()
    return (me, size, t.library)


def test_shared_memory_collectives_of_one_cell_and_of_chunks():
    # The segment takes a message of up to 16 KiB a rank in one barrier through its exchange cells
    # (comm/shm.cpp), a larger one chunk by chunk: both sides of the line, and two chunks (1 MiB each).
    def per_rank(r):
        t, me, size = r.world, r.world.rank, r.world.size
        for n in (4096, 4097, 300_000):  # float32: 16 KiB, 16 KiB + 4 B, 1.2 MB
            ramp = torch.arange(n, dtype=torch.float32)
            x = ramp + me
            t.allreduce(x)  # in place
            assert torch.equal(x, ramp * size + size * (size - 1) // 2), n
            x = ramp + me
            t.reduce(x, x, "max", root=1)  # in place on the root; untouched elsewhere
            assert torch.equal(x, ramp + (size - 1 if me == 1 else me)), n
            x = torch.full((n,), float(me))
            t.broadcast(x, root=size - 1)
            assert torch.equal(x, torch.full((n,), float(size - 1))), n
            gathered = torch.zeros(n * size)
            t.allgather(ramp + me, gathered)
            assert torch.equal(gathered, torch.cat([ramp + p for p in range(size)])), n
        return t.library

    assert testing.run(["a"] * 3, per_rank, shared_memory=True) == ["shm"] * 3


@pytest.mark.parametrize("shared_memory", [False, True], ids=["threads", "shm"])
@pytest.mark.parametrize("topology", ["1x1", "1x4", "2x2-interleaved", "1+2+2", "3x2"])
def test_collectives_on_every_level(topology, shared_memory):
    names = TOPOLOGIES[topology]

    def per_rank(r):
        levels = {}
        for level in ("world", "intra", "inter"):
            for dtype in (torch.float32, torch.int64, torch.bfloat16):
                levels[level] = check_collectives(getattr(r, level), dtype)
        return levels

    results = testing.run(names, per_rank, shared_memory=shared_memory)
    topology_of = [torch_topology(names, rank) for rank in range(len(names))]
    for rank, levels in enumerate(results):
        t = topology_of[rank]
        assert levels["world"][:2] == (rank, len(names))
        assert levels["intra"][:2] == (t.intra_rank, t.intra_size)
        assert levels["inter"][1] == sum(len(node) > t.intra_rank for node in t.ranks_of_node)
        shm_intra = shared_memory and t.intra_size > 1
        assert levels["intra"][2] == ("shm" if shm_intra else "threads")
        assert levels["world"][2] == ("shm" if shm_intra and t.inter_size == 1 else "threads")


def torch_topology(names, rank):
    from torch_chainermn import _C

    return _C.topology_from_names(names, rank)


@pytest.mark.parametrize(
    "names, shared_memory", [(TOPOLOGIES["1+2+2"], False), (TOPOLOGIES["1x4"], True)], ids=["threads", "shm"]
)
def test_send_and_recv_match_by_peer_and_tag_in_order(names, shared_memory):
    def per_rank(r):
        t, me, size = r.world, r.world.rank, r.world.size
        assert t.library == ("shm" if shared_memory else "threads"), t.library
        # A ring: every rank sends before it receives, so sends must not wait for each other.
        right, left = torch.full((3,), me), torch.zeros(3, dtype=torch.int64)
        sent = t.send(right, (me + 1) % size, tag=7)
        t.recv(left, (me - 1) % size, tag=7).wait()
        sent.wait()
        assert torch.equal(left, torch.full((3,), (me - 1) % size)), left
        pending = []  # a send's tensor must outlive it: the receiver copies straight from it
        if me == 1:
            pending = [t.send(torch.tensor([value]), 0, tag=tag) for tag, value in ((1, 10), (2, 20), (2, 21))]
        if me == 0:
            # Tags select, and messages with the same tag from one peer arrive in order.
            got = [torch.zeros(1, dtype=torch.int64) for _ in range(3)]
            requests = [t.recv(got[0], 1, tag=2), t.recv(got[1], 1, tag=1), t.recv(got[2], 1, tag=2)]
            for request in requests:
                request.wait()
            assert [int(g) for g in got] == [20, 10, 21], got
            # From any source: the request says who sent what.
            sources = set()
            for _ in range(size - 1):
                x = torch.zeros(1, dtype=torch.int64)
                request = t.recv(x, testing.any_source, tag=3)
                request.wait()
                assert int(x) == 100 + request.source, (x, request.source)
                sources.add(request.source)
            assert sources == set(range(1, size))
        else:
            t.send(torch.tensor([100 + me]), 0, tag=3).wait()
        for request in pending:
            request.wait()
        t.barrier()
        return True

    assert testing.run(names, per_rank, shared_memory=shared_memory) == [True] * len(names)


# ---- helper threads spin only while it pays (linger.h) ---------------------------------------------------


def test_helper_threads_stop_spinning_through_long_gaps_and_spin_again_when_traffic_is_dense():
    ping_pong, pipeline = [20.0] * 10, [5000.0] * 10
    assert all(testing.linger_decisions(ping_pong))  # a latency-bound loop: spin after every op
    spun = testing.linger_decisions(ping_pong + pipeline + ping_pong)
    assert not any(spun[14:20]), spun  # milliseconds of compute between messages: sleep at once
    assert all(spun[-4:]), spun  # dense traffic again: spinning is back
    # A header and its payload back to back, then a long compute: half the gaps short is not enough.
    assert not any(testing.linger_decisions([20.0, 5000.0] * 20)[10:])
    # Once asleep, a ping-pong answers later (here 150 us a gap, three lingers): still short enough to
    # bring spinning back, or a loop that crossed the linger would stay slow for good.
    assert all(testing.linger_decisions(pipeline + [150.0] * 30)[-10:])


YIELD_VERDICTS = (
    "import os; os.sched_setaffinity(0, {%d}); from torch_chainermn._C import testing; print(testing.yield_verdicts())"
)


def test_a_yield_back_late_is_contention_unless_another_thread_of_the_process_worked():
    # A rank bound to one CPU learns that the machine is busy from its yields (spin.h): one that came
    # back after more than a millisecond gave the CPU to another process, unless a thread of its own
    # was running an op or moving messages meanwhile (OwnWork). The thread's own work excuses nothing.
    # A process on several CPUs (this one) reads the run queue instead and judges no yield.
    cpu = min(os.sched_getaffinity(0))
    bound = subprocess.run([sys.executable, "-c", YIELD_VERDICTS % cpu], capture_output=True, text=True, timeout=120)
    assert bound.returncode == 0, bound.stderr[-3000:]
    assert bound.stdout.strip().splitlines()[-1] == str([False, True, False, False, True]), bound.stdout
    if len(os.sched_getaffinity(0)) > 1:
        assert testing.yield_verdicts() == [False] * 5


# ---- store calls on failure paths never hang (runtime/store_courier.h) ----------------------------------


def test_a_store_call_that_hangs_costs_its_caller_the_patience_once():
    (quick, q_ms), (hung, h_ms), (behind, b_ms), (after, _), (threw, _), (turn, t_ms) = testing.store_courier(200)
    assert quick and q_ms < 200
    assert not hung and h_ms >= 200  # waited its patience, then gave up: the call keeps its thread
    assert not behind and b_ms < 100  # while that one hangs, the next fails at once instead of queueing
    assert after  # the hung call returned: the courier serves again
    assert not threw  # a store error is a failure to answer, never an exception on the failure path
    assert turn and t_ms < 200  # another thread's slow call was out: this one waited its turn, not failed


# ---- point to point through shared memory (comm/shm_mailbox.h) ----------------------------------------

BIG = 3_000_000  # float32 elements: 12 MB, many times a ring (1 MiB for 2 ranks), so messages stream


def test_shared_memory_messages_stream_past_their_ring_while_the_peer_is_busy():
    def per_rank(r):
        t, me = r.world, r.world.rank
        assert t.library == "shm"
        big = [torch.arange(BIG, dtype=torch.float32) + k for k in range(2)]
        if me == 0:
            # Both sends are posted before the receiver takes either; the receiver takes them in the
            # other order (a message nobody waits for yet moves aside), and rank 0 sits in a barrier
            # meanwhile: the transfers move without it.
            sent = [t.send(big[0], 1, tag=11), t.send(big[1], 1, tag=12)]
            t.barrier()
            for request in sent:
                request.wait()
            # A blocking receive on one side while the sender is inside a collective.
            late = t.send(big[1], 1, tag=5)
            t.barrier()
            late.wait()
        else:
            t.barrier()
            a, b = torch.zeros(BIG), torch.zeros(BIG)
            t.recv(b, 0, tag=12).wait()
            t.recv(a, 0, tag=11).wait()
            assert torch.equal(a, big[0]) and torch.equal(b, big[1])
            c = torch.zeros(BIG)
            t.recv(c, 0, tag=5).wait()
            assert torch.equal(c, big[1])
            t.barrier()
        # Empty messages, and messages to oneself.
        empty = t.send(torch.zeros(0), me, tag=9)
        t.recv(torch.zeros(0), me, tag=9).wait()
        empty.wait()
        y = torch.zeros(5)
        to_self = t.send(torch.full((5,), float(me)), me, tag=8)
        t.recv(y, me, tag=8).wait()
        to_self.wait()
        assert torch.equal(y, torch.full((5,), float(me)))
        return True

    assert testing.run(["a", "a"], per_rank, shared_memory=True, timeout=30) == [True, True]


def test_shared_memory_messages_that_wait_in_the_ring_for_their_receive():
    # A message no receive wants yet stays in the ring while nothing is behind it (comm/shm_mailbox.h):
    # a later receive takes it from there; one that does not match it fails and skips it; and once a
    # message is behind it, a receive for that one moves it aside first.
    def per_rank(r):
        t = r.world
        if r.rank == 0:
            t.send(torch.arange(6.0), 1, tag=1).wait()
            t.barrier()  # the receiver posts only now: the message waited in the ring
            t.send(torch.ones(10), 1, tag=4).wait()
            t.barrier()
            t.send(torch.arange(3.0), 1, tag=4).wait()
            t.send(torch.full((4,), 2.0), 1, tag=2).wait()
            t.send(torch.full((4,), 3.0), 1, tag=3).wait()
            t.barrier()
            return ""
        t.barrier()
        first = torch.zeros(6)
        t.recv(first, 0, tag=1).wait()
        assert torch.equal(first, torch.arange(6.0)), first
        t.barrier()
        wrong = torch.zeros(5)
        try:
            t.recv(wrong, 0, tag=4).wait()
            error = ""
        except ValueError as e:
            error = str(e)
        assert torch.equal(wrong, torch.zeros(5)), wrong  # not written
        right = torch.zeros(3)
        t.recv(right, 0, tag=4).wait()
        assert torch.equal(right, torch.arange(3.0)), right
        t.barrier()
        later, earlier = torch.zeros(4), torch.zeros(4)
        t.recv(later, 0, tag=3).wait()  # behind the tag-2 message, which moves aside
        t.recv(earlier, 0, tag=2).wait()
        assert torch.equal(later, torch.full((4,), 3.0)) and torch.equal(earlier, torch.full((4,), 2.0))
        return error

    error = testing.run(["a", "a"], per_rank, shared_memory=True, timeout=30)[1]
    assert "expected 5 torch.float32 elements from rank 0 (tag 4), which sent 10 torch.float32" in error, error


def test_shared_memory_receives_of_any_size():
    # Transport::recvAnySize: the message lands in a tensor of the sender's count and dtype, whether
    # the receive came first, the message waited in the ring, or it was streaming past the ring
    # (larger than half of it) when the receive came.
    big_sent = threading.Event()  # the ranks are threads of this process

    def per_rank(r):
        t = r.world
        big = torch.arange(BIG, dtype=torch.float32)
        if r.rank == 0:
            t.barrier()  # the receiver's first receive is posted
            t.send(torch.arange(5, dtype=torch.int64), 1, tag=1).wait()
            t.send(torch.tensor([1.5, 2.5], dtype=torch.float64), 1, tag=2).wait()
            t.barrier()
            sent = t.send(big, 1, tag=3)  # returns with the first ring-full written (the mailbox
            big_sent.set()  # progresses at once); the other 11 MB follow as room frees
            sent.wait()
            t.barrier()
            return True
        first = t.recv_any_size(0, tag=1)
        t.barrier()
        got = [first.wait()]
        t.barrier()  # the tag-2 message waited in the ring until now
        got.append(t.recv_any_size(0, tag=2).wait())
        assert big_sent.wait(30)  # the big message is streaming past the ring now
        got.append(t.recv_any_size(0, tag=3).wait())
        t.barrier()
        return (
            torch.equal(got[0], torch.arange(5, dtype=torch.int64))
            and torch.equal(got[1], torch.tensor([1.5, 2.5], dtype=torch.float64))
            and torch.equal(got[2], big)
        )

    assert testing.run(["a", "a"], per_rank, shared_memory=True, timeout=30) == [True, True]


def test_shared_memory_receive_that_does_not_match_fails_and_the_pair_stays_usable():
    def per_rank(r):
        t = r.world
        if r.rank == 0:
            for x in (torch.ones(10), torch.ones(4, dtype=torch.float64), torch.arange(3.0)):
                t.send(x, 1).wait()
            return ""
        errors = []
        for x in (torch.zeros(5), torch.zeros(4)):
            try:
                t.recv(x, 0).wait()
            except ValueError as error:
                errors.append(str(error))
            assert torch.equal(x, torch.zeros_like(x)), x  # not written
        good = torch.zeros(3)
        t.recv(good, 0).wait()
        assert torch.equal(good, torch.arange(3.0)), good
        return errors

    errors = testing.run(["a", "a"], per_rank, shared_memory=True)[1]
    assert (
        "recv on rank 1 expected 5 torch.float32 elements from rank 0 (tag 0), which sent 10 torch.float32" in errors[0]
    ), errors
    assert "expected 4 torch.float32 elements" in errors[1] and "sent 4 torch.float64" in errors[1], errors


def test_shared_memory_dropped_requests_never_touch_their_buffers():
    def per_rank(r):
        t = r.world
        if r.rank == 0:
            x = torch.arange(BIG, dtype=torch.float32)
            t.send(x, 1, tag=1)  # dropped half-way through its ring: the rest is kept aside
            x.fill_(-1.0)  # so what the receiver gets is the message as it was sent
            t.barrier()
            t.send(torch.full((4,), 7.0), 1, tag=2).wait()
            return True
        dropped = torch.zeros(4)
        t.recv(dropped, 0, tag=2)  # dropped at once: the message goes to the next receive instead
        t.barrier()
        whole = torch.zeros(BIG)
        t.recv(whole, 0, tag=1).wait()
        later = torch.zeros(4)
        t.recv(later, 0, tag=2).wait()
        return (
            torch.equal(whole, torch.arange(BIG, dtype=torch.float32)),
            torch.equal(dropped, torch.zeros(4)),
            torch.equal(later, torch.full((4,), 7.0)),
        )

    assert testing.run(["a", "a"], per_rank, shared_memory=True, timeout=30) == [True, (True, True, True)]


def test_send_and_recv_of_different_sizes_fail_both():
    def per_rank(r):
        if r.rank == 0:
            r.world.send(torch.ones(3), 1).wait()
        else:
            r.world.recv(torch.ones(4), 0).wait()

    with pytest.raises(dist.DistBackendError, match="send of 3 Float .* met a receive of 4 Float"):
        testing.run(["a", "a"], per_rank)


def test_unmatched_recv_times_out():
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match="receive from 1 .*tag 5.* not matched within 300 ms"):
        testing.run(
            ["a", "a"], lambda r: r.world.recv(torch.ones(1), 1, tag=5).wait() if r.rank == 0 else None, timeout=0.3
        )
    assert time.monotonic() - start < 5


def test_ranks_must_agree_on_each_collective():
    def count(r):
        r.world.allreduce(torch.ones(3 + r.rank))

    with pytest.raises(dist.DistBackendError, match=r"disagree on the count.*rank 0 .* allreduce\(count 3"):
        testing.run(["a", "b", "b"], count)

    def op(r):
        x = torch.ones(3)
        r.world.allreduce(x) if r.rank == 0 else r.world.broadcast(x, 0)

    with pytest.raises(dist.DistBackendError, match="disagree on the op"):
        testing.run(["a", "a"], op)


def test_buffers_may_alias_only_where_allowed():
    def per_rank(r):
        send = torch.arange(6.0)
        r.world.reduce_scatter(send, send[:3])

    with pytest.raises(RuntimeError, match="reduceScatter: send and recv overlap"):
        testing.run(["a", "a"], per_rank)


def test_an_error_on_one_rank_fails_every_rank_at_once():
    seen = {}

    def per_rank(r):
        try:
            if r.rank == 2:
                raise KeyError("boom on rank 2")
            r.world.allreduce(torch.ones(1000))
            r.world.recv(torch.ones(1), 2).wait()
        except Exception as error:
            seen[r.rank] = str(error)
            raise

    start = time.monotonic()
    with pytest.raises(KeyError, match="boom on rank 2"):  # the cause, as it was raised
        testing.run(["a", "a", "b", "b"], per_rank, timeout=60)
    assert time.monotonic() - start < 5
    for rank in (0, 1, 3):
        assert "aborted because rank 2 failed" in seen[rank] and "boom on rank 2" in seen[rank], seen[rank]


def test_a_point_to_point_wait_is_aborted_too():
    def per_rank(r):
        if r.rank == 1:
            raise ValueError("no message from rank 1")
        r.world.recv(torch.ones(1), 1).wait()

    start = time.monotonic()
    with pytest.raises(ValueError, match="no message from rank 1"):
        testing.run(["a", "b"], per_rank, timeout=60)
    assert time.monotonic() - start < 5


def test_a_rank_that_never_comes_is_named_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"waited 300 ms in barrier for rank\(s\) 1 that never came"):
        testing.run(["a", "a", "a"], lambda r: None if r.rank == 1 else r.world.barrier(), timeout=0.3)
    assert time.monotonic() - start < 5


def test_a_rank_failing_inside_a_collective_fails_the_others_at_once():
    def per_rank(r):
        size = r.world.size
        recv_counts = [1] * size if r.rank != 2 else [5] * size  # rank 2 expects more than it is sent
        r.world.alltoallv(torch.ones(size), [1] * size, torch.zeros(sum(recv_counts)), recv_counts)
        r.world.barrier()

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 sends 1 elements to rank 2, which expects 5"):
        testing.run(["a", "a", "b"], per_rank, timeout=60)
    assert time.monotonic() - start < 5


def test_a_dropped_request_never_touches_its_buffer():
    def per_rank(r):
        if r.rank == 0:
            r.world.send(torch.ones(1000), 1)  # dropped at once: the send is cancelled
            r.world.barrier()
        else:
            r.world.barrier()
            r.world.recv(torch.zeros(1000), 0).wait()

    with pytest.raises(dist.DistBackendError, match="receive from 0 .* not matched"):
        testing.run(["a", "a"], per_rank, timeout=0.3)


def test_waiter_pool_gives_every_job_a_thread_and_reuses_them():
    # Each round's 6 jobs wait for one another (a pool that made a job wait for a thread would fail
    # the round); later rounds start no thread (Gloo's transfers once started one per message, and
    # every such thread left torch's per-thread state behind: the receiver's memory grew).
    assert testing.waiter_pool(6, 4) == 6
    assert testing.waiter_pool(1, 50) == 1
