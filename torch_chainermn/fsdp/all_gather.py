"""FSDP2's all-gather of parameters in two hops: between nodes first, then inside the node.

FSDP2 hands a custom AllGather (`FSDPModule.set_custom_all_gather`) this rank's shard and an output
for every rank's, end to end in group-rank order. Here, for N nodes of M ranks:

1. an all-gather among the N ranks with this rank's intra rank (one per node) collects their
   shards: the only step that crosses the network, one shard per rank;
2. an all-gather inside the node collects the M ranks' N shards each (shared memory / NCCL);
3. the shards are put in group-rank order into FSDP's output (one copy).

One node (and FSDP's post-forward all-gather inside the node with `reshard_after_forward=<ranks per
node>`, hpZ): the group's own all-gather.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from .levels import levels_of
from .reduce_scatter import _reused

__all__ = ["TwoHopAllGather"]


class TwoHopAllGather(AllGather):
    """Parameters all-gathered between nodes, then in the node, at full precision (see above)."""

    def __init__(self):
        self._across = None     # the shards of this intra rank's N peers, one per node
        self._by_rank = None    # every rank's, by intra rank then node

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        levels = levels_of(group, "TwoHopAllGather")
        if levels.intra is None:  # one node, or one rank a node: one hop
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=levels.inter or group,
                                               async_op=async_op)
        shard = input_tensor.numel()
        self._across = _reused(self._across, levels.nodes * shard, input_tensor)
        self._by_rank = _reused(self._by_rank, output_tensor.numel(), input_tensor)
        dist.all_gather_into_tensor(self._across, input_tensor, group=levels.inter)
        dist.all_gather_into_tensor(self._by_rank, self._across, group=levels.intra)
        # Position l * N + n holds group rank rank_at[n][l]'s shard: scatter the rows back.
        output_tensor.view(-1, shard).index_copy_(0, levels.by_intra_rank(output_tensor.device),
                                                  self._by_rank.view(-1, shard))
        return None
