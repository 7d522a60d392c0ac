"""Counters (docs/observability.md#counters): what a group's ops move within the node and between
nodes, and how long their phases take, counted where the phases run. Real ranks on 2 simulated nodes
of 2: one all_reduce after a reset, against the bytes the hierarchical strategy must move."""

import torch
import torch.distributed as dist

import torch_chainermn
from tests.support.harness import run_spawn

VALUES = 1 << 18  # float32: 1 MiB
BUFFER = 4 * VALUES
FINGERPRINT = 128  # the bytes of one rank's cross-rank check (Fingerprint, csrc/backend/agreement.h)


def one_all_reduce():
    x = torch.full((VALUES,), float(dist.get_rank() + 1))
    dist.barrier()
    torch_chainermn.reset_counters()  # between this rank's ops: exact
    dist.all_reduce(x)
    counted = torch_chainermn.counters()
    torch_chainermn.reset_counters()
    emptied = torch_chainermn.counters()
    return {"counted": counted, "emptied": emptied, "sum": x[0].item()}


def expected(rank):
    """hierarchical on 2 nodes of 2: reduce to the node's first rank (shared memory), all_reduce among
    the nodes' first ranks (Gloo's ring over 2 ranks: 2(n-1)/n of the buffer each way, so all of it),
    broadcast from the node's first rank. Before it, the check: each rank exchanges its fingerprint
    with its node (shared memory's exchange, counted as no transport call) and with the rank of its
    place on the other node (a Gloo all-gather between nodes)."""
    leader = rank % 2 == 0
    within = {"calls": 2, "bytes_sent": BUFFER, "bytes_received": BUFFER}  # reduce: one way; broadcast: the other
    between = {
        "calls": 1 + leader,
        "bytes_sent": FINGERPRINT + leader * BUFFER,
        "bytes_received": FINGERPRINT + leader * BUFFER,
    }
    return within, between


def test_bytes_of_one_all_reduce_on_two_nodes_of_two():
    results = run_spawn(one_all_reduce, 4, env={"CHAINERMN_RANKS_PER_NODE": "2"}, timeout=240)
    for rank, out in enumerate(results):
        counted = out["counted"]
        assert out["sum"] == 10.0, (rank, out["sum"])  # 1 + 2 + 3 + 4
        assert counted["ops"] == 1, (rank, counted)
        within, between = expected(rank)
        shm = counted["within_node"]["shm"]
        gloo = counted["between_nodes"]["gloo"]
        assert {k: shm[k] for k in within} == within, (rank, counted)
        assert {k: gloo[k] for k in between} == between, (rank, counted)
        assert set(counted["within_node"]) == {"shm"}, (rank, counted)  # nothing else within the node
        assert shm["seconds"] > 0 and gloo["seconds"] > 0, (rank, counted)
        assert counted["check"]["calls"] == 1, (rank, counted)
        emptied = out["emptied"]
        assert emptied["ops"] == 0 and emptied["between_nodes"]["gloo"]["bytes_sent"] == 0, (rank, emptied)
