"""Sub-groups from new_group and new_subgroups, concurrent groups, and the asynchronous contract."""

import pytest
import torch
import torch.distributed as dist

import torch_chainermn
from tests.support.harness import run_mpiexec, run_spawn


def subgroup_operations():
    rank, size = dist.get_rank(), dist.get_world_size()
    outcome = {}
    evens = dist.new_group([r for r in range(size) if r % 2 == 0])
    if rank % 2 == 0:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=evens)
        outcome["evens_sum"] = t.item()
        outcome["evens_transport"] = torch_chainermn.transport(evens)
        assert dist.get_backend(evens) == "chainermn"
    else:
        assert evens == dist.GroupMember.NON_GROUP_MEMBER

    pair, _ = dist.new_subgroups(group_size=2)
    mine = torch.tensor([rank + 1.0])
    dist.all_reduce(mine, group=pair)
    outcome["pair_sum"] = mine.item()
    # Point to point inside the pair, addressed by group rank.
    peer_group_rank = 1 - dist.get_group_rank(pair, rank)
    got = torch.zeros(1)
    recv = dist.irecv(got, group=pair, group_src=peer_group_rank)
    dist.send(torch.tensor([rank * 10.0]), group=pair, group_dst=peer_group_rank)
    recv.wait()
    outcome["from_pair_peer"] = got.item()

    # Two groups in flight at once: each has its own worker, neither waits for the other.
    a, b = torch.ones(1000), torch.ones(1000) * 2
    work_world = dist.all_reduce(a, async_op=True)
    work_pair = dist.all_reduce(b, group=pair, async_op=True)
    work_pair.wait()
    work_world.wait()
    outcome["concurrent"] = (a[0].item(), b[0].item())
    return outcome


def check_subgroups(outcomes, size):
    for rank, outcome in enumerate(outcomes):
        if rank % 2 == 0:
            assert outcome["evens_sum"] == sum(r for r in range(size) if r % 2 == 0)
        first = rank - rank % 2
        assert outcome["pair_sum"] == (first + 1) + (first + 2)
        assert outcome["from_pair_peer"] == (first + (1 - rank % 2)) * 10
        assert outcome["concurrent"] == (size, 4.0)


def test_subgroups_over_gloo():
    outcomes = run_spawn(subgroup_operations, 4)
    check_subgroups(outcomes, 4)
    assert outcomes[0]["evens_transport"] == "gloo"


@pytest.mark.mpi
def test_subgroups_over_mpi():
    outcomes = run_mpiexec(subgroup_operations, 4)
    check_subgroups(outcomes, 4)
    assert outcomes[0]["evens_transport"] == "mpi"


def async_does_not_block():
    """Rank 1 joins only once rank 0's async all_reduce has returned (told through the store): the call
    must return before its peer comes (else the two wait for each other until the run's deadline), with
    the op still pending."""
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(4)
    if rank == 1:
        store.wait(["rank 0's all_reduce returned"])
        dist.all_reduce(t)
        return None, t.tolist()
    work = dist.all_reduce(t, async_op=True)
    pending_right_after_issue = not work.is_completed()
    store.set("rank 0's all_reduce returned", "1")
    work.wait()
    return pending_right_after_issue, t.tolist()


def test_async_op_returns_before_the_collective_completes():
    outcomes = run_spawn(async_does_not_block, 2)
    assert outcomes[0][0], "rank 0's async all_reduce had completed before rank 1 joined"
    assert outcomes[0][1] == outcomes[1][1] == [2.0] * 4


@pytest.mark.mpi
def test_gloo_transport_can_be_forced_under_mpiexec():
    outcomes = run_mpiexec(torch_chainermn.transport, 2, env={"CHAINERMN_TRANSPORT": "gloo"})
    assert outcomes == ["gloo", "gloo"]


def test_mpi_transport_without_mpiexec_is_an_error():
    with pytest.raises(Exception, match="CHAINERMN_TRANSPORT=mpi"):
        run_spawn(torch_chainermn.transport, 2, env={"CHAINERMN_TRANSPORT": "mpi"})


def init_with(method_template: str):
    """init_process_group with an explicit init_method (tcp:// or file://) instead of env://."""
    import datetime
    import os

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "chainermn", init_method=method_template, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60)
    )
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return dist.get_backend(), t.item()


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_tcp_and_file_init_methods(scheme, tmp_path):
    from tests.support.harness import free_port

    method = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path}/rendezvous"
    outcomes = run_spawn(init_with, 3, method, init=False, env={"MASTER_ADDR": "", "MASTER_PORT": ""})
    assert outcomes == [("chainermn", 6.0)] * 3
