"""FSDP2's reduce-scatter of gradients in two hops: full precision inside the node, then between nodes.

FSDP2 hands a custom ReduceScatter (`FSDPModule.set_custom_reduce_scatter`, the protocol of
torch.distributed.fsdp._fully_shard._fsdp_api) its flat gradient buffer, world shards end to end
in group-rank order, and an output of one shard. Here, for N nodes of M ranks:

1. the shards are reordered, by intra rank then node, into a buffer this object keeps (one copy);
2. a reduce-scatter inside the node leaves intra rank l the node's sum of the N shards whose owners
   have intra rank l (shared memory / NCCL, full precision);
3. a reduce-scatter among the N ranks with intra rank l (one per node) leaves each its own shard.

Only the third step crosses the network, with 1/M of the buffer per rank. FSDP's op passes
through: AVG and SUM are AVG and SUM on both hops (the mean of node means is the mean), a
PREMUL_SUM's factor is applied on the first hop only. One node: the group's own reduce-scatter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .levels import levels_of

__all__ = ["TwoHopReduceScatter"]


class TwoHopReduceScatter(ReduceScatter):
    """Gradients reduce-scattered in the node, then between nodes, at full precision (see above)."""

    def __init__(self):
        self._reordered = None   # the input, by intra rank then node, reused from call to call
        self._node_sums = None   # the node's sums of this rank's N shards

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        levels = levels_of(group, "TwoHopReduceScatter")
        if levels.intra is None:  # one node, or one rank a node: one hop
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=levels.inter or group,
                                              async_op=async_op)
        shard = output_tensor.numel()
        self._reordered = _reused(self._reordered, input_tensor.numel(), input_tensor)
        self._node_sums = _reused(self._node_sums, levels.nodes * shard, input_tensor)
        torch.index_select(input_tensor.view(-1, shard), 0, levels.by_intra_rank(input_tensor.device),
                           out=self._reordered.view(-1, shard))
        dist.reduce_scatter_tensor(self._node_sums, self._reordered, op=op, group=levels.intra)
        # PREMUL_SUM's factor was applied on the first hop; AVG of node means is the mean.
        between = dist.ReduceOp.SUM if op == dist.ReduceOp.PREMUL_SUM else op
        return dist.reduce_scatter_tensor(output_tensor, self._node_sums, op=between, group=levels.inter,
                                          async_op=async_op)


def _reused(buffer, numel: int, like: torch.Tensor) -> torch.Tensor:
    """`buffer` if it fits `numel` values of like's dtype and device, else a new one."""
    if buffer is None or (buffer.numel(), buffer.dtype, buffer.device) != (numel, like.dtype, like.device):
        buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer
