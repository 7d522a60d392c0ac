"""The transport plan (csrc/backend/transport_plan.h): which library carries each level of a group,
decided once from its options and topology, in-process and without a GPU."""

import pytest

import torch_chainermn
from torch_chainermn import _C

ONE_NODE = ["a"] * 4
TWO_NODES = ["a", "a", "b", "b"]
ONE_RANK_A_NODE = ["a", "b", "c", "d"]


def plan(names, host="gloo", rank=0, **options):
    return _C.plan_transports(torch_chainermn.Options(**options).to_cpp(), _C.topology_from_names(names, rank), host)


def test_the_cuda_transports_a_user_can_name_are_the_plans_rows():
    assert torch_chainermn.options.CUDA_TRANSPORTS == ("nccl", "nccl_intra", "staged")


@pytest.mark.parametrize(
    "names, asked, expected",
    [(ONE_NODE, True, True), (TWO_NODES, True, True), (ONE_RANK_A_NODE, True, False), (TWO_NODES, False, False)],
)
def test_shared_memory_serves_a_node_of_several_ranks_when_asked(names, asked, expected):
    assert plan(names, shared_memory=asked)["shared_memory"] is expected


@pytest.mark.parametrize("names", [ONE_NODE, TWO_NODES, ONE_RANK_A_NODE])
def test_nccl_is_nccl_on_every_level_and_launches_on_the_callers_thread(names):
    got = plan(names, cuda_transport="nccl")
    assert got["cuda_carriers"] == ("nccl", "nccl", "nccl")
    assert (got["cuda_launch_on_caller"], got["cuda_launch_lock"], got["cuda_bitwise"]) == (True, True, False)


def test_nccl_intra_on_one_node_is_nccl_everywhere():
    got = plan(ONE_NODE, cuda_transport="nccl_intra")
    assert got["cuda_transport"] == "nccl_intra"
    assert got["cuda_carriers"] == ("nccl", "nccl", "nccl")
    assert got["cuda_launch_on_caller"] is True


@pytest.mark.parametrize("names", [TWO_NODES, ONE_RANK_A_NODE])
def test_nccl_intra_across_nodes_stages_between_them_on_the_worker_under_the_launch_lock(names):
    got = plan(names, cuda_transport="nccl_intra")
    assert got["cuda_carriers"] == ("staged", "nccl", "staged")
    assert (got["cuda_launch_on_caller"], got["cuda_launch_lock"], got["cuda_bitwise"]) == (False, True, False)


@pytest.mark.parametrize("names", [ONE_NODE, TWO_NODES])
def test_staged_uses_the_host_library_everywhere_and_reduces_bitwise(names):
    got = plan(names, cuda_transport="staged", host="mpi")
    assert got["host_library"] == "mpi"
    assert got["cuda_carriers"] == ("staged", "staged", "staged")
    assert (got["cuda_launch_on_caller"], got["cuda_launch_lock"], got["cuda_bitwise"]) == (False, False, True)


def test_a_library_other_than_the_one_asked_for_is_refused():
    assert plan(TWO_NODES, host="gloo", transport="gloo")["host_library"] == "gloo"
    with pytest.raises(ValueError, match="Options.transport is 'mpi' but the ranks agreed on 'gloo'"):
        plan(TWO_NODES, host="gloo", transport="mpi")


def test_an_unknown_cuda_transport_is_refused_naming_the_choices():
    options = torch_chainermn.Options().to_cpp()
    options.cuda_transport = "carrier_pigeon"
    with pytest.raises(
        ValueError, match=r"unknown CUDA transport 'carrier_pigeon' \(choose from nccl, nccl_intra, staged\)"
    ):
        _C.plan_transports(options, _C.topology_from_names(ONE_NODE, 0), "gloo")
