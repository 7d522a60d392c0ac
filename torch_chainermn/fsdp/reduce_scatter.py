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

With gradients="int8" the third step is ZeRO++'s qgZ with error feedback: each rank adds its
residual to its N node sums, quantises each in blocks (int8.py: one scale per `block` values),
keeps what the codes did not carry as the residual for the next step, and the N ranks exchange
the codes all-to-all; each sums the N dequantised pieces of its own shard.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from . import int8
from .levels import levels_of

__all__ = ["TwoHopReduceScatter"]


class TwoHopReduceScatter(ReduceScatter):
    """Gradients reduce-scattered in the node at full precision, then between nodes as `gradients`
    ("float32" or "int8", blocks of `block` values; see above)."""

    def __init__(self, gradients: str = "float32", block: int = 256):
        self.gradients = gradients
        self.block = block
        self._reordered = None   # the input, by intra rank then node, reused from call to call
        self._node_sums = None   # the node's sums of this rank's N shards
        self._residual = None    # int8: [N, padded shard] float32, what the codes have not carried yet
        self._codes = self._scales = self._sent = None        # int8: what this rank sends ...
        self._received = self._received_scales = None         # ... and receives

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        levels = levels_of(group, "TwoHopReduceScatter")
        if not levels.two_hops or (levels.intra is None and self.gradients == "float32"):
            # One node, or one rank a node at full precision: the group's own reduce-scatter.
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=levels.inter or group,
                                              async_op=async_op)
        if levels.intra is None:  # one rank a node: its gradients are the node's sums, in node order
            if op == dist.ReduceOp.PREMUL_SUM:
                raise ValueError("TwoHopReduceScatter: int8 gradients with one rank a node take SUM or AVG, "
                                 "not PREMUL_SUM (FSDPModule.set_gradient_divide_factor)")
            self._int8_between_nodes(output_tensor, input_tensor, levels, op)
            return None
        shard = output_tensor.numel()
        self._reordered = _reused(self._reordered, input_tensor.numel(), input_tensor)
        self._node_sums = _reused(self._node_sums, levels.nodes * shard, input_tensor)
        torch.index_select(input_tensor.view(-1, shard), 0, levels.by_intra_rank(input_tensor.device),
                           out=self._reordered.view(-1, shard))
        dist.reduce_scatter_tensor(self._node_sums, self._reordered, op=op, group=levels.intra)
        # PREMUL_SUM's factor was applied on the first hop; AVG of node means is the mean.
        between = dist.ReduceOp.SUM if op == dist.ReduceOp.PREMUL_SUM else op
        if self.gradients == "int8":
            self._int8_between_nodes(output_tensor, self._node_sums, levels, between)
            return None
        return dist.reduce_scatter_tensor(output_tensor, self._node_sums, op=between, group=levels.inter,
                                          async_op=async_op)

    def _int8_between_nodes(self, output_tensor: torch.Tensor, node_sums: torch.Tensor, levels, op) -> None:
        """output = the sum (AVG: mean) over the nodes of their int8-coded sums of this rank's shard."""
        nodes, shard = levels.nodes, output_tensor.numel()
        width = int8.padded(shard, self.block)
        blocks = width // self.block
        if self._residual is None or self._residual.shape != (nodes, width):
            self._residual = torch.zeros(nodes, width, dtype=torch.float32, device=output_tensor.device)
            self._sent = torch.empty_like(self._residual)
            self._codes = torch.empty(nodes, width, dtype=torch.int8, device=output_tensor.device)
            self._received = torch.empty_like(self._codes)
            self._scales = torch.empty(nodes, blocks, dtype=torch.float32, device=output_tensor.device)
            self._received_scales = torch.empty_like(self._scales)
        values = self._residual  # residual + this step's node sums, then what is left of them
        values[:, :shard] += node_sums.view(nodes, shard)
        int8.quantize_(values, self._codes, self._scales, self._sent)
        values.sub_(self._sent)
        dist.all_to_all_single(self._received, self._codes, group=levels.inter)
        dist.all_to_all_single(self._received_scales, self._scales, group=levels.inter)
        total = output_tensor if output_tensor.dtype == torch.float32 else torch.empty(
            shard, dtype=torch.float32, device=output_tensor.device)
        int8.dequantize_sum(self._received, self._received_scales, total.view(-1))
        if op == dist.ReduceOp.AVG:
            total.div_(nodes)
        if total is not output_tensor:
            output_tensor.copy_(total.view_as(output_tensor))

    def state_dict(self) -> dict:
        """The residual this rank keeps (int8 gradients), for a checkpoint of this rank."""
        return {"residual": None if self._residual is None else self._residual.clone()}


def _reused(buffer, numel: int, like: torch.Tensor) -> torch.Tensor:
    """`buffer` if it fits `numel` values of like's dtype and device, else a new one."""
    if buffer is None or (buffer.numel(), buffer.dtype, buffer.device) != (numel, like.dtype, like.device):
        buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer
