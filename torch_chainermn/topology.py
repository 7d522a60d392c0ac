"""Where this rank sits: which ranks share its node, and which node it is on."""
from . import _C
from ._backend import backend_of


def topology(group=None) -> _C.Topology:
    """The topology of `group` (default: the default group) as seen from this rank.

    Fields: rank, size, intra_rank, intra_size, inter_rank, inter_size, node_of_rank, ranks_of_node.
    Ranks on the same host share a node; set CHAINERMN_RANKS_PER_NODE=k or a per-process
    CHAINERMN_HOSTNAME to simulate several nodes on one machine.
    """
    return backend_of(group, "topology").topology()
