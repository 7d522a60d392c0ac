"""intra/inter ranks: from host names, simulated nodes, and sub-groups."""

import pytest

import torch_chainermn
from torch_chainermn import _C
from tests.support.harness import run_mpiexec, run_spawn


def test_nodes_are_ordered_by_lowest_rank():
    names = ["b", "a", "b", "a", "c"]
    expected = {  # rank: (inter_rank, intra_rank, intra_size)
        0: (0, 0, 2),
        1: (1, 0, 2),
        2: (0, 1, 2),
        3: (1, 1, 2),
        4: (2, 0, 1),
    }
    for rank, (inter, intra, intra_size) in expected.items():
        t = _C.topology_from_names(names, rank)
        assert (t.inter_rank, t.intra_rank, t.intra_size, t.inter_size) == (inter, intra, intra_size, 3)
    t = _C.topology_from_names(names, 0)
    assert t.ranks_of_node == [[0, 2], [1, 3], [4]]
    assert t.node_of_rank == [0, 1, 0, 1, 2]


def topology_fields():
    t = torch_chainermn.topology()
    return (t.rank, t.size, t.intra_rank, t.intra_size, t.inter_rank, t.inter_size)


def subgroup_topology():
    import torch.distributed as dist

    group = dist.new_group([1, 2, 3])
    if dist.get_rank() == 0:
        return None
    t = torch_chainermn.topology(group)
    return (t.rank, t.intra_rank, t.intra_size, t.inter_rank, t.inter_size)


def test_one_host_is_one_node():
    fields = run_spawn(topology_fields, 3)
    assert fields == [(r, 3, r, 3, 0, 1) for r in range(3)]


def test_ranks_per_node_simulates_nodes():
    fields = run_spawn(topology_fields, 4, env={"CHAINERMN_RANKS_PER_NODE": "2"})
    assert fields == [(r, 4, r % 2, 2, r // 2, 2) for r in range(4)]


def test_hostname_override_groups_ranks_by_name():
    names = {0: "x", 1: "y", 2: "x", 3: "y"}
    fields = run_spawn(topology_fields, 4, rank_env={r: {"CHAINERMN_HOSTNAME": n} for r, n in names.items()})
    # Node x holds ranks 0 and 2, node y ranks 1 and 3.
    assert fields == [(0, 4, 0, 2, 0, 2), (1, 4, 0, 2, 1, 2), (2, 4, 1, 2, 0, 2), (3, 4, 1, 2, 1, 2)]


def test_subgroup_topology_with_unequal_nodes():
    # Global ranks 1 | 2 3 on simulated nodes of two: the group [1, 2, 3] spans a node of one and of two.
    fields = run_spawn(subgroup_topology, 4, env={"CHAINERMN_RANKS_PER_NODE": "2"})
    assert fields[1:] == [(0, 0, 1, 0, 2), (1, 0, 2, 1, 2), (2, 1, 2, 1, 2)]


@pytest.mark.mpi
def test_topology_under_mpiexec():
    fields = run_mpiexec(topology_fields, 4, env={"CHAINERMN_RANKS_PER_NODE": "2"})
    assert fields == [(r, 4, r % 2, 2, r // 2, 2) for r in range(4)]


def test_bad_ranks_per_node_is_refused():
    with pytest.raises(Exception, match="CHAINERMN_RANKS_PER_NODE"):
        run_spawn(topology_fields, 2, env={"CHAINERMN_RANKS_PER_NODE": "zero"})
