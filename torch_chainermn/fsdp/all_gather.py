"""FSDP2's all-gather of parameters in two hops: between nodes first, then inside the node.

FSDP2 hands a custom AllGather (`FSDPModule.set_custom_all_gather`) this rank's shard and an output
for every rank's, end to end in group-rank order. Here, for N nodes of M ranks:

1. an all-gather among the N ranks with this rank's intra rank (one per node) collects their
   shards: the only step that crosses the network, one shard per rank;
2. an all-gather inside the node collects the M ranks' N shards each (shared memory / NCCL);
3. the shards are put in group-rank order into FSDP's output (one copy).

One node (and FSDP's post-forward all-gather inside the node with `reshard_after_forward=<ranks per
node>`, hpZ): the group's own all-gather.

With weights="int8" the first step is ZeRO++'s qwZ: the shard travels block-quantised (int8.py),
every rank dequantises the N shards, and the node's all-gather carries them at full precision.
FSDP's sharded parameters, and so the optimizer, stay exact; the gathered copy is what the
forward and backward compute with. No error feedback (a fresh copy every time, as in ZeRO++).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from . import int8
from .levels import levels_of
from .reduce_scatter import _reused

__all__ = ["TwoHopAllGather"]


class TwoHopAllGather(AllGather):
    """Parameters all-gathered between nodes as `weights` ("float32", or "int8" in blocks of `block`
    values), then in the node at full precision (see above)."""

    def __init__(self, weights: str = "float32", block: int = 256):
        self.weights = weights
        self.block = block
        self._across = None     # the shards of this intra rank's N peers, one per node
        self._by_rank = None    # every rank's, by intra rank then node
        self._mine = self._codes = self._scales = self._all_codes = self._all_scales = None  # int8

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        levels = levels_of(group, "TwoHopAllGather")
        quantised = self.weights == "int8" and input_tensor.is_floating_point()  # FSDP gathers mixed dtypes as bytes
        if not levels.two_hops or (levels.intra is None and not quantised):
            # One node, or one rank a node at full precision: the group's own all-gather.
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=levels.inter or group,
                                               async_op=async_op)
        shard = input_tensor.numel()
        self._across = _reused(self._across, levels.nodes * shard, input_tensor)
        if quantised:
            self._int8_between_nodes(input_tensor, levels)
        else:
            dist.all_gather_into_tensor(self._across, input_tensor, group=levels.inter)
        if levels.intra is None:  # one rank a node: the N shards are every rank's, in group order
            output_tensor.copy_(self._across.view_as(output_tensor))
            return None
        self._by_rank = _reused(self._by_rank, output_tensor.numel(), input_tensor)
        dist.all_gather_into_tensor(self._by_rank, self._across, group=levels.intra)
        # Position l * N + n holds group rank rank_at[n][l]'s shard: scatter the rows back.
        output_tensor.view(-1, shard).index_copy_(0, levels.by_intra_rank(output_tensor.device),
                                                  self._by_rank.view(-1, shard))
        return None

    def _int8_between_nodes(self, input_tensor: torch.Tensor, levels) -> None:
        """self._across = the N peers' shards, block-quantised on the way, dequantised."""
        nodes, shard = levels.nodes, input_tensor.numel()
        width = int8.padded(shard, self.block)
        device = input_tensor.device
        if self._mine is None or self._mine.shape != (1, width) or self._mine.device != device:
            self._mine = torch.zeros(1, width, dtype=torch.float32, device=device)
            self._codes = torch.empty(1, width, dtype=torch.int8, device=device)
            self._scales = torch.empty(1, width // self.block, dtype=torch.float32, device=device)
            self._all_codes = torch.empty(nodes, width, dtype=torch.int8, device=device)
            self._all_scales = torch.empty(nodes, width // self.block, dtype=torch.float32, device=device)
        self._mine[0, :shard].copy_(input_tensor.view(-1))
        int8.quantize_(self._mine, self._codes, self._scales)
        dist.all_gather_into_tensor(self._all_codes, self._codes, group=levels.inter)
        dist.all_gather_into_tensor(self._all_scales, self._scales, group=levels.inter)
        self._across.view(nodes, shard).copy_(int8.dequantize(self._all_codes, self._all_scales)[:, :shard])
