"""The ChainerMN communicator object: arrays and objects point to point and collectively, model
gradients and parameters, split and finalize. Each run packs many checks, as processes are costly."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_chainermn
from torch_chainermn.communicator import Communicator, create_communicator
from tests.support.harness import REPO, launcher_free_environment, run_mpiexec, run_spawn

TORCH_DTYPES = [torch.int32, torch.int64, torch.float32, torch.float64]
EXTRA_DTYPES = [torch.float16, torch.bfloat16, torch.bool, torch.uint8, torch.complex64]
NUMPY_DTYPES = [np.int32, np.int64, np.float32, np.float64, np.float16, np.bool_, np.dtype(">i4")]


# ---- exact, rank-tagged inputs --------------------------------------------------------------------


def tensor_of(rank, shape, dtype, salt=0):
    """Small integers that tell the rank and position apart, exact in every dtype."""
    n = int(np.prod(shape, dtype=np.int64))
    base = (torch.arange(n, dtype=torch.int64) * 7 + rank * 31 + salt * 5) % 61
    if dtype == torch.bool:
        return (base % 2 == 1).reshape(shape)
    return base.to(dtype).reshape(shape)


def array_of(rank, shape, dtype, salt=0):
    return tensor_of(rank, shape, torch.int64, salt).numpy().astype(dtype)


def non_contiguous(rank, dtype, salt=0):
    """A 4-D transposed view: data that is not laid out in order."""
    whole = tensor_of(rank, (3, 2, 4, 5), dtype, salt)
    view = whole.transpose(1, 3)
    assert not view.is_contiguous()
    return view


def assert_same(actual, expected, what):
    assert type(actual) is type(expected), f"{what}: got {type(actual).__name__}, want {type(expected).__name__}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {actual.shape} != {expected.shape}"
    if isinstance(actual, torch.Tensor):
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"
    else:
        assert np.array_equal(actual, expected), f"{what}: {actual} != {expected}"


def cases_of_arrays(rank, salt=0):
    """(name, array) for every rank, the same list on every rank but with rank-specific values."""
    cases = []
    for dtype in TORCH_DTYPES + EXTRA_DTYPES:
        cases.append((f"torch {dtype} 0-d", tensor_of(rank, (), dtype, salt)))
        cases.append((f"torch {dtype} 4-D", tensor_of(rank, (2, 3, 1, 4), dtype, salt)))
    for dtype in TORCH_DTYPES:
        cases.append((f"torch {dtype} non-contiguous", non_contiguous(rank, dtype, salt)))
    for dtype in NUMPY_DTYPES:
        cases.append((f"numpy {dtype} 0-d", array_of(rank, (), dtype, salt)))
        cases.append((f"numpy {dtype} 4-D", array_of(rank, (2, 3, 1, 4), dtype, salt)))
    cases.append(("numpy non-contiguous", array_of(rank, (3, 2, 4, 5), np.float64, salt).transpose(3, 1, 0, 2)))
    cases.append(("torch empty", tensor_of(rank, (0, 3), torch.float32, salt)))
    return cases


def contiguous_copy(array):
    return array.contiguous() if isinstance(array, torch.Tensor) else np.array(array, order="C", copy=True)


# ---- the cases ------------------------------------------------------------------------------------


def check_identity(comm, ranks_per_node):
    rank, size = dist.get_rank(), dist.get_world_size()
    assert (comm.rank, comm.size) == (rank, size)
    assert comm.intra_rank == rank % ranks_per_node
    assert comm.inter_rank == rank // ranks_per_node
    assert comm.inter_size == -(-size // ranks_per_node)
    assert comm.intra_size == min(ranks_per_node, size - comm.inter_rank * ranks_per_node)
    assert torch_chainermn._backend.group_of(comm, "test") is comm.group
    assert dist.get_backend(comm.group) == "chainermn"


def check_point_to_point(comm):
    """Rank 0 sends every case to each rank, which sends it back changed; both check exactly."""
    rank, size = comm.rank, comm.size
    for peer in range(1, size):
        for tag, (name, mine) in enumerate(cases_of_arrays(0)):
            if rank == 0:
                comm.send(mine, peer, tag=tag)
                assert_same(
                    comm.recv(peer, tag=tag),
                    contiguous_copy(cases_of_arrays(peer, salt=1)[tag][1]),
                    f"recv {name} from {peer}",
                )
            elif rank == peer:
                assert_same(comm.recv(0, tag=tag), contiguous_copy(mine), f"recv {name}")
                comm.send(cases_of_arrays(rank, salt=1)[tag][1], 0, tag=tag)
    # A tuple of arrays (ChainerMN's send takes one) comes back as a tuple of both kinds.
    if rank == 0:
        comm.send((torch.arange(3), np.arange(4.0)), size - 1, tag=9)
    elif rank == size - 1:
        received = comm.recv(0, tag=9)
        assert isinstance(received, tuple) and len(received) == 2
        assert_same(received[0], torch.arange(3), "tuple[0]")
        assert_same(received[1], np.arange(4.0), "tuple[1]")
    # requires_grad survives; the data is a copy, not a view of anything on the sender.
    if rank == 0:
        comm.send(torch.ones(2, requires_grad=True), 1)
    elif rank == 1:
        assert comm.recv(0).requires_grad


def check_collectives(comm):
    rank, size = comm.rank, comm.size
    names = [name for name, _ in cases_of_arrays(0)]
    everyone = [cases_of_arrays(r) for r in range(size)]
    for i, name in enumerate(names):
        mine = everyone[rank][i][1]
        for root in range(size):
            got = comm.bcast(mine if rank == root else None, root=root)
            assert_same(
                got if rank != root else contiguous_copy(got),
                contiguous_copy(everyone[root][i][1]),
                f"bcast {name} root {root}",
            )
            gathered = comm.gather(mine, root=root)
            if rank == root:
                assert isinstance(gathered, tuple) and len(gathered) == size
                for r in range(size):
                    assert_same(gathered[r], contiguous_copy(everyone[r][i][1]), f"gather {name} from {r}")
            else:
                assert gathered is None
        for r, got in enumerate(comm.allgather(mine)):
            assert_same(got, contiguous_copy(everyone[r][i][1]), f"allgather {name} from {r}")
    # allreduce: exact sums in every reducible dtype; the input is left alone.
    for dtype in TORCH_DTYPES:
        for shape in [(), (2, 3, 1, 4)]:
            mine = tensor_of(rank, shape, dtype)
            before = mine.clone()
            want = sum(tensor_of(r, shape, torch.int64) for r in range(size)).to(dtype)
            assert_same(comm.allreduce(mine), want, f"allreduce {dtype} {shape}")
            assert torch.equal(mine, before)
        view = non_contiguous(rank, dtype)
        assert_same(
            comm.allreduce(view),
            sum(non_contiguous(r, torch.int64) for r in range(size)).to(dtype),
            f"allreduce non-contiguous {dtype}",
        )
    for dtype in [np.int32, np.int64, np.float32, np.float64]:
        for shape in [(), (2, 3, 1, 4)]:
            want = sum(array_of(r, shape, np.int64) for r in range(size)).astype(dtype)
            assert_same(comm.allreduce(array_of(rank, shape, dtype)), np.asarray(want), f"allreduce numpy {dtype}")
    # Shapes may differ across ranks for gather/allgather/scatter/alltoall (not dtypes).
    ragged = tensor_of(rank, (rank + 1, 2), torch.int32)
    for r, got in enumerate(comm.allgather(ragged)):
        assert_same(got, tensor_of(r, (r + 1, 2), torch.int32), f"ragged allgather {r}")
    for root in range(size):
        pieces = [array_of(root * 10 + r, (r + 2,), np.float32) for r in range(size)] if rank == root else None
        assert_same(
            comm.scatter(pieces, root=root), array_of(root * 10 + rank, (rank + 2,), np.float32), f"scatter root {root}"
        )
        rows = tensor_of(root, (size, 2, 3), torch.float64) if rank == root else None
        assert_same(
            comm.scatter(rows, root=root),
            tensor_of(root, (size, 2, 3), torch.float64)[rank],
            f"scatter rows root {root}",
        )
    for dtype in [torch.int64, torch.float32]:
        xs = [tensor_of(rank * 10 + dest, (dest + 1, 2), dtype).t() for dest in range(size)]
        received = comm.alltoall(xs)
        assert isinstance(received, tuple) and len(received) == size
        for source, got in enumerate(received):
            assert_same(
                got,
                tensor_of(source * 10 + rank, (rank + 1, 2), dtype).t().contiguous(),
                f"alltoall {dtype} from {source}",
            )
    received = comm.alltoall([np.full((3,), rank * 10 + dest, np.int64) for dest in range(size)])
    for source, got in enumerate(received):
        assert_same(got, np.full((3,), source * 10 + rank, np.int64), f"alltoall numpy from {source}")


class Point:
    """A user class: objects of it must survive pickling with their arrays inside."""

    def __init__(self, label, values):
        self.label, self.values = label, values


def rich_object(rank):
    return {
        "rank": rank,
        "name": f"rank-{rank}",
        "nested": [(rank, 2.5), {"x": None}],
        "tensor": tensor_of(rank, (5, 3), torch.float64).t(),
        "half": tensor_of(rank, (4,), torch.bfloat16),
        "array": array_of(rank, (2, 2), np.int32),
        "object_array": np.array([rank, "x"], dtype=object),
        "point": Point(rank, np.arange(rank + 1)),
        "parameter": torch.nn.Parameter(torch.ones(2) * rank),
        "bytes": bytes(range(rank, rank + 50)),
    }


def check_rich(actual, rank):
    want = rich_object(rank)
    assert actual["rank"] == rank and actual["name"] == want["name"] and actual["nested"] == want["nested"]
    assert_same(actual["tensor"], want["tensor"].contiguous(), "object tensor")
    assert_same(actual["half"], want["half"], "object bfloat16")
    assert_same(actual["array"], want["array"], "object array")
    assert list(actual["object_array"]) == list(want["object_array"])
    assert actual["point"].label == rank and np.array_equal(actual["point"].values, np.arange(rank + 1))
    assert isinstance(actual["parameter"], torch.nn.Parameter) and torch.equal(actual["parameter"], want["parameter"])
    assert actual["bytes"] == want["bytes"]


def check_objects(comm):
    rank, size = comm.rank, comm.size
    if rank == 0:
        for peer in range(1, size):
            comm.send_obj(rich_object(0), peer, tag=3)
            check_rich(comm.recv_obj(peer, tag=4), peer)
    else:
        check_rich(comm.recv_obj(0, tag=3), 0)
        comm.send_obj(rich_object(rank), 0, tag=4)
    for root in range(size):
        check_rich(comm.bcast_obj(rich_object(rank) if rank == root else None, root=root), root)
        gathered = comm.gather_obj(rich_object(rank), root=root)
        if rank == root:
            assert len(gathered) == size
            for r in range(size):
                check_rich(gathered[r], r)
        else:
            assert gathered is None
    # Chunked: small max_buf_len splits the pickle and the raw arrays (not on element boundaries).
    big = {"blob": bytes(range(256)) * 40, "tensor": torch.arange(2500, dtype=torch.float32) + rank}
    for root in range(size):
        got = comm.bcast_obj(big if rank == root else None, max_buf_len=1001, root=root)
        assert got["blob"] == big["blob"] and torch.equal(got["tensor"], torch.arange(2500.0) + root)
    gathered = comm.gather_obj(big, root=size - 1, max_buf_len=777)
    if rank == size - 1:
        assert [torch.equal(g["tensor"], torch.arange(2500.0) + r) for r, g in enumerate(gathered)] == [True] * size
    assert comm.allreduce_obj(rank + 1) == size * (size + 1) // 2
    total = comm.allreduce_obj(np.arange(4.0) * (rank + 1))
    assert np.array_equal(total, np.arange(4.0) * (size * (size + 1) // 2))
    assert comm.allreduce_obj([rank]) == list(range(size))  # Python +, in rank order
    assert comm.allreduce_obj(0.1 * (rank + 1), max_buf_len=3) == sum(0.1 * (r + 1) for r in range(size))
    # Failures reach every rank instead of leaving them waiting.
    with pytest.raises(Exception, match="pickle|lambda|could not take part"):
        comm.bcast_obj((lambda: 0) if rank == 0 else None, root=0)
    with pytest.raises((TypeError, RuntimeError)):
        comm.allreduce_obj("text" if rank == 0 else 1)
    with pytest.raises(Exception, match="pickle|could not take part"):  # a non-root that cannot send
        comm.allreduce_obj((lambda: 0) if rank == size - 1 else 1)
    assert comm.allreduce_obj(1) == size


def expect_value_error(fn, *words):
    with pytest.raises(ValueError) as info:
        fn()
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


def check_errors(comm):
    rank, size = comm.rank, comm.size
    # Local mistakes raise before anything is sent.
    expect_value_error(lambda: comm.send(torch.ones(1), size), "send", "dest")
    expect_value_error(lambda: comm.send(torch.ones(1), rank), "send", "dest")
    expect_value_error(lambda: comm.send([1, 2], (rank + 1) % size), "send", "data[0]")
    expect_value_error(lambda: comm.send(torch.ones(1), (rank + 1) % size, tag=-1), "send", "tag")
    expect_value_error(lambda: comm.recv(-1), "recv", "source")
    expect_value_error(lambda: comm.send_obj(1, "1"), "send_obj", "dest")
    expect_value_error(lambda: comm.bcast(torch.ones(1), root=size), "bcast", "root")
    expect_value_error(lambda: comm.bcast_obj(1, max_buf_len=0), "bcast_obj", "max_buf_len")
    expect_value_error(lambda: comm.gather_obj(1, root=-1), "gather_obj", "root")
    expect_value_error(lambda: comm.multi_node_mean_grad("model"), "multi_node_mean_grad", "model")
    expect_value_error(lambda: comm.split("red", 0), "split", "color")
    expect_value_error(lambda: create_communicator("fastest"), "create_communicator", "fastest")
    expect_value_error(
        lambda: create_communicator(allreduce_grad_dtype=torch.int32), "create_communicator", "allreduce_grad_dtype"
    )
    # A mistake on one rank makes every rank raise the same ValueError (no one is left waiting).
    expect_value_error(lambda: comm.allreduce([1.0] if rank == 1 else torch.ones(1)), "allreduce", "data", "on rank 1")
    expect_value_error(
        lambda: comm.allgather(torch.ones(2, dtype=torch.float64 if rank == 0 else torch.float32)), "allgather", "dtype"
    )
    expect_value_error(lambda: comm.allreduce(torch.ones(rank + 1)), "allreduce", "shape")
    expect_value_error(lambda: comm.gather(np.ones(2) if rank == 0 else torch.ones(2)), "gather", "kind")
    expect_value_error(lambda: comm.bcast("data" if rank == 0 else None), "bcast", "data")
    expect_value_error(lambda: comm.scatter([torch.ones(1)] * (size + 1) if rank == 0 else None), "scatter", "xs")
    expect_value_error(lambda: comm.alltoall([torch.ones(1)] * (size - (rank == 0))), "alltoall", "xs", "on rank 0")
    # ... and the communicator still works afterwards.
    assert comm.allreduce(torch.tensor(1)).item() == size


class ThreeParameters(torch.nn.Module):
    """Parameters registered out of name order, so sorted-name order differs from registration."""

    def __init__(self, dtypes):
        super().__init__()
        self.c = torch.nn.Parameter(torch.zeros(4, dtype=dtypes[2]))
        self.a = torch.nn.Parameter(torch.zeros(3, dtype=dtypes[0]))
        self.b = torch.nn.Parameter(torch.zeros(2, 2, dtype=dtypes[1]))
        self.register_buffer("counter", torch.zeros(2))

    def ordered(self):
        return [self.a, self.b, self.c]


def set_grads(model, rank, present=(True, True, True)):
    for i, (param, has) in enumerate(zip(model.ordered(), present)):
        param.grad = torch.full_like(param, rank + i) if has else None


def check_mean_grad(comm, rank, size, dtypes, tolerance):
    """ChainerMN's test: rank r sets r, r+1, r+2 → everyone gets (S-1)/2 + {0,1,2}."""
    model = ThreeParameters(dtypes)
    mean = (size - 1) / 2
    for _ in range(2):  # twice: the reused buffers give the same result
        set_grads(model, rank)
        comm.multi_node_mean_grad(model)
        for i, param in enumerate(model.ordered()):
            assert param.grad.dtype == param.dtype
            torch.testing.assert_close(
                param.grad.double(), torch.full(param.shape, mean + i, dtype=torch.float64), rtol=0, atol=tolerance
            )
    # None gradients are skipped (everywhere) and stay None.
    set_grads(model, rank, present=(True, False, True))
    comm.allreduce_grad(model)
    assert model.b.grad is None
    torch.testing.assert_close(
        model.c.grad.double(), torch.full((4,), mean + 2, dtype=torch.float64), rtol=0, atol=tolerance
    )
    # zero_fill: odd ranks have no gradients; they take part as zeros and end with the mean.
    set_grads(model, rank, present=(rank % 2 == 0,) * 3)
    comm.multi_node_mean_grad(model, zero_fill=True)
    evens = [r for r in range(size) if r % 2 == 0]
    for i, param in enumerate(model.ordered()):
        want = sum(r + i for r in evens) / size
        torch.testing.assert_close(
            param.grad.double(), torch.full(param.shape, want, dtype=torch.float64), rtol=0, atol=tolerance
        )


def check_models(comm):
    rank, size = comm.rank, comm.size
    f16, f32, f64 = torch.float16, torch.float32, torch.float64
    for wire, tolerance in [
        (None, 1e-6),
        (torch.float16, 2e-2),
        (torch.bfloat16, 5e-2),
        (torch.float32, 1e-3),
        (torch.float64, 1e-3),
    ]:
        wire_comm = create_communicator("hierarchical", allreduce_grad_dtype=wire)
        assert wire_comm.allreduce_grad_dtype == wire and wire_comm.communicator_name == "hierarchical"
        for dtypes in [(f16,) * 3, (f32,) * 3, (f64,) * 3, (f16, f32, f16)]:
            check_mean_grad(wire_comm, rank, size, dtypes, max(tolerance, 2e-2 if f16 in dtypes else 0))
        wire_comm.finalize()
    # numpy's dtype spelling, as ChainerMN users write it.
    np_comm = create_communicator("naive", allreduce_grad_dtype=np.float16)
    assert np_comm.allreduce_grad_dtype == torch.float16 and np_comm.communicator_name == "naive"
    np_comm.finalize()

    # bcast_data: parameters (all dtypes) become rank 0's; buffers are left alone.
    model = ThreeParameters((f16, f32, f64))
    with torch.no_grad():
        for i, param in enumerate(model.ordered()):
            param.copy_(torch.arange(param.numel()).reshape(param.shape) * (rank + 1) + i)
        model.counter.fill_(rank)
    comm.bcast_data(model)
    for i, param in enumerate(model.ordered()):
        assert torch.equal(param.detach(), (torch.arange(param.numel()).reshape(param.shape) + i).to(param.dtype))
    assert torch.equal(model.counter, torch.full((2,), float(rank)))


def check_split(comm):
    rank, size = comm.rank, comm.size
    # Reverse the order inside each colour: ranks follow the key, not the parent's order.
    sub = comm.split(rank % 2, -rank)
    members = sorted((r for r in range(size) if r % 2 == rank % 2), reverse=True)
    assert sub.size == len(members) and sub.rank == members.index(rank)
    assert sub.communicator_name == comm.communicator_name
    assert [t.item() for t in sub.allgather(torch.tensor(rank))] == members
    assert sub.allreduce(torch.tensor(rank)).item() == sum(members)
    if sub.size > 1:  # objects follow the new ranks too
        peer = 1 - sub.rank
        if sub.rank == 0:
            sub.send_obj(("from", rank), peer)
        else:
            assert sub.recv_obj(peer) == ("from", members[peer])
    # Split of a split: only its members take part (the other colour is busy elsewhere).
    if sub.size > 1:
        inner = sub.split(0, sub.rank)
        assert inner.size == sub.size and inner.allreduce(np.ones(1))[0] == sub.size
        inner.finalize()
    # color=None: this rank joins nothing.
    lonely = comm.split(None if rank == 0 else 1, rank)
    if rank == 0:
        assert lonely is None
    else:
        assert lonely.size == size - 1 and lonely.rank == rank - 1
        lonely.finalize()
    sub.finalize()
    sub.finalize()  # idempotent


def communicator_cases(ranks_per_node):
    initialised_by_us = not dist.is_initialized()
    comm = create_communicator("flat")
    if initialised_by_us:
        # create_communicator made the default group itself, with its options, and uses it.
        assert comm.group is dist.distributed_c10d._get_default_group()
        assert dist.get_backend() == "chainermn"
    else:
        assert comm.group is not dist.distributed_c10d._get_default_group()
    assert comm.communicator_name == "flat" and comm.allreduce_grad_dtype is None
    check_identity(comm, ranks_per_node)
    check_point_to_point(comm)
    check_collectives(comm)
    check_objects(comm)
    check_errors(comm)
    check_models(comm)
    check_split(comm)
    wrapped = Communicator()  # wraps the default group, owns nothing
    assert wrapped.allreduce(torch.tensor(1.0)).item() == comm.size
    wrapped.finalize()
    comm.finalize()
    comm.finalize()
    assert dist.is_initialized()
    return comm.rank


def test_communicator_over_gloo():
    assert run_spawn(communicator_cases, 3, 2, env={"CHAINERMN_RANKS_PER_NODE": "2"}, timeout=400, op_timeout=120) == [
        0,
        1,
        2,
    ]


@pytest.mark.mpi
def test_communicator_over_mpi_initialises_the_group():
    # init=False: create_communicator itself calls init_process_group, under mpiexec.
    assert run_mpiexec(
        communicator_cases, 2, 1, env={"CHAINERMN_RANKS_PER_NODE": "1"}, init=False, timeout=400, op_timeout=120
    ) == [0, 1]


SINGLE_PROCESS = """
import torch, torch_chainermn
from torch_chainermn.communicator import create_communicator
comm = create_communicator("naive")
assert (comm.rank, comm.size, comm.intra_size, comm.inter_size) == (0, 1, 1, 1)
assert torch.equal(comm.allreduce(torch.arange(3)), torch.arange(3))
assert comm.bcast_obj({"a": 1}) == {"a": 1} and comm.gather_obj(5) == [5]
print("ok")
"""


def test_a_process_nobody_launched_is_a_world_of_one():
    env = launcher_free_environment(drop_prefixes=("OMPI_", "PMI"))
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", SINGLE_PROCESS], env=env, cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
