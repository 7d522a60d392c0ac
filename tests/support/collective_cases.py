"""Every collective x dtype x reduce op, checked against a result computed locally from every rank's input.

`CASES` maps a case name to a function `case(rank, size)` that raises on a wrong result. Every rank
runs every case in the same order (`run_cases`), so one process group serves hundreds of checks; the
names do not depend on the world size, so pytest can list them before any process starts.

The case factories take a `device`: the inputs are made on it and the results compared on the CPU
with references computed there, so tests/test_cuda_collectives.py runs these same cases on CUDA
tensors.
"""

from __future__ import annotations

import datetime
import time
import traceback

import torch
import torch.distributed as dist

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
FLOATING = {"float16", "bfloat16", "float32", "float64"}
# The dtypes NCCL carries (no int16; it carries bool as uint8): the CUDA runs' dtypes.
NCCL_DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "int8", "uint8"]
REDUCE_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM", "BAND", "BOR", "BXOR"]
BITWISE = ("BAND", "BOR", "BXOR")
SHAPES = [(), (0,), (5,), (2, 3, 4)]  # 0-d, empty, 1-D, 3-D
PREMUL_FACTOR = 2.0


# ---- inputs and references -----------------------------------------------------------------------


def small_values(rank: int, shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """Values in {1, 2, 3} (bool: alternating), so sums and products stay exact in every dtype."""
    n = int(torch.Size(shape).numel())
    base = (torch.arange(n, dtype=torch.int64) + rank) % 3 + 1
    if dtype == torch.bool:
        base = (torch.arange(n) + rank) % 2 == 0
    return base.to(dtype).reshape(shape).to(device)


def tagged_values(rank: int, n: int, dtype: torch.dtype, salt: int = 0, device="cpu") -> torch.Tensor:
    """Values that tell which rank (and position) they came from, exact in every dtype."""
    base = (torch.arange(n, dtype=torch.int64) + rank * 31 + salt * 7) % 97
    if dtype == torch.bool:
        return (base % 2 == 1).to(device)
    return base.to(dtype).to(device)


def reduce_op(name: str):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, name)


def cuda_has_bitwise() -> bool:
    """Whether this process's default group reduces CUDA tensors bitwise: only when CUDA tensors are
    staged through the host library (NCCL has no bitwise reductions)."""
    import torch_chainermn

    return torch_chainermn.get_options().cuda_transport == "staged"


def refusal(op: str, dtype_name: str, device="cpu"):
    """None when reducing `dtype_name` with `op` on `device` must work; otherwise the words the
    ValueError refusing it must contain (the dtype or the op that is refused, and "CUDA" where only
    the device makes it unavailable)."""
    if dtype_name == "int16":
        return ("int16",)  # moves, but is never reduced (Gloo cannot, so neither transport does)
    if op in BITWISE and dtype_name in FLOATING:
        return (op,)
    if op == "PREMUL_SUM" and dtype_name not in FLOATING:
        return (op,)
    if op == "AVG" and dtype_name == "bool":  # integers average as NCCL does (sum // size)
        return (op,)
    if op in BITWISE and torch.device(device).type == "cuda" and not cuda_has_bitwise():
        return (op, "CUDA")
    return None


def reference_reduce(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stacked = torch.stack(inputs).to(torch.int64)
        if op in ("SUM", "MAX", "BOR"):
            return stacked.amax(0).bool() if stacked.numel() else stacked.sum(0).bool()
        if op in ("PRODUCT", "MIN", "BAND"):
            return stacked.amin(0).bool() if stacked.numel() else stacked.sum(0).bool()
        return (stacked.sum(0) % 2).bool()  # BXOR
    wide = torch.stack(inputs).to(torch.float64 if dtype.is_floating_point else torch.int64)
    if op == "SUM":
        out = wide.sum(0)
    elif op == "AVG":  # integers: NCCL's rule, the sum divided by the size, truncating
        out = (
            wide.sum(0) / len(inputs)
            if dtype.is_floating_point
            else torch.div(wide.sum(0), len(inputs), rounding_mode="trunc")
        )
    elif op == "PREMUL_SUM":
        out = wide.sum(0) * PREMUL_FACTOR
    elif op == "PRODUCT":
        out = wide.prod(0)
    elif op == "MIN":
        out = wide.amin(0) if wide.numel() else wide.sum(0)
    elif op == "MAX":
        out = wide.amax(0) if wide.numel() else wide.sum(0)
    else:
        out = wide[0].clone()
        for other in wide[1:]:
            out = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op](out, other)
    return out.to(dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # A CUDA result is compared on the CPU, with the CPU reference or with a copy of a CUDA input.
    actual, expected = actual.cpu(), expected.cpu()
    if actual.dtype in (torch.float16, torch.bfloat16):
        # AVG scales each input by 1/size in 16 bits before the sum (so the sum cannot overflow).
        torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: {m}")
    elif actual.dtype.is_floating_point:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")
    else:
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{what}: {actual} != {expected}"


def expect_value_error(fn, *words: str) -> None:
    try:
        fn()
    except ValueError as error:
        message = str(error)
        missing = [w for w in words if w not in message]
        assert not missing, f"error message {message!r} lacks {missing}"
        return
    raise AssertionError(f"expected ValueError mentioning {words}")


def value_errors(calls) -> list:
    """The message of the ValueError each call raises, "" where one raises none (for the test to
    compare on every rank)."""
    errors = []
    for call in calls:
        try:
            call()
            errors.append("")
        except ValueError as error:
            errors.append(str(error))
    return errors


# ---- the cases -------------------------------------------------------------------------------------
# Factories take the dtype, the device the tensors live on and, for reductions, the ops to try. A
# combination that must be refused is called anyway and must raise the ValueError `refusal` names.


def all_reduce_case(dtype_name: str, op: str, device="cpu"):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        for shape in SHAPES:
            tensor = small_values(rank, shape, dtype, device)
            words = refusal(op, dtype_name, device)
            if words:
                expect_value_error(lambda: dist.all_reduce(tensor, op=reduce_op(op)), "all_reduce", *words)
                continue
            dist.all_reduce(tensor, op=reduce_op(op))
            expected = reference_reduce([small_values(r, shape, dtype) for r in range(size)], op)
            assert_same(tensor, expected, f"all_reduce {op} {dtype_name} {shape}")

    return case


def all_reduce_async_case(device="cpu"):
    def case(rank, size):
        tensors = [small_values(rank, (7,), torch.float32, device) * (i + 1) for i in range(4)]
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        futures = [w.get_future() for w in works]
        for i, (work, future) in enumerate(zip(works, futures)):
            assert work.wait()
            if tensors[i].is_cuda:
                # As with torch's nccl: wait() orders the caller's stream after the op; the Work is
                # complete once the device ran it (the watchdog looks every 100 ms).
                torch.cuda.synchronize()
                until = time.monotonic() + 30
                while not work.is_completed() and time.monotonic() < until:
                    time.sleep(0.01)
            assert work.is_completed() and work.is_success()
            expected = reference_reduce([small_values(r, (7,), torch.float32) for r in range(size)], "SUM") * (i + 1)
            assert_same(tensors[i], expected, "async all_reduce")
            value = future.wait()
            assert isinstance(value, list) and value[0] is not None
            assert_same(value[0], expected, "future value")
        chained = (
            dist.all_reduce(torch.ones(3, device=device), async_op=True)
            .get_future()
            .then(lambda fut: fut.value()[0] * 2)
        )
        assert_same(chained.wait(), torch.full((3,), 2.0 * size), "then() callback")

    return case


def callback_issues_collective_case(rank, size):
    """A then() callback runs when the worker finishes an op; issuing the next op from it must not deadlock."""
    second = torch.ones(3)
    issued = {}

    def chain(future):
        issued["work"] = dist.all_reduce(second, async_op=True)
        return future.value()[0]

    first = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(chain)
    assert_same(first.wait(), torch.full((3,), float(size)), "first all_reduce")
    issued["work"].wait()
    assert_same(second, torch.full((3,), float(size)), "all_reduce issued from a callback")


def callback_waits_for_point_to_point_case(rank, size):
    """A then() callback that sends and receives and waits for both (as a pipeline's hook might).

    The callback runs on the worker that must also move the transfers on: its wait() does that."""
    outgoing, incoming = torch.full((5,), float(rank)), torch.empty(5)

    def exchange(future):
        send = dist.isend(outgoing, (rank + 1) % size)
        recv = dist.irecv(incoming, (rank - 1) % size)
        send.wait()
        recv.wait()
        return incoming.clone()

    done = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(exchange)
    assert_same(done.wait(), torch.full((5,), float((rank - 1) % size)), "received in a callback")


def waited_work_with_waiting_callback_case(rank, size):
    """A Work waited for with wait() whose then() callback issues a collective and waits for it:
    wherever the callback runs (the worker, nested), the second collective must run."""
    second = torch.ones(3)

    def chain(future):
        dist.all_reduce(second)  # waits: the worker, or this thread, must be free to run it
        return second.clone()

    work = dist.all_reduce(torch.ones(3), async_op=True)
    chained = work.get_future().then(chain)
    work.wait()
    assert_same(chained.wait(), torch.full((3,), float(size)), "all_reduce waited for in a callback")


def wait_with_timeout_case(rank, size):
    """wait(timeout) returns at its timeout while a peer is late (whoever runs the op), and the op
    completes once the peer comes."""
    tensor = torch.ones(3)
    store = dist.distributed_c10d._get_default_store()  # out of band: the group's order stays the same
    if rank == 0:
        work = dist.all_reduce(tensor, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(milliseconds=200))
            outcome = "returned"
        except RuntimeError as error:  # DistBackendError
            outcome = str(error)
        store.set("wait_with_timeout/go", "1")  # the peers join only now
        assert "timed out after 200 ms" in outcome, outcome
        work.wait()
    else:
        store.get("wait_with_timeout/go")
        dist.all_reduce(tensor)
    assert_same(tensor, torch.full((3,), float(size)), "all_reduce after a wait that timed out")


def all_reduce_coalesced_case(dtype_name: str, device="cpu"):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        tensors = [small_values(rank, shape, dtype, device) for shape in SHAPES]
        words = refusal("MAX", dtype_name, device)
        if words:
            expect_value_error(lambda: dist.all_reduce_coalesced(tensors, op=dist.ReduceOp.MAX), "all_reduce", *words)
            return
        dist.all_reduce_coalesced(tensors, op=dist.ReduceOp.MAX)
        for shape, tensor in zip(SHAPES, tensors):
            expected = reference_reduce([small_values(r, shape, dtype) for r in range(size)], "MAX")
            assert_same(tensor, expected, f"all_reduce_coalesced {dtype_name} {shape}")

    return case


def broadcast_case(dtype_name: str, device="cpu"):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        for root in sorted({0, size - 1}):
            for shape in SHAPES:
                n = int(torch.Size(shape).numel())
                tensor = tagged_values(rank, n, dtype, device=device).reshape(shape)
                dist.broadcast(tensor, src=root)
                assert_same(tensor, tagged_values(root, n, dtype).reshape(shape), f"broadcast from {root}")

    return case


def reduce_case(dtype_name: str, device="cpu", ops=("SUM", "MAX", "AVG")):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        for root in sorted({0, size - 1}):
            for op in ops:
                tensor = small_values(rank, (2, 3), dtype, device)
                words = refusal(op, dtype_name, device)
                if words:
                    expect_value_error(lambda: dist.reduce(tensor, dst=root, op=reduce_op(op)), "reduce", *words)
                    continue
                before = tensor.clone()
                dist.reduce(tensor, dst=root, op=reduce_op(op))
                if rank == root:
                    expected = reference_reduce([small_values(r, (2, 3), dtype) for r in range(size)], op)
                    assert_same(tensor, expected, f"reduce {op} to {root}")
                else:
                    assert_same(tensor, before, "reduce leaves non-root inputs unchanged")

    return case


def all_gather_case(dtype_name: str, device="cpu"):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        for shape in SHAPES:
            n = int(torch.Size(shape).numel())
            mine = tagged_values(rank, n, dtype, device=device).reshape(shape)
            outputs = [torch.empty(shape, dtype=dtype, device=device) for _ in range(size)]
            dist.all_gather(outputs, mine)
            for r in range(size):
                assert_same(outputs[r], tagged_values(r, n, dtype).reshape(shape), f"all_gather block {r}")

    return case


def all_gather_into_tensor_case(dtype_name: str, device="cpu"):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        for n in (0, 1, 6):
            mine = tagged_values(rank, n, dtype, device=device)
            stacked = torch.empty(size, n, dtype=dtype, device=device)
            dist.all_gather_into_tensor(stacked, mine)
            expected = torch.stack([tagged_values(r, n, dtype) for r in range(size)])
            assert_same(stacked, expected, "all_gather_into_tensor (stacked)")
            flat = torch.empty(size * n, dtype=dtype, device=device)
            dist.all_gather_into_tensor(flat, mine)
            assert_same(flat, expected.reshape(-1), "all_gather_into_tensor (concatenated)")

    return case


def gather_case(dtype_name: str, device="cpu"):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        for root in sorted({0, size - 1}):
            mine = tagged_values(rank, 4, dtype, device=device)
            gathered = [torch.empty(4, dtype=dtype, device=device) for _ in range(size)] if rank == root else None
            dist.gather(mine, gathered, dst=root)
            if rank == root:
                for r in range(size):
                    assert_same(gathered[r], tagged_values(r, 4, dtype), f"gather block {r}")

    return case


def scatter_case(dtype_name: str, device="cpu"):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        for root in sorted({0, size - 1}):
            pieces = (
                [tagged_values(r, 3, dtype, salt=root, device=device) for r in range(size)] if rank == root else None
            )
            out = torch.empty(3, dtype=dtype, device=device)
            dist.scatter(out, pieces, src=root)
            assert_same(out, tagged_values(rank, 3, dtype, salt=root), f"scatter from {root}")

    return case


def reduce_scatter_case(dtype_name: str, device="cpu", ops=("SUM", "MIN", "AVG")):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        for op in ops:
            inputs = [small_values(rank + 7 * p, (2, 2), dtype, device) for p in range(size)]
            out = torch.empty(2, 2, dtype=dtype, device=device)
            words = refusal(op, dtype_name, device)
            if words:
                expect_value_error(lambda: dist.reduce_scatter(out, inputs, op=reduce_op(op)), "reduce_scatter", *words)
                continue
            dist.reduce_scatter(out, inputs, op=reduce_op(op))
            expected = reference_reduce([small_values(r + 7 * rank, (2, 2), dtype) for r in range(size)], op)
            assert_same(out, expected, f"reduce_scatter {op}")

    return case


def reduce_scatter_tensor_case(dtype_name: str, device="cpu", ops=("SUM", "MAX", "PREMUL_SUM")):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        for op in ops:
            whole = small_values(rank, (size * 3,), dtype, device)
            before = whole.clone()
            out = torch.empty(3, dtype=dtype, device=device)
            words = refusal(op, dtype_name, device)
            if words:
                expect_value_error(
                    lambda: dist.reduce_scatter_tensor(out, whole, op=reduce_op(op)), "reduce_scatter_tensor", *words
                )
                continue
            dist.reduce_scatter_tensor(out, whole, op=reduce_op(op))
            expected = reference_reduce([small_values(r, (size * 3,), dtype) for r in range(size)], op)
            assert_same(out, expected[rank * 3 : (rank + 1) * 3], f"reduce_scatter_tensor {op}")
            assert_same(whole, before, "reduce_scatter_tensor leaves its input unchanged")

    return case


def all_to_all_case(dtype_name: str, device="cpu"):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        # Rank r sends (r + p) % 3 + 1 elements to rank p: every pair has its own size.
        inputs = [tagged_values(rank, (rank + p) % 3 + 1, dtype, salt=p, device=device) for p in range(size)]
        outputs = [torch.empty((r + rank) % 3 + 1, dtype=dtype, device=device) for r in range(size)]
        dist.all_to_all(outputs, inputs)
        for r in range(size):
            assert_same(outputs[r], tagged_values(r, (r + rank) % 3 + 1, dtype, salt=rank), f"all_to_all from {r}")

    return case


def all_to_all_single_case(dtype_name: str, device="cpu"):
    dtype = DTYPES[dtype_name]

    def rows(src, dst):
        return (src + 2 * dst) % 3  # uneven, and sometimes zero

    def block(src, dst):
        return tagged_values(src, rows(src, dst) * 2, dtype, salt=dst).reshape(-1, 2)

    def case(rank, size):
        # Even splits.
        mine = tagged_values(rank, size * 2, dtype, device=device)
        out = torch.empty(size * 2, dtype=dtype, device=device)
        dist.all_to_all_single(out, mine)
        expected = torch.cat([tagged_values(r, size * 2, dtype)[rank * 2 : (rank + 1) * 2] for r in range(size)])
        assert_same(out, expected, "all_to_all_single (even)")
        # Uneven splits of 2-column rows.
        send = torch.cat([block(rank, p) for p in range(size)]).to(device)
        recv = torch.empty(sum(rows(r, rank) for r in range(size)), 2, dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, [rows(r, rank) for r in range(size)], [rows(rank, p) for p in range(size)])
        assert_same(recv, torch.cat([block(r, rank) for r in range(size)]), "all_to_all_single (uneven)")

    return case


def send_recv_case(dtype_name: str):
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        # A ring: everyone sends right and receives from the left, with isend/irecv so no order deadlocks.
        right, left = (rank + 1) % size, (rank - 1) % size
        for shape in SHAPES:
            n = int(torch.Size(shape).numel())
            out = torch.empty(shape, dtype=dtype)
            recv = dist.irecv(out, src=left, tag=5)
            send = dist.isend(tagged_values(rank, n, dtype).reshape(shape), dst=right, tag=5)
            send.wait()
            recv.wait()
            assert_same(out, tagged_values(left, n, dtype).reshape(shape), "ring send/recv")

    return case


def directed_send_recv_case(dtype_name: str, device="cpu"):
    """Every ordered pair of ranks in turn, one direction at a time, with send/recv and then
    isend/irecv. A receive is never posted before its sender's turn, so this holds also on a
    transport that runs each transfer to completion in issue order (NCCL on one stream), where a
    ring of receives posted first would deadlock."""
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        for shape in SHAPES:
            n = int(torch.Size(shape).numel())
            for kind in ("send/recv", "isend/irecv"):
                for src in range(size):
                    for dst in range(size):
                        if src == dst or rank not in (src, dst):
                            continue
                        if rank == src:
                            mine = tagged_values(src, n, dtype, salt=dst, device=device).reshape(shape)
                            if kind == "send/recv":
                                dist.send(mine, dst=dst, tag=7)
                            else:
                                dist.isend(mine, dst=dst, tag=7).wait()
                            continue
                        out = torch.zeros(shape, dtype=dtype, device=device)
                        if kind == "send/recv":
                            assert dist.recv(out, src=src, tag=7) == src
                        else:
                            dist.irecv(out, src=src, tag=7).wait()
                        assert_same(
                            out,
                            tagged_values(src, n, dtype, salt=dst).reshape(shape),
                            f"{kind} {shape} from {src} to {dst}",
                        )

    return case


def tags_case(rank, size):
    # Messages with different tags are matched by tag, not by order.
    if rank == 0:
        dist.send(torch.tensor([1.0]), dst=1, tag=11)
        dist.send(torch.tensor([2.0]), dst=1, tag=22)
    elif rank == 1:
        second, first = torch.zeros(1), torch.zeros(1)
        w2 = dist.irecv(second, src=0, tag=22)
        w1 = dist.irecv(first, src=0, tag=11)
        w1.wait()
        w2.wait()
        assert first.item() == 1.0 and second.item() == 2.0, (first, second)
    dist.barrier()


def recv_any_source_case(rank, size):
    if rank == 0:
        seen = set()
        for _ in range(size - 1):
            t = torch.zeros(1, dtype=torch.int64)
            source = dist.recv(t, tag=3)
            assert t.item() == source * 10, (t, source)
            seen.add(source)
        assert seen == set(range(1, size)), seen
    else:
        dist.send(torch.tensor([rank * 10]), dst=0, tag=3)
    dist.barrier()


def batch_isend_irecv_case(rank, size):
    right, left = (rank + 1) % size, (rank - 1) % size
    send = torch.arange(4, dtype=torch.float32) + rank * 100
    recv = torch.zeros(4)
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert_same(recv, torch.arange(4, dtype=torch.float32) + left * 100, "batch_isend_irecv")


def abandoned_batch_case(rank, size):
    """A batch refused part-way raises on the calling rank and leaves nothing half-coalesced: a later
    batch and plain sends and receives run. Refused by the backend (a non-contiguous tensor) and by
    torch in Python (a peer outside the group, after the first transfer reached the backend)."""
    right, left = (rank + 1) % size, (rank - 1) % size
    strided = torch.zeros(4)[::2]
    expect_value_error(
        lambda: dist.batch_isend_irecv(
            [dist.P2POp(dist.irecv, torch.zeros(2), left), dist.P2POp(dist.isend, strided, right)]
        ),
        "contiguous",
    )
    try:
        dist.batch_isend_irecv(
            [dist.P2POp(dist.irecv, torch.zeros(2), left), dist.P2POp(dist.isend, torch.ones(2), size + 5)]
        )
        raise AssertionError("a peer outside the group was accepted")
    except ValueError:
        pass
    recv = torch.zeros(3)
    for work in dist.batch_isend_irecv(
        [dist.P2POp(dist.irecv, recv, left), dist.P2POp(dist.isend, torch.full((3,), float(rank)), right)]
    ):
        work.wait()
    assert_same(recv, torch.full((3,), float(left)), "batch after an abandoned one")
    plain = torch.zeros(1)
    sent = dist.isend(torch.full((1,), float(rank)), right)
    dist.recv(plain, left)
    sent.wait()
    assert_same(plain, torch.full((1,), float(left)), "send and recv after an abandoned batch")


def receive_first_batch_isend_irecv_case(dtype_name: str, device="cpu"):
    """batch_isend_irecv around the ring with every rank's receive listed first: run one at a time in
    list order (as NCCL runs transfers on one stream) every rank would wait for a send that never
    starts. The backend coalesces the batch (one ncclGroupStart/End over NCCL) into one Work."""
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        right, left = (rank + 1) % size, (rank - 1) % size
        send = tagged_values(rank, 5, dtype, salt=right, device=device)
        recv = torch.zeros(5, dtype=dtype, device=device)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, left), dist.P2POp(dist.isend, send, right)])
        assert len(works) == 1, f"a coalesced batch is one Work, got {len(works)}"
        # The batch's Work stands for all its tensors: on a GPU, wait() orders the caller's stream
        # only after the devices of the Work's tensors (with none, the receive below read zeros).
        result = works[0].result()
        assert [t.data_ptr() for t in result] == [recv.data_ptr(), send.data_ptr()], "the batch's result"
        works[0].wait()
        assert_same(recv, tagged_values(left, 5, dtype, salt=rank), "batch_isend_irecv")

    return case


def barrier_case(rank, size):
    for _ in range(3):
        dist.barrier()
    work = dist.barrier(async_op=True)
    work.wait()
    assert work.is_completed()


def object_collectives_case(rank, size):
    mine = {"rank": rank, "payload": list(range(rank + 1)), "text": "x" * (rank * 100)}
    gathered = [None] * size
    dist.all_gather_object(gathered, mine)
    assert [g["rank"] for g in gathered] == list(range(size)) and gathered[-1]["payload"] == list(range(size))

    objects = [{"step": 3, "lr": 0.1}, "hello"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objects, src=0)
    assert objects == [{"step": 3, "lr": 0.1}, "hello"], objects

    at_root = [None] * size if rank == size - 1 else None
    dist.gather_object(("r", rank), at_root, dst=size - 1)
    if rank == size - 1:
        assert at_root == [("r", r) for r in range(size)], at_root

    out = [None]
    dist.scatter_object_list(out, [f"to {r}" for r in range(size)] if rank == 0 else None, src=0)
    assert out == [f"to {rank}"], out

    if rank == 0:
        dist.send_object_list([{"a": 1}, [2, 3]], dst=1)
    elif rank == 1:
        received = [None, None]
        dist.recv_object_list(received, src=0)
        assert received == [{"a": 1}, [2, 3]], received
    dist.barrier()


def coalesced_case(dtype_name: str, device="cpu", ops=("SUM",)):
    """The coalesced forms: the group's allgather_into_tensor_coalesced and
    reduce_scatter_tensor_coalesced, the same through torch's _coalescing_manager (which FSDP uses),
    and all_gather_coalesced."""
    dtype = DTYPES[dtype_name]

    def case(rank, size):
        group = dist.distributed_c10d._get_default_group()
        sizes = (1, 4)
        inputs = [tagged_values(rank, n, dtype, device=device) for n in sizes]
        expected_gathers = [torch.cat([tagged_values(r, n, dtype) for r in range(size)]) for n in sizes]
        outputs = [torch.empty(size * n, dtype=dtype, device=device) for n in sizes]
        group.allgather_into_tensor_coalesced(outputs, inputs).wait()
        for out, expected in zip(outputs, expected_gathers):
            assert_same(out, expected, "allgather_into_tensor_coalesced")
        outputs = [torch.empty(size * n, dtype=dtype, device=device) for n in sizes]
        with dist._coalescing_manager(async_ops=True) as manager:
            for out, mine in zip(outputs, inputs):
                dist.all_gather_into_tensor(out, mine, async_op=True)
        manager.wait()
        for out, expected in zip(outputs, expected_gathers):
            assert_same(out, expected, "all_gather_into_tensor under _coalescing_manager")
        # With a device, torch ends the window with endCoalescing, which has no transfers to start:
        # what it returns must be the window's last op (all_reduce_coalesced here), or wait() would
        # return before the sums are in.
        sums = [small_values(rank + i, (n,), dtype, device) for i, n in enumerate(sizes)]
        with dist._coalescing_manager(device=torch.device(device), async_ops=True) as manager:
            for tensor in sums:
                dist.all_reduce(tensor, async_op=True)
        manager.wait()
        for i, (n, tensor) in enumerate(zip(sizes, sums)):
            expected = reference_reduce([small_values(r + i, (n,), dtype) for r in range(size)], "SUM")
            assert_same(tensor, expected, "all_reduce under _coalescing_manager(device=...)")

        for op in ops:
            blocks = (2, 3)
            whole = [small_values(rank + i, (size * n,), dtype, device) for i, n in enumerate(blocks)]
            words = refusal(op, dtype_name, device)
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = reduce_op(op)
            if words:
                parts = [torch.empty(n, dtype=dtype, device=device) for n in blocks]
                expect_value_error(
                    lambda: group.reduce_scatter_tensor_coalesced(parts, whole, opts).wait(),
                    "reduce_scatter_tensor_coalesced",
                    *words,
                )
                continue
            expected = [
                reference_reduce([small_values(r + i, (size * n,), dtype) for r in range(size)], op)[
                    rank * n : (rank + 1) * n
                ]
                for i, n in enumerate(blocks)
            ]
            parts = [torch.empty(n, dtype=dtype, device=device) for n in blocks]
            group.reduce_scatter_tensor_coalesced(parts, whole, opts).wait()
            for part, reference in zip(parts, expected):
                assert_same(part, reference, f"reduce_scatter_tensor_coalesced {op}")
            parts = [torch.empty(n, dtype=dtype, device=device) for n in blocks]
            with dist._coalescing_manager(async_ops=True) as manager:
                for part, source in zip(parts, whole):
                    dist.reduce_scatter_tensor(part, source, op=reduce_op(op), async_op=True)
            manager.wait()
            for part, reference in zip(parts, expected):
                assert_same(part, reference, f"reduce_scatter_tensor {op} under _coalescing_manager")

        lists = [
            [torch.empty(2, dtype=dtype, device=device), torch.empty(3, dtype=dtype, device=device)]
            for _ in range(size)
        ]
        dist.all_gather_coalesced(
            lists, [tagged_values(rank, 2, dtype, device=device), tagged_values(rank, 3, dtype, salt=1, device=device)]
        )
        for r in range(size):
            assert_same(lists[r][0], tagged_values(r, 2, dtype), "all_gather_coalesced")
            assert_same(lists[r][1], tagged_values(r, 3, dtype, salt=1), "all_gather_coalesced")

    return case


def bad_input_case(rank, size):
    """Each bad call raises ValueError on the calling rank, names the op and argument, and queues nothing."""
    expect_value_error(lambda: dist.all_reduce(torch.ones(3, 4)[:, ::2]), "all_reduce", "contiguous")  # not dense
    expect_value_error(lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BXOR), "all_reduce", "BXOR")
    expect_value_error(lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=dist.ReduceOp.AVG), "AVG")
    expect_value_error(lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint32)), "all_reduce", "uint32")
    expect_value_error(lambda: dist.broadcast(torch.ones(3), src=size), "broadcast", "src")
    expect_value_error(lambda: dist.reduce(torch.ones(3), dst=size + 3), "reduce", "dst")
    expect_value_error(lambda: dist.send(torch.ones(3), dst=size), "send", "dst")
    expect_value_error(
        lambda: dist.all_gather([torch.ones(3)] * (size + 1), torch.ones(3)), "all_gather", "tensor_list"
    )
    expect_value_error(lambda: dist.all_gather([torch.ones(2)] * size, torch.ones(3)), "all_gather", "elements")
    # Mixed dtypes: torch's own check answers before the backend is reached.
    expect_value_error(lambda: dist.all_gather([torch.ones(3, dtype=torch.int64)] * size, torch.ones(3)), "dtype")
    expect_value_error(
        lambda: dist.all_gather_into_tensor(torch.empty(size * 3 + 1), torch.ones(3)), "all_gather_into_tensor"
    )
    expect_value_error(
        lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(size * 2 + 1)), "reduce_scatter_tensor", "input"
    )
    expect_value_error(
        lambda: dist.all_to_all_single(torch.empty(size), torch.ones(size), None, [size + 1] + [0] * (size - 1)),
        "all_to_all_single",
        "split",
    )
    expect_value_error(lambda: dist.recv(torch.ones(1), src=0, tag=-4), "recv", "tag")
    expect_value_error(lambda: dist.all_reduce_coalesced([torch.ones(2), torch.ones(2, dtype=torch.float64)]), "dtype")
    # Nothing was queued: the group still works, on every rank, in step.
    check = torch.ones(2)
    dist.all_reduce(check)
    assert_same(check, torch.full((2,), float(size)), "all_reduce after rejected calls")


def _build_cases() -> dict:
    cases = {}
    for dtype_name in DTYPES:
        for op in REDUCE_OPS:
            cases[f"all_reduce[{dtype_name}-{op}]"] = all_reduce_case(dtype_name, op)
    for dtype_name in DTYPES:
        for label, factory in [
            ("all_reduce_coalesced", all_reduce_coalesced_case),
            ("broadcast", broadcast_case),
            ("reduce", reduce_case),
            ("all_gather", all_gather_case),
            ("all_gather_into_tensor", all_gather_into_tensor_case),
            ("gather", gather_case),
            ("scatter", scatter_case),
            ("reduce_scatter", reduce_scatter_case),
            ("reduce_scatter_tensor", reduce_scatter_tensor_case),
            ("all_to_all", all_to_all_case),
            ("all_to_all_single", all_to_all_single_case),
            ("send_recv", send_recv_case),
        ]:
            cases[f"{label}[{dtype_name}]"] = factory(dtype_name)
    cases["all_reduce_async"] = all_reduce_async_case()
    cases["callback_issues_collective"] = callback_issues_collective_case
    cases["waited_work_with_waiting_callback"] = waited_work_with_waiting_callback_case
    cases["wait_with_timeout"] = wait_with_timeout_case
    cases["callback_waits_for_point_to_point"] = callback_waits_for_point_to_point_case
    cases["tags"] = tags_case
    cases["recv_any_source"] = recv_any_source_case
    cases["batch_isend_irecv"] = batch_isend_irecv_case
    cases["abandoned_batch"] = abandoned_batch_case
    cases["barrier"] = barrier_case
    cases["object_collectives"] = object_collectives_case
    cases["coalesced_tensor_ops"] = coalesced_case("float32")
    cases["bad_input"] = bad_input_case
    return cases


CASES = _build_cases()


def device_collective_cases(device: str, dtype_names, ops=tuple(REDUCE_OPS)) -> dict:
    """Every collective (no point to point) on `device` for `dtype_names`, each reduction with every
    op in `ops` (the refused combinations checked for their ValueError)."""
    cases = {}
    for dtype_name in dtype_names:
        for op in ops:
            cases[f"all_reduce[{dtype_name}-{op}]"] = all_reduce_case(dtype_name, op, device)
    for dtype_name in dtype_names:
        for label, factory in [
            ("all_reduce_coalesced", all_reduce_coalesced_case),
            ("broadcast", broadcast_case),
            ("all_gather", all_gather_case),
            ("all_gather_into_tensor", all_gather_into_tensor_case),
            ("gather", gather_case),
            ("scatter", scatter_case),
            ("all_to_all", all_to_all_case),
            ("all_to_all_single", all_to_all_single_case),
        ]:
            cases[f"{label}[{dtype_name}]"] = factory(dtype_name, device)
        for label, factory in [
            ("reduce", reduce_case),
            ("reduce_scatter", reduce_scatter_case),
            ("reduce_scatter_tensor", reduce_scatter_tensor_case),
            ("coalesced", coalesced_case),
        ]:
            cases[f"{label}[{dtype_name}]"] = factory(dtype_name, device, ops=ops)
    cases["all_reduce_async"] = all_reduce_async_case(device)
    cases["barrier"] = barrier_case
    return cases


def device_point_to_point_cases(device: str, dtype_names) -> dict:
    """Point to point on `device`, in orders that need no reordering by the transport."""
    cases = {}
    for dtype_name in dtype_names:
        cases[f"send_recv[{dtype_name}]"] = directed_send_recv_case(dtype_name, device)
        cases[f"batch_isend_irecv[{dtype_name}]"] = receive_first_batch_isend_irecv_case(dtype_name, device)
    return cases


def run_cases(names=None, cases=None, trace=False) -> dict:
    """Run the named cases of `cases` (default: every one of CASES) on this rank; returns {name: None
    or the failure's traceback}. `trace` prints each case's name to stderr before it runs, so a run
    that hangs shows where (the harness then kills the ranks and their results are lost)."""
    import sys

    cases = CASES if cases is None else cases
    rank, size = dist.get_rank(), dist.get_world_size()
    outcome = {}
    for name in names or cases:
        if trace:
            print(f"[rank {rank}] {name}", file=sys.stderr, flush=True)
        try:
            cases[name](rank, size)
            outcome[name] = None
        except Exception:  # noqa: BLE001  each case's failure is reported on its own
            outcome[name] = traceback.format_exc()
    import torch_chainermn

    outcome["__transport__"] = (torch_chainermn.transport(), torch_chainermn._backend.backend_of().shared_memory)
    return outcome
