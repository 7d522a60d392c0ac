"""Calls the ranks disagree on, and what each rank gets from them.

Every case is one call whose arguments differ on one rank (rank 1, "the odd rank"), or a call only
one rank refuses. `run_battery` runs them one after the other on one group, each followed by a
correct all_reduce, and reports per case: what this rank got (an error's type and text, or "silent"
when the call returned), whether its output was left untouched, and whether the group was still in
step afterwards. Used by tests/test_agreement.py (chainermn) and tools/bad_inputs.py (docs/benchmarks.md's
table, chainermn beside gloo).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

CASES: dict = {}


def case(name: str):
    def register(build):
        CASES[name] = build
        return build

    return register


def odd(rank: int) -> bool:
    return rank == 1


def ones(n, dtype=torch.float32):
    return torch.ones(n, dtype=dtype)


def sized(rank, usual, other, dtype=torch.float32):
    return ones(other if odd(rank) else usual, dtype)


# Each builder returns (call, outputs): the call to make, and the tensors it may write.
def _all_reduce(t, **kw):
    return (lambda g: dist.all_reduce(t, group=g, **kw)), [t]


# ---- sizes ----------------------------------------------------------------------------------------
@case("all_reduce: 10 vs 20 elements")
def _(rank, size):
    return _all_reduce(sized(rank, 10, 20))


@case("all_reduce: 100 vs 600000 elements")
def _(rank, size):
    return _all_reduce(sized(rank, 100, 600000))


@case("all_reduce: 0 vs 5 elements")
def _(rank, size):
    return _all_reduce(sized(rank, 0, 5))


@case("broadcast: 10 vs 20 elements")
def _(rank, size):
    t = sized(rank, 10, 20) * rank
    return (lambda g: dist.broadcast(t, 0, group=g)), [t]


@case("broadcast: 20 vs 10 elements (root bigger)")
def _(rank, size):
    t = sized(rank, 20, 10) * rank
    return (lambda g: dist.broadcast(t, 0, group=g)), [t]


@case("reduce: 10 vs 20 elements")
def _(rank, size):
    t = sized(rank, 10, 20)
    return (lambda g: dist.reduce(t, 0, group=g)), [t]


@case("all_gather: 4 vs 6 elements")
def _(rank, size):
    t = sized(rank, 4, 6)
    outs = [torch.zeros_like(t) for _ in range(size)]
    return (lambda g: dist.all_gather(outs, t, group=g)), outs


@case("all_gather_into_tensor: 4 vs 6 elements")
def _(rank, size):
    t = sized(rank, 4, 6)
    out = torch.zeros(t.numel() * size)
    return (lambda g: dist.all_gather_into_tensor(out, t, group=g)), [out]


@case("reduce_scatter_tensor: 4 vs 6 elements per rank")
def _(rank, size):
    n = 6 if odd(rank) else 4
    out = torch.zeros(n)
    inp = ones(n * size)
    return (lambda g: dist.reduce_scatter_tensor(out, inp, group=g)), [out]


@case("reduce_scatter: 4 vs 6 elements per rank")
def _(rank, size):
    n = 6 if odd(rank) else 4
    out = torch.zeros(n)
    ins = [ones(n) for _ in range(size)]
    return (lambda g: dist.reduce_scatter(out, ins, group=g)), [out]


@case("gather: 4 vs 6 elements")
def _(rank, size):
    t = sized(rank, 4, 6)
    outs = [torch.zeros_like(t) for _ in range(size)] if rank == 0 else None
    return (lambda g: dist.gather(t, outs, dst=0, group=g)), outs or []


@case("scatter: 4 vs 6 elements")
def _(rank, size):
    out = torch.zeros(6 if odd(rank) else 4)
    ins = [ones(4) for _ in range(size)] if rank == 0 else None
    return (lambda g: dist.scatter(out, ins, src=0, group=g)), [out]


@case("all_reduce_coalesced: [10, 10] vs [10, 20]")
def _(rank, size):
    ts = [ones(10), sized(rank, 10, 20)]
    return (lambda g: dist.all_reduce_coalesced(ts, group=g)), ts


@case("all_reduce_coalesced: 2 vs 3 tensors")
def _(rank, size):
    ts = [ones(10) for _ in range(3 if odd(rank) else 2)]
    return (lambda g: dist.all_reduce_coalesced(ts, group=g)), ts


@case("all_reduce_coalesced: [10, 20] vs [20, 10] (same total)")
def _(rank, size):
    ts = [ones(20), ones(10)] if odd(rank) else [ones(10), ones(20)]
    return (lambda g: dist.all_reduce_coalesced(ts, group=g)), ts


@case("all_gather_coalesced: [3, 4] vs [3, 5]")
def _(rank, size):
    ins = [ones(3), sized(rank, 4, 5)]
    outs = [[torch.zeros_like(t) for t in ins] for _ in range(size)]
    flat = [t for lst in outs for t in lst]
    return (lambda g: dist.all_gather_coalesced(outs, ins, group=g)), flat


@case("all_gather_into_tensor_coalesced: 4 vs 6 elements")
def _(rank, size):
    t = sized(rank, 4, 6)
    out = torch.zeros(t.numel() * size)

    def call(g):
        with dist._coalescing_manager(group=g):
            dist.all_gather_into_tensor(out, t, group=g)

    return call, [out]


@case("reduce_scatter_tensor_coalesced: 4 vs 6 elements per rank")
def _(rank, size):
    n = 6 if odd(rank) else 4
    out, inp = torch.zeros(n), ones(n * size)

    def call(g):
        with dist._coalescing_manager(group=g):
            dist.reduce_scatter_tensor(out, inp, group=g)

    return call, [out]


@case("all_to_all_single: even split, 4 vs 6 elements per rank")
def _(rank, size):
    n = 6 if odd(rank) else 4
    out, inp = torch.zeros(n * size), ones(n * size)
    return (lambda g: dist.all_to_all_single(out, inp, group=g)), [out]


@case("all_to_all_single: splits that disagree")
def _(rank, size):
    # Every rank sends 2 to each peer; the odd rank expects 3 from each.
    recv = [3 if odd(rank) else 2] * size
    out, inp = torch.zeros(sum(recv)), ones(2 * size)
    return (lambda g: dist.all_to_all_single(out, inp, recv, [2] * size, group=g)), [out]


@case("all_to_all: tensors that disagree")
def _(rank, size):
    outs = [torch.zeros(3 if odd(rank) else 2) for _ in range(size)]
    ins = [ones(2) for _ in range(size)]
    return (lambda g: dist.all_to_all(outs, ins, group=g)), outs


# ---- dtypes ---------------------------------------------------------------------------------------
def _dtype_case(op_name, build):
    for other in (torch.float64, torch.int32, torch.float16):

        @case(f"{op_name}: float32 vs {str(other).removeprefix('torch.')}")
        def _(rank, size, other=other):
            return build(rank, size, other if odd(rank) else torch.float32)


_dtype_case("all_reduce", lambda rank, size, dt: _all_reduce(ones(8, dt)))


def _broadcast(rank, size, dt):
    t = ones(8, dt) * rank
    return (lambda g: dist.broadcast(t, 0, group=g)), [t]


_dtype_case("broadcast", _broadcast)


def _all_gather_dtype(rank, size, dt):
    t = ones(4, dt)
    outs = [torch.zeros_like(t) for _ in range(size)]
    return (lambda g: dist.all_gather(outs, t, group=g)), outs


_dtype_case("all_gather", _all_gather_dtype)


@case("all_gather_into_tensor: float32 vs float64")
def _(rank, size):
    dt = torch.float64 if odd(rank) else torch.float32
    t, out = ones(4, dt), torch.zeros(4 * size, dtype=dt)
    return (lambda g: dist.all_gather_into_tensor(out, t, group=g)), [out]


@case("reduce: float32 vs float64")
def _(rank, size):
    t = ones(8, torch.float64 if odd(rank) else torch.float32)
    return (lambda g: dist.reduce(t, 0, group=g)), [t]


@case("reduce_scatter_tensor: float32 vs float64")
def _(rank, size):
    dt = torch.float64 if odd(rank) else torch.float32
    out, inp = torch.zeros(4, dtype=dt), ones(4 * size, dt)
    return (lambda g: dist.reduce_scatter_tensor(out, inp, group=g)), [out]


@case("gather: float32 vs float64")
def _(rank, size):
    t = ones(4, torch.float64 if odd(rank) else torch.float32)
    outs = [torch.zeros_like(t) for _ in range(size)] if rank == 0 else None
    return (lambda g: dist.gather(t, outs, dst=0, group=g)), outs or []


@case("scatter: float32 vs float64")
def _(rank, size):
    out = torch.zeros(4, dtype=torch.float64 if odd(rank) else torch.float32)
    ins = [ones(4) for _ in range(size)] if rank == 0 else None
    return (lambda g: dist.scatter(out, ins, src=0, group=g)), [out]


@case("all_to_all_single: float32 vs float64")
def _(rank, size):
    dt = torch.float64 if odd(rank) else torch.float32
    out, inp = torch.zeros(2 * size, dtype=dt), ones(2 * size, dt)
    return (lambda g: dist.all_to_all_single(out, inp, group=g)), [out]


@case("all_reduce_coalesced: float32 vs float64")
def _(rank, size):
    dt = torch.float64 if odd(rank) else torch.float32
    ts = [ones(4, dt), ones(4, dt)]
    return (lambda g: dist.all_reduce_coalesced(ts, group=g)), ts


# ---- roots and reduce ops -------------------------------------------------------------------------
@case("broadcast: src 0 vs 1")
def _(rank, size):
    t = ones(8) * rank
    return (lambda g: dist.broadcast(t, 1 if odd(rank) else 0, group=g)), [t]


@case("reduce: dst 0 vs 1")
def _(rank, size):
    t = ones(8)
    return (lambda g: dist.reduce(t, 1 if odd(rank) else 0, group=g)), [t]


@case("gather: dst 0 vs 1")
def _(rank, size):
    t = ones(4)
    dst = 1 if odd(rank) else 0
    outs = [torch.zeros(4) for _ in range(size)] if rank == dst else None
    return (lambda g: dist.gather(t, outs, dst=dst, group=g)), outs or []


@case("scatter: src 0 vs 1")
def _(rank, size):
    src = 1 if odd(rank) else 0
    out = torch.zeros(4)
    ins = [ones(4) for _ in range(size)] if rank == src else None
    return (lambda g: dist.scatter(out, ins, src=src, group=g)), [out]


for _op_name, _other in (("MAX", dist.ReduceOp.MAX), ("AVG", dist.ReduceOp.AVG), ("PRODUCT", dist.ReduceOp.PRODUCT)):

    @case(f"all_reduce: op SUM vs {_op_name}")
    def _(rank, size, other=_other):
        return _all_reduce(ones(8) * (rank + 2), op=other if odd(rank) else dist.ReduceOp.SUM)


@case("reduce: op SUM vs MAX")
def _(rank, size):
    t = ones(8)
    return (lambda g: dist.reduce(t, 0, op=dist.ReduceOp.MAX if odd(rank) else dist.ReduceOp.SUM, group=g)), [t]


@case("reduce_scatter_tensor: op SUM vs MIN")
def _(rank, size):
    out, inp = torch.zeros(4), ones(4 * size)
    op = dist.ReduceOp.MIN if odd(rank) else dist.ReduceOp.SUM
    return (lambda g: dist.reduce_scatter_tensor(out, inp, op=op, group=g)), [out]


# ---- different collectives ------------------------------------------------------------------------
def _pair(name, usual, other):
    @case(f"{name}")
    def _(rank, size):
        return (other if odd(rank) else usual)(rank, size)


def _bcast8(rank, size):
    t = ones(8) * rank
    return (lambda g: dist.broadcast(t, 0, group=g)), [t]


def _gather8(rank, size):
    t = ones(8)
    outs = [torch.zeros(8) for _ in range(size)]
    return (lambda g: dist.all_gather(outs, t, group=g)), outs


def _reduce_scatter8(rank, size):
    out, inp = torch.zeros(8), ones(8 * size)
    return (lambda g: dist.reduce_scatter_tensor(out, inp, group=g)), [out]


def _barrier(rank, size):
    return (lambda g: dist.barrier(group=g)), []


def _coalesced8(rank, size):
    ts = [ones(8)]
    return (lambda g: dist.all_reduce_coalesced(ts, group=g)), ts


_pair("all_reduce vs broadcast", lambda r, s: _all_reduce(ones(8)), _bcast8)
_pair("all_reduce vs all_gather", lambda r, s: _all_reduce(ones(8)), _gather8)
_pair("all_reduce vs reduce_scatter_tensor", lambda r, s: _all_reduce(ones(8)), _reduce_scatter8)
_pair("all_reduce vs barrier", lambda r, s: _all_reduce(ones(8)), _barrier)
_pair("all_reduce vs all_reduce_coalesced", lambda r, s: _all_reduce(ones(8)), _coalesced8)
_pair("broadcast vs all_gather", _bcast8, _gather8)


# ---- one rank refuses -----------------------------------------------------------------------------
@case("all_reduce: non-contiguous tensor on one rank")
def _(rank, size):
    base = ones((4, 4))
    t = ones((4, 8))[:, ::2] if odd(rank) else base  # not dense (a transposed one would be taken)
    return _all_reduce(t)[0], [base]


@case("broadcast: src out of range on one rank")
def _(rank, size):
    t = ones(8) * rank
    return (lambda g: dist.broadcast(t, size + 3 if odd(rank) else 0, group=g)), [t]


@case("all_reduce: sparse tensor on one rank")
def _(rank, size):
    dense = ones(8)
    t = dense.to_sparse() if odd(rank) else dense
    return (lambda g: dist.all_reduce(t, group=g)), [dense]


@case("all_gather: output list too short on one rank")
def _(rank, size):
    t = ones(4)
    outs = [torch.zeros(4) for _ in range(size - 1 if odd(rank) else size)]
    return (lambda g: dist.all_gather(outs, t, group=g)), outs


@case("all_reduce: bitwise op on floats on one rank")
def _(rank, size):
    t = ones(8)
    return (lambda g: dist.all_reduce(t, op=dist.ReduceOp.BAND if odd(rank) else dist.ReduceOp.SUM, group=g)), [t]


@case("all_gather_into_tensor: output of the wrong size on one rank")
def _(rank, size):
    t = ones(4)
    out = torch.zeros(4 * size + (1 if odd(rank) else 0))
    return (lambda g: dist.all_gather_into_tensor(out, t, group=g)), [out]


# ---- point to point -------------------------------------------------------------------------------
def _p2p(send_n, recv_n, send_dtype=torch.float32, recv_dtype=torch.float32):
    def build(rank, size):
        if rank == 0:
            t = ones(send_n, send_dtype)
            return (lambda g: dist.send(t, group=g, group_dst=1)), []
        if odd(rank):
            t = torch.zeros(recv_n, dtype=recv_dtype)
            return (lambda g: dist.recv(t, group=g, group_src=0)), [t]
        return (lambda g: None), []

    return build


case("recv: 10 elements into a 5-element tensor")(_p2p(10, 5))
case("recv: 5 elements into a 10-element tensor")(_p2p(5, 10))
case("recv: float64 into float32")(_p2p(4, 4, torch.float64, torch.float32))


# ---- what runs them -------------------------------------------------------------------------------
POINT_TO_POINT = {name for name in CASES if name.startswith("recv:")}


def _outcome(call, group, rank) -> str:
    try:
        work = call(group)
        if work is not None and hasattr(work, "wait"):
            work.wait()
        return "silent"
    except Exception as error:  # noqa: BLE001  every error is reported
        return f"{type(error).__name__}: {error}"


def run_battery(names=None, timeout_s: float = 0, fresh_groups: bool = False) -> dict:
    """Every case on this rank: {name: {"got", "untouched", "in_step"}}.

    fresh_groups: each case on a new group (for backends a mismatch leaves unusable); timeout_s: the
    groups' timeout (0: the default group's)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in names or list(CASES):
        group = None
        if fresh_groups or timeout_s:
            group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s or 30))
        call, outputs = CASES[name](rank, size)
        before = [t.clone() for t in outputs]
        got = _outcome(call, group, rank)
        untouched = all(torch.equal(a, b) for a, b in zip(before, outputs))
        probe = torch.ones(3)
        in_step = _outcome(lambda g: dist.all_reduce(probe, group=g), group, rank)
        results[name] = {
            "got": got,
            "untouched": untouched,
            "in_step": in_step == "silent" and probe.tolist() == [float(size)] * 3,
        }
    return results
