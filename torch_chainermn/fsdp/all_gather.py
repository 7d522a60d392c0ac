"""FSDP2's all-gather of parameters in two hops: between nodes first, then inside the node.

FSDP2 hands a custom AllGather (`FSDPModule.set_custom_all_gather`) this rank's shard and an output
for every rank's, end to end in group-rank order. Here, for N nodes of M ranks:

1. an all-gather among the N ranks with this rank's intra rank (one per node) collects their
   shards: the only step that crosses the network, one shard per rank;
2. an all-gather inside the node collects the M ranks' N shards each (shared memory / NCCL);
3. the shards are put in group-rank order into FSDP's output (one copy).

One node (and FSDP's post-forward all-gather inside the node with `reshard_after_forward=<ranks per
node>`, hpZ): the group's own all-gather.

With weights="int8" the first step is ZeRO++'s qwZ: the shard travels block-quantised
(torch_chainermn.codes, one pass each way), and the node's all-gather carries the dequantised N
shards at full precision. FSDP's sharded parameters, and so the optimizer, stay exact; the gathered
copy is what the forward and backward compute with. No error feedback (a fresh copy every time, as
in ZeRO++).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from ..codes import CompressionSpec, decode, encode, wire_row_bytes
from .levels import levels_of
from .reduce_scatter import _reused

__all__ = ["TwoHopAllGather"]


class TwoHopAllGather(AllGather):
    """Parameters all-gathered between nodes as `weights` ("float32", or "int8" in blocks of `block`
    values), then in the node at full precision (see above)."""

    def __init__(self, weights: str = "float32", block: int = 256):
        self.weights = weights
        self.block = block
        self.spec = (
            None
            if weights == "float32"
            else CompressionSpec(weights, block=block, op="TwoHopAllGather", argument="weights")
        )
        self._across = None  # the shards of this intra rank's N peers, one per node
        self._by_rank = None  # every rank's, by intra rank then node
        self._sent = self._received = self._as_float32 = None  # int8: the codes, and float32 copies

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ):
        levels = levels_of(group, "TwoHopAllGather")
        quantised = self.spec is not None and input_tensor.is_floating_point()  # FSDP gathers mixed dtypes as bytes
        if not levels.two_hops or (levels.intra is None and not quantised):
            # One node, or one rank a node at full precision: the group's own all-gather.
            return dist.all_gather_into_tensor(
                output_tensor, input_tensor, group=levels.inter or group, async_op=async_op
            )
        shard = input_tensor.numel()
        self._across = _reused(self._across, levels.nodes * shard, input_tensor.dtype, input_tensor.device)
        if quantised:
            self._int8_between_nodes(input_tensor, levels)
        else:
            dist.all_gather_into_tensor(self._across, input_tensor, group=levels.inter)
        if levels.intra is None:  # one rank a node: the N shards are every rank's, in group order
            output_tensor.copy_(self._across.view_as(output_tensor))
            return None
        self._by_rank = _reused(self._by_rank, output_tensor.numel(), input_tensor.dtype, input_tensor.device)
        dist.all_gather_into_tensor(self._by_rank, self._across, group=levels.intra)
        # Position l * N + n holds group rank rank_at[n][l]'s shard: scatter the rows back.
        output_tensor.view(-1, shard).index_copy_(
            0, levels.by_intra_rank(output_tensor.device), self._by_rank.view(-1, shard)
        )
        return None

    def _int8_between_nodes(self, input_tensor: torch.Tensor, levels) -> None:
        """self._across = the N peers' shards, block-quantised on the way, decoded."""
        nodes, shard, device = levels.nodes, input_tensor.numel(), input_tensor.device
        row = wire_row_bytes(self.spec, shard)
        if self._sent is None or self._sent.shape != (1, row) or self._sent.device != device:
            self._sent = torch.empty(1, row, dtype=torch.uint8, device=device)
            self._received = torch.empty(nodes, row, dtype=torch.uint8, device=device)
        float32 = input_tensor.dtype == torch.float32
        if not float32:  # bfloat16 parameters (MixedPrecisionPolicy): coded from, and decoded into, float32
            self._as_float32 = _reused(self._as_float32, nodes * shard, torch.float32, device)
        mine = (
            input_tensor.reshape(1, shard)
            if float32
            else self._as_float32[:shard].view(1, shard).copy_(input_tensor.view(1, shard))
        )
        encode(mine, self._sent, None, self.spec)
        dist.all_gather_into_tensor(self._received, self._sent, group=levels.inter)
        decoded = self._across if float32 else self._as_float32
        decode(self._received, decoded.view(nodes, shard), self.spec)
        if not float32:
            self._across.copy_(self._as_float32)
