"""FSDP2 between nodes: reduce-scatter and all-gather in two hops (ZeRO++'s layout, FSDP2's hooks).

    model = fully_shard(...)                     # as usual, on a chainermn group or DeviceMesh
    torch_chainermn.fsdp.compress_between_nodes(model, gradients="int8", weights="int8")
    torch_chainermn.fsdp.two_hop(model)          # the same at full precision
    fsdp.state_dict(model) / load_state_dict(model, state)   # the residuals, for a checkpoint (DCP)

FSDP2 takes a custom ReduceScatter and AllGather per FSDP module (`set_custom_reduce_scatter`,
`set_custom_all_gather`). These run them as two hops: full precision inside the node (shared
memory / NCCL), and between nodes only 1/M of the bytes per rank for M ranks a node, optionally
coded (torch_chainermn.codes): gradients as int8 blocks, MXNet's 2-bit or 1-bit, with error
feedback (ZeRO++'s qgZ), weights as int8 blocks (qwZ); see reduce_scatter.py and all_gather.py.
With AdamW use int8 gradients: 2-bit and 1-bit, made for SGD, do not train the benchmark's language
model with it (docs/fsdp.md). hpZ is FSDP2's own `reshard_after_forward=<ranks per node>`, whose
post-forward all-gather stays in the node (these objects pass it to the group's all-gather).
"""
from __future__ import annotations

from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from .. import codes
from .._backend import backend_of
from .all_gather import TwoHopAllGather
from .levels import levels_of
from .reduce_scatter import TwoHopReduceScatter

__all__ = ["GRADIENTS", "TwoHopAllGather", "TwoHopReduceScatter", "WEIGHTS", "compress_between_nodes",
           "load_state_dict", "state_dict", "two_hop"]

GRADIENTS = ("float32", "int8", "2bit", "1bit")
WEIGHTS = ("float32", "int8")


def compress_between_nodes(model, gradients: str = "int8", weights: str = "int8", block: int = 256,
                           threshold: float = 0.5) -> list:
    """Give every FSDP module of `model` a two-hop reduce-scatter and all-gather whose hop between
    nodes carries `gradients` ("float32", "int8": one float32 scale per `block` values, "2bit": MXNet's
    +-`threshold` or 0, "1bit": signs x mean magnitude; the codes with error feedback) and `weights`
    ("float32" or "int8"); returns the modules.

    Collective over the modules' shard groups (the hops' sub-groups are made here, by every member
    alike). A clear ValueError for an unknown type, `block < 1`, `threshold <= 0`, a model with no
    FSDP module or a shard group that is not a chainermn group (every rank passes the same
    arguments, so every rank raises it).
    """
    op = "torch_chainermn.fsdp.compress_between_nodes"
    if gradients not in GRADIENTS:
        raise ValueError(f"{op}: gradients must be one of {GRADIENTS}, got {gradients!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"{op}: weights must be one of {WEIGHTS}, got {weights!r}")
    for code in {gradients, weights} - {"float32"}:  # the codes' own checks, one rule for each setting
        codes.check_settings(op, code, threshold, block)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(f"{op}: the model has no FSDP module (apply torch.distributed.fsdp.fully_shard first)")
    for module in modules:
        reduce_scatter = TwoHopReduceScatter(gradients, block, float(threshold))
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            group = param_group.mesh_info.shard_process_group
            backend_of(group, op)  # a chainermn group, or a clear error
            levels = levels_of(group, op)
            if levels.two_hops:
                shard = sum(p.padded_sharded_param_size.numel() for p in param_group.fsdp_params)
                reduce_scatter.reserve(levels.nodes, shard, param_group.device)
        module.set_custom_reduce_scatter(reduce_scatter)
        module.set_custom_all_gather(TwoHopAllGather(weights, block))
    return modules


def two_hop(model) -> list:
    """compress_between_nodes(model, "float32", "float32"): two hops at full precision."""
    return compress_between_nodes(model, "float32", "float32")


def state_dict(model) -> dict:
    """The gradient codes' residuals (what each rank still owes the others), one entry per FSDP
    module that has one, keyed by the module's name in `model`: a DTensor over the module's mesh,
    sharded by rank, whose local part is the live residual (as a model's state_dict holds its
    parameters). Save it beside the model's with torch.distributed.checkpoint; a run resumed on
    the same ranks continues exactly."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            comm = param_group._reduce_scatter_comm
            if isinstance(comm, TwoHopReduceScatter) and comm.residual is not None:
                mesh = param_group.mesh_info.mesh
                local = comm.residual.view((1,) * mesh.ndim + tuple(comm.residual.shape))
                out[name or "."] = DTensor.from_local(local, mesh, [Shard(d) for d in range(mesh.ndim)],
                                                      run_check=False)
    return out


def load_state_dict(model, state: dict) -> None:
    """Put the residuals of a state_dict(model) back (a no-op for entries that torch.distributed.
    checkpoint already loaded in place). A clear ValueError for a module that is missing on either
    side or a residual of another shape."""
    mine = state_dict(model)
    if set(mine) != set(state):
        raise ValueError(f"torch_chainermn.fsdp.load_state_dict: the state has residuals for {sorted(state)}, "
                         f"the model's coded modules are {sorted(mine)}")
    for name, live in mine.items():
        saved = state[name].to_local() if isinstance(state[name], DTensor) else state[name]
        if saved.shape != live.to_local().shape:
            raise ValueError(f"torch_chainermn.fsdp.load_state_dict: {name!r}: the saved residual has shape "
                             f"{tuple(saved.shape)}, this rank's is {tuple(live.to_local().shape)}")
        if saved.data_ptr() != live.to_local().data_ptr():
            live.to_local().copy_(saved)
