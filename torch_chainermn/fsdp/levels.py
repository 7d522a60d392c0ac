"""A group seen as nodes: the sub-groups a two-hop collective runs on, made once per group.

For a group of N nodes of M ranks each (every node the same size), `Levels` holds this rank's node
group (its M ranks, by intra rank) and its cross-node group (the N ranks of the other nodes with
this rank's intra rank, by node), and `rank_at[n][l]`, the group rank of node n's l-th rank. A
reduce-scatter is then a full-precision reduce-scatter in the node followed by one between the
nodes; an all-gather the other way round, so only 1/M of the bytes cross the network per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._backend import backend_of, get_options

_made: dict[str, Levels] = {}  # group name -> its levels


class Levels:
    __slots__ = ("group", "nodes", "per_node", "node", "intra_rank", "rank_at", "intra", "inter", "_orders")

    def __init__(self, group, op: str):
        topo = backend_of(group, op).topology()
        sizes = {len(topo.ranks_of_node[n]) for n in range(topo.inter_size)}
        if len(sizes) != 1:
            raise ValueError(
                f"{op}: every node of the group must have the same number of ranks, "
                f"found {sorted(sizes)} (ranks per node: {[list(r) for r in topo.ranks_of_node]})"
            )
        self.group = group
        self.nodes, self.per_node = topo.inter_size, sizes.pop()
        self.node, self.intra_rank = topo.node_of_rank[topo.rank], topo.intra_rank
        self.rank_at = [list(topo.ranks_of_node[n]) for n in range(self.nodes)]
        self.intra = self.inter = None
        self._orders = {}  # device -> by_intra_rank()
        if self.nodes > 1 and self.per_node > 1:
            # Only the members of each sub-group make it (use_local_synchronization): with HSDP the
            # ranks of another replica's shard group never get here.
            def made(ranks):
                return dist.new_group(
                    [dist.get_global_rank(group, r) for r in ranks],
                    backend="chainermn",
                    pg_options=get_options(group),
                    use_local_synchronization=True,
                    sort_ranks=False,
                )

            self.intra = made(self.rank_at[self.node])
            self.inter = made([self.rank_at[n][self.intra_rank] for n in range(self.nodes)])
        elif self.nodes > 1:
            self.inter = group  # one rank a node: the group is the cross-node group

    @property
    def two_hops(self) -> bool:
        """Whether the group spans nodes (else its own collectives serve)."""
        return self.nodes > 1

    def by_intra_rank(self, device) -> torch.Tensor:
        """The group ranks by intra rank, then node: [rank_at[n][l] for l, for n], as an index
        (position l * N + n holds the group rank of node n's l-th rank)."""
        order = self._orders.get(device)
        if order is None:
            order = self._orders[device] = torch.tensor(
                [self.rank_at[n][l] for l in range(self.per_node) for n in range(self.nodes)],
                dtype=torch.long,
                device=device,
            )
        return order


def levels_of(group, op: str) -> Levels:
    """The group's levels, made on first use (collective over the group's members then)."""
    known = _made.get(group.group_name)
    if known is None or known.group is not group:
        known = _made[group.group_name] = Levels(group, op)
    return known
