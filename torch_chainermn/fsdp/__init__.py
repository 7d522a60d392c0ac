"""FSDP2 between nodes: reduce-scatter and all-gather in two hops (ZeRO++'s layout, FSDP2's hooks).

    model = fully_shard(...)                     # as usual, on a chainermn group or DeviceMesh
    torch_chainermn.fsdp.two_hop(model)          # every FSDP module of the model

FSDP2 takes a custom ReduceScatter and AllGather per FSDP module (`set_custom_reduce_scatter`,
`set_custom_all_gather`). These run them as two hops: full precision inside the node (shared
memory / NCCL), and between nodes only 1/M of the bytes per rank for M ranks a node (see
reduce_scatter.py and all_gather.py). The quantised hop between nodes (ZeRO++'s qgZ and qwZ:
int8 / 2-bit / 1-bit gradients, int8 weights) is the next step of issue 36 and replaces the
second hop's collective; hpZ is FSDP2's own `reshard_after_forward=<ranks per node>`, whose
post-forward all-gather stays in the node (these objects pass it to the group's all-gather).
"""
from __future__ import annotations

from torch.distributed.fsdp import FSDPModule

from .._backend import backend_of
from .all_gather import TwoHopAllGather
from .levels import levels_of
from .reduce_scatter import TwoHopReduceScatter

__all__ = ["TwoHopAllGather", "TwoHopReduceScatter", "two_hop"]


def two_hop(model) -> list:
    """Give every FSDP module of `model` a two-hop reduce-scatter and all-gather; returns the modules.

    Collective over the modules' shard groups (the hops' sub-groups are made here, by every member
    alike). ValueError, on every rank alike, for a model with no FSDP module or a shard group that
    is not a chainermn group.
    """
    op = "torch_chainermn.fsdp.two_hop"
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(f"{op}: the model has no FSDP module (apply torch.distributed.fsdp.fully_shard first)")
    for module in modules:
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            group = param_group.mesh_info.shard_process_group
            backend_of(group, op)  # a chainermn group, or a clear error
            levels_of(group, op)
        module.set_custom_reduce_scatter(TwoHopReduceScatter())
        module.set_custom_all_gather(TwoHopAllGather())
    return modules
