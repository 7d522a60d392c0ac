"""Where this rank sits: which ranks share its node, which node it is on, and its node's group."""

import torch.distributed as dist

from . import _C
from ._backend import backend_of, get_options, group_of

_node_groups = {}  # the parent group's name -> this rank's node group in it


def topology(group=None) -> _C.Topology:
    """The topology of `group` (default: the default group) as seen from this rank.

    Fields: rank, size, intra_rank, intra_size, inter_rank, inter_size, node_of_rank, ranks_of_node.
    Ranks on the same host share a node; set CHAINERMN_RANKS_PER_NODE=k or a per-process
    CHAINERMN_HOSTNAME to simulate several nodes on one machine.
    """
    return backend_of(group, "topology").topology()


def node_group(group=None) -> dist.ProcessGroup:
    """The chainermn group of this rank's node within `group` (default: the default group), with
    `group`'s Options: for one replica per node, e.g. DDP over the node and DiLoCo over the world.

    Collective over `group` the first time (every rank calls it; torch makes one group per node, in
    node order); later calls return the same group.
    """
    parent = group_of(group, "node_group")
    key = parent.group_name
    known = _node_groups.get(key)
    if known is None or known not in dist.distributed_c10d._world.pg_map:  # new, or destroyed since
        topo = topology(parent)
        options = get_options(parent)
        whole_world = parent.size() == dist.get_world_size()
        mine = None
        for node in range(topo.inter_size):
            ranks = [dist.get_global_rank(parent, r) for r in topo.ranks_of_node[node]]
            is_mine = node == topo.node_of_rank[topo.rank]
            if whole_world:  # torch wants every process in new_group, member or not, in the same order
                made = dist.new_group(ranks, backend="chainermn", pg_options=options)
            elif is_mine:
                made = dist.new_group(ranks, backend="chainermn", pg_options=options, use_local_synchronization=True)
            else:
                continue
            if is_mine:
                mine = made
        _node_groups[key] = mine
    return _node_groups[key]
