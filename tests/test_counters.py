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


CODED_VALUES = 4096
BLOCK = 256


def one_compressed_mean():
    from torch_chainermn.compression import GradientCompression

    grads = torch.full((CODED_VALUES,), float(dist.get_rank() + 1))
    compression = GradientCompression(code="int8", block=BLOCK)
    dist.barrier()
    torch_chainermn.reset_counters()
    compression.start([grads], [(id(grads), 0, grads.numel())]).wait()
    return torch_chainermn.counters()


def test_a_codes_bytes_before_and_after_on_two_nodes_of_two():
    """int8 between 2 nodes (docs/codes.md): a node's first rank splits the node's sum into one chunk
    per node, encodes each (its float32 values in, a row of int8 codes and one float32 scale per
    block out), sends the other node its row, and decodes the two rows of its own chunk into their
    float32 sum; the node's other rank codes nothing."""
    results = run_spawn(one_compressed_mean, 4, env={"CHAINERMN_RANKS_PER_NODE": "2"}, timeout=240)
    chunk = CODED_VALUES // 2
    row = chunk + 4 * (chunk // BLOCK)  # one byte a value, 4 bytes a block's scale
    for rank, counted in enumerate(results):
        if rank % 2:
            assert "encode" not in counted and "decode" not in counted, (rank, counted)
            continue
        encode, decode = counted["encode"]["int8"], counted["decode"]["int8"]
        assert {k: encode[k] for k in ("calls", "bytes_before", "bytes_after")} == {
            "calls": 2,
            "bytes_before": 4 * CODED_VALUES,
            "bytes_after": 2 * row,
        }, (rank, counted)
        assert {k: decode[k] for k in ("calls", "bytes_before", "bytes_after")} == {
            "calls": 1,
            "bytes_before": 2 * row,
            "bytes_after": 4 * chunk,
        }, (rank, counted)
