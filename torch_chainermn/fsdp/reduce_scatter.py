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

With a code between nodes (gradients= any code of torch_chainermn.codes.CODES, e.g. "int8") the third
step is ZeRO++'s qgZ with error feedback: each rank encodes its N node sums plus its residual (one
pass; the residual keeps what the codes did not carry, for the next step), the N ranks exchange
the codes all-to-all, and each decodes and sums the N pieces of its own shard (one pass).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..codes import CompressionSpec, decode, encode, wire_row_bytes
from ..residuals import ResidualStore
from .levels import levels_of

__all__ = ["TwoHopReduceScatter"]


class TwoHopReduceScatter(ReduceScatter):
    """Gradients reduce-scattered in the node at full precision, then between nodes as `gradients`
    ("float32", or a code of torch_chainermn.codes with `block`, `threshold` and `keep`; see above).
    Made here, the ranks' settings are not compared: compress_between_nodes compares them.

    store: the ResidualStore the residual is held in, under `holder` (compress_between_nodes gives the
    modules of a model one store, each its module's name); by default one of its own."""

    def __init__(
        self,
        gradients: str = "float32",
        block: int = 256,
        threshold: float = 0.5,
        keep: int = 8,
        *,
        store: ResidualStore | None = None,
        holder: str = ".",
    ):
        self.gradients = gradients
        self.block = block
        self.threshold = threshold
        self.keep = keep
        # The code and its settings as one value, checked once (None: float32).
        self.spec = (
            None
            if gradients == "float32"
            else CompressionSpec(
                gradients, block=block, threshold=threshold, keep=keep, op="TwoHopReduceScatter", argument="gradients"
            )
        )
        self._reordered = None  # the input, by intra rank then node, reused from call to call
        self._node_sums = None  # the node's sums of this rank's N shards
        # A code between nodes: what this rank owes ([N, shard] float32), kept across steps in the
        # store (the DDP side's kind: one owner, one checkpoint format, residuals.py) ...
        self.store = store if store is not None else ResidualStore(settings_of(gradients, block, threshold, keep))
        self.holder = holder
        self.residual: torch.Tensor | None = None  # the store's tensor, once made
        self._sent = self._received = None  # ... the codes it sends and receives ([N, row bytes])
        self._as_float32 = None  # the node sums or the output, where FSDP reduces in another dtype
        self._made_for = None  # (nodes, shard, device) the residual and wire buffers fit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def reserve(self, nodes: int, shard: int, device: torch.device) -> None:
        """Make the residual for `nodes` x `shard` values before the first step, so that a checkpoint
        has the same structure in a fresh run (torch.distributed.checkpoint loads into it)."""
        if self.gradients != "float32" and self.residual is None:
            (self.residual,) = self.store.allocate(self.holder, ((nodes, shard),), device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op=dist.ReduceOp.SUM,
        async_op: bool = False,
    ):
        levels = levels_of(group, "TwoHopReduceScatter")
        if not levels.two_hops or (levels.intra is None and self.gradients == "float32"):
            # One node, or one rank a node at full precision: the group's own reduce-scatter.
            return dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=levels.inter or group, async_op=async_op
            )
        if levels.intra is None:  # one rank a node: its gradients are the node's sums, in node order
            if op == dist.ReduceOp.PREMUL_SUM:
                raise ValueError(
                    f"TwoHopReduceScatter: {self.gradients} gradients with one rank a node take SUM "
                    "or AVG, not PREMUL_SUM (FSDPModule.set_gradient_divide_factor)"
                )
            self._coded_between_nodes(output_tensor, input_tensor, levels, op)
            return None
        shard = output_tensor.numel()
        self._reordered = _reused(self._reordered, input_tensor.numel(), input_tensor.dtype, input_tensor.device)
        self._node_sums = _reused(self._node_sums, levels.nodes * shard, input_tensor.dtype, input_tensor.device)
        torch.index_select(
            input_tensor.view(-1, shard),
            0,
            levels.by_intra_rank(input_tensor.device),
            out=self._reordered.view(-1, shard),
        )
        dist.reduce_scatter_tensor(self._node_sums, self._reordered, op=op, group=levels.intra)
        # PREMUL_SUM's factor was applied on the first hop; AVG of node means is the mean.
        between = dist.ReduceOp.SUM if op == dist.ReduceOp.PREMUL_SUM else op
        if self.gradients != "float32":
            self._coded_between_nodes(output_tensor, self._node_sums, levels, between)
            return None
        return dist.reduce_scatter_tensor(
            output_tensor, self._node_sums, op=between, group=levels.inter, async_op=async_op
        )

    def _coded_between_nodes(self, output_tensor: torch.Tensor, node_sums: torch.Tensor, levels, op) -> None:
        """output = the sum (AVG: mean) over the nodes of their coded sums of this rank's shard."""
        nodes, shard, device = levels.nodes, output_tensor.numel(), output_tensor.device
        self._prepare(nodes, shard, device)
        values = node_sums.view(nodes, shard)
        if values.dtype != torch.float32:
            self._as_float32 = _reused(self._as_float32, nodes * shard, torch.float32, device)
            values = self._as_float32.view(nodes, shard).copy_(values)
        encode(values, self._sent, self.residual, self.spec)
        dist.all_to_all_single(self._received, self._sent, group=levels.inter)
        if output_tensor.dtype == torch.float32:
            total = output_tensor.view(-1)
        else:
            self._as_float32 = _reused(self._as_float32, nodes * shard, torch.float32, device)
            total = self._as_float32[:shard]
        decode(self._received, total, self.spec, sum=True)
        if op == dist.ReduceOp.AVG:
            total.div_(nodes)
        if total.data_ptr() != output_tensor.data_ptr():
            output_tensor.copy_(total.view_as(output_tensor))

    def _prepare(self, nodes: int, shard: int, device: torch.device) -> None:
        """The residual and the wire buffers for `nodes` x `shard` values (made once)."""
        if self._sent is not None and self._made_for == (nodes, shard, device):
            return  # every step after the first: nothing to look up
        if (
            self.residual is None
            or self.residual.device != device
            or (self.residual.shape != (nodes, shard) and not self.residual.any())
        ):
            self.store.drop(self.holder)
            (self.residual,) = self.store.allocate(self.holder, ((nodes, shard),), device)
        elif self.residual.shape != (nodes, shard):
            raise ValueError(
                f"TwoHopReduceScatter: the residual held (a checkpoint's?) has shape "
                f"{tuple(self.residual.shape)}, this module's gradient shards need ({nodes}, {shard})"
            )
        row = wire_row_bytes(self.spec, shard)
        if self._sent is None or self._sent.shape != (nodes, row) or self._sent.device != device:
            self._sent = torch.empty(nodes, row, dtype=torch.uint8, device=device)
            self._received = torch.empty_like(self._sent)
        self._made_for = (nodes, shard, device)


def settings_of(gradients: str, block: int, threshold: float, keep: int) -> dict:
    """The settings a checkpoint of these residuals holds: GradientCompression's (the same keys as the
    DDP side's; no sums travel back, so compress_result=False, result_dtype=float32)."""
    from ..compression import GradientCompression

    values = (gradients, float(threshold), block, keep, False, torch.float32)
    return ResidualStore.saved_settings(dict(zip(GradientCompression.SETTINGS, values)))


def _reused(buffer, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`buffer` if it holds `numel` values of `dtype` on `device`, else a new one."""
    if buffer is None or (buffer.numel(), buffer.dtype, buffer.device) != (numel, dtype, device):
        buffer = torch.empty(numel, dtype=dtype, device=device)
    return buffer
