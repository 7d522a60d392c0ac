"""Every allreduce strategy x dtype x size x reduce op, checked against a locally computed reference.

One process group per strategy is made in the same processes (`new_group(..., pg_options=Options(...))`),
so one launch per topology covers them all. Case names do not depend on the topology.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

import torch_chainermn
from tests.support.collective_cases import assert_same, expect_value_error, reference_reduce, small_values

STRATEGIES = ["naive", "flat", "hierarchical", "two_dimensional", "single_node"]
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
SIZES = [0, 1, 7, (1 << 18) + 3]  # the last is over one shared-memory chunk (1 MiB) in every dtype but 16-bit


def check_strategy(group, rank, size, dtype_name):
    dtype = DTYPES[dtype_name]
    ops = ["SUM", "MAX"] + (["AVG"] if dtype.is_floating_point else [])
    for n in SIZES:
        for op in ops:
            tensor = small_values(rank, (n,), dtype)
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)
            expected = reference_reduce([small_values(r, (n,), dtype) for r in range(size)], op)
            assert_same(tensor, expected, f"all_reduce {op} of {n} {dtype_name}")
    # Many tensors at once: packed into one buffer (naive reduces them one by one).
    tensors = [small_values(rank + i, (n,), dtype) for i, n in enumerate(SIZES)]
    dist.all_reduce_coalesced(tensors, group=group)
    for i, (n, tensor) in enumerate(zip(SIZES, tensors)):
        expected = reference_reduce([small_values(r + i, (n,), dtype) for r in range(size)], "SUM")
        assert_same(tensor, expected, f"all_reduce_coalesced block {i}")


def buffers_stop_growing(group, rank, size):
    backend = torch_chainermn._backend.backend_of(group)
    tensors = [torch.ones(n) for n in (1000, 77, 5000)]
    dist.all_reduce_coalesced(tensors, group=group)
    dist.all_reduce(torch.ones(12345), group=group)
    warmed = backend.scratch_bytes()
    for _ in range(3):
        dist.all_reduce_coalesced([torch.ones(n) for n in (1000, 77, 5000)], group=group)
        dist.all_reduce(torch.ones(12345), group=group)
    assert backend.scratch_bytes() == warmed, (warmed, backend.scratch_bytes())


def ranks_of_one_node(topology) -> list[int]:
    """The ranks of the first node that holds two or more (the whole world when it is one node)."""
    return next(list(ranks) for ranks in topology.ranks_of_node if len(ranks) > 1)


def run_strategy_cases() -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    topology = torch_chainermn.topology()
    outcome = {"__topology__": (topology.intra_size, topology.inter_size), "__transport__": torch_chainermn.transport()}
    node_ranks = ranks_of_one_node(topology)
    outcome["__single_node_ranks__"] = node_ranks
    for name in STRATEGIES:
        # single_node on several nodes is refused at creation (test_single_node_refuses_several_nodes):
        # it runs on the ranks of one node, the others only taking part in new_group.
        ranks = node_ranks if name == "single_node" else list(range(size))
        group = dist.new_group(ranks, backend="chainermn", pg_options=torch_chainermn.Options(communicator=name))
        cases = [f"{name}-{dtype_name}" for dtype_name in DTYPES] + [f"{name}-buffers"]
        if rank not in ranks:
            outcome.update({case: None for case in cases})
            continue
        assert torch_chainermn.get_options(group).communicator == name
        group_rank, group_size = dist.get_rank(group), len(ranks)
        for dtype_name in DTYPES:
            case = f"{name}-{dtype_name}"
            try:
                check_strategy(group, group_rank, group_size, dtype_name)
                outcome[case] = None
            except Exception:  # noqa: BLE001
                outcome[case] = traceback.format_exc()
        try:
            buffers_stop_growing(group, group_rank, group_size)
            outcome[f"{name}-buffers"] = None
        except Exception:  # noqa: BLE001
            outcome[f"{name}-buffers"] = traceback.format_exc()
    # pure_nccl is for CUDA tensors: a CPU tensor is refused on the calling rank, naming it.
    group = dist.new_group(
        list(range(size)), backend="chainermn", pg_options=torch_chainermn.Options(communicator="pure_nccl")
    )
    try:
        expect_value_error(lambda: dist.all_reduce(torch.ones(3), group=group), "pure_nccl", "CUDA")
        outcome["pure_nccl-refuses-cpu"] = None
    except Exception:  # noqa: BLE001
        outcome["pure_nccl-refuses-cpu"] = traceback.format_exc()
    return outcome


def case_names() -> list[str]:
    names = [f"{s}-{d}" for s in STRATEGIES for d in DTYPES] + [f"{s}-buffers" for s in STRATEGIES]
    return names + ["pure_nccl-refuses-cpu"]
