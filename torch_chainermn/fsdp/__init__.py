"""FSDP2 between nodes: reduce-scatter and all-gather in two hops (ZeRO++'s layout, FSDP2's hooks).

    model = fully_shard(...)                     # as usual, on a chainermn group or DeviceMesh
    torch_chainermn.fsdp.compress_between_nodes(model, gradients="int8", weights="int8", block=256)
    torch_chainermn.fsdp.two_hop(model)          # the same at full precision

FSDP2 takes a custom ReduceScatter and AllGather per FSDP module (`set_custom_reduce_scatter`,
`set_custom_all_gather`). These run them as two hops: full precision inside the node (shared
memory / NCCL), and between nodes only 1/M of the bytes per rank for M ranks a node, optionally
block-quantised to int8 (ZeRO++'s qgZ with error feedback for gradients, qwZ for weights; see
reduce_scatter.py and all_gather.py). hpZ is FSDP2's own `reshard_after_forward=<ranks per node>`,
whose post-forward all-gather stays in the node (these objects pass it to the group's all-gather).
"""
from __future__ import annotations

from torch.distributed.fsdp import FSDPModule

from .._backend import backend_of
from .all_gather import TwoHopAllGather
from .levels import levels_of
from .reduce_scatter import TwoHopReduceScatter

__all__ = ["GRADIENTS", "TwoHopAllGather", "TwoHopReduceScatter", "WEIGHTS", "compress_between_nodes", "two_hop"]

GRADIENTS = ("float32", "int8")
WEIGHTS = ("float32", "int8")


def compress_between_nodes(model, gradients: str = "int8", weights: str = "int8", block: int = 256) -> list:
    """Give every FSDP module of `model` a two-hop reduce-scatter and all-gather whose hop between
    nodes carries `gradients` and `weights` ("float32", or "int8": one float32 scale per `block`
    values); returns the modules.

    Collective over the modules' shard groups (the hops' sub-groups are made here, by every member
    alike). A clear ValueError for an unknown type, `block < 1`, a model with no FSDP module or a
    shard group that is not a chainermn group (every rank passes the same arguments, so every rank
    raises it).
    """
    op = "torch_chainermn.fsdp.compress_between_nodes"
    if gradients not in GRADIENTS:
        raise ValueError(f"{op}: gradients must be one of {GRADIENTS}, got {gradients!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"{op}: weights must be one of {WEIGHTS}, got {weights!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{op}: block must be an int >= 1, got {block!r}")
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(f"{op}: the model has no FSDP module (apply torch.distributed.fsdp.fully_shard first)")
    for module in modules:
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            group = param_group.mesh_info.shard_process_group
            backend_of(group, op)  # a chainermn group, or a clear error
            levels_of(group, op)
        module.set_custom_reduce_scatter(TwoHopReduceScatter(gradients, block))
        module.set_custom_all_gather(TwoHopAllGather(weights, block))
    return modules


def two_hop(model) -> list:
    """compress_between_nodes(model, "float32", "float32"): two hops at full precision."""
    return compress_between_nodes(model, "float32", "float32")
