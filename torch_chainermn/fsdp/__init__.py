"""FSDP2 between nodes: reduce-scatter and all-gather in two hops (ZeRO++'s layout, FSDP2's hooks).

    model = fully_shard(...)                     # as usual, on a chainermn group or DeviceMesh
    torch_chainermn.fsdp.compress_between_nodes(model, compression={"code": "int8"}, weights="int8")
    torch_chainermn.fsdp.two_hop(model)          # the same at full precision
    fsdp.state_dict(model) / load_state_dict(model, state)   # the residuals, for a checkpoint (DCP)

FSDP2 takes a custom ReduceScatter and AllGather per FSDP module (`set_custom_reduce_scatter`,
`set_custom_all_gather`). These run them as two hops: full precision inside the node (shared
memory / NCCL), and between nodes only 1/M of the bytes per rank for M ranks a node, optionally
coded (torch_chainermn.codes): gradients in any code (int8 or 4-bit blocks, MXNet's 2-bit or 1-bit,
top-k), with error feedback (ZeRO++'s qgZ), weights as int8 blocks (qwZ); see reduce_scatter.py and
all_gather.py.
With AdamW use int8 gradients: 2-bit and 1-bit, made for SGD, do not train the benchmark's language
model with it (docs/fsdp.md). hpZ is FSDP2's own `reshard_after_forward=<ranks per node>`, whose
post-forward all-gather stays in the node (these objects pass it to the group's all-gather).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from .. import codes
from .._backend import backend_of
from .._means import compression_settings, deprecated_spelling
from ..messages.objects import agree_on_settings
from .all_gather import TwoHopAllGather
from .levels import levels_of
from .reduce_scatter import TwoHopReduceScatter

__all__ = [
    "GRADIENTS",
    "TwoHopAllGather",
    "TwoHopReduceScatter",
    "WEIGHTS",
    "compress_between_nodes",
    "load_state_dict",
    "state_dict",
    "two_hop",
]

GRADIENTS = ("float32", *codes.CODES)  # gradients=, compression's old spelling: "float32" is None
# The weights travel without error feedback (the sharded float32 stays exact): codes that keep each
# value's scale (the registry's carries_sums), ZeRO++'s qwZ int8 among them.
WEIGHTS = ("float32", *codes.SUMS_CODES)
_UNSET = object()  # an argument not given (None means something for compression=)


def compress_between_nodes(
    model, gradients=_UNSET, weights: str = "int8", block=_UNSET, threshold=_UNSET, *, compression=_UNSET
) -> list:
    """Give every FSDP module of `model` a two-hop reduce-scatter and all-gather whose hop between
    nodes carries the gradients as `compression` says and the parameters as `weights`; returns the
    modules.

    compression: how the gradients travel between nodes, as the DDP hooks, the communicator, the
        optimizer and DiLoCo take it: None (float32), a dict of GradientCompression's settings
        ({"code": "int8"}, the default; any code of torch_chainermn.codes with its `block`,
        `threshold`, `keep`; with error feedback), or a GradientCompression(State), whose settings are
        used (not its group or residuals). compress_result and result_dtype do not apply: each rank
        decodes its own shard, no sums travel back.
    gradients: compression's old spelling, a code name or "float32" (deprecated).
    weights: how the parameters travel between nodes, a code's name: "float32" or a code that keeps
        each block's scale (WEIGHTS: "int8", ZeRO++'s qwZ, or "4bit"; blocks of `block` values, no
        error feedback).
    block: the int8 weights' values per scale (default: the gradients' block, else 256), and the
        gradients' where a dict or gradients= does not say; threshold: 2-bit's, likewise.

    Collective over the modules' shard groups (the hops' sub-groups are made here, by every member
    alike). The ranks' settings are compared first (one small all-gather a shard group): a setting
    that differs between ranks, or a bad argument on any rank (an unknown code, `block < 1`,
    `threshold <= 0`, ...), raises the same ValueError on every rank, naming the setting and each
    rank's value. A model with no FSDP module, or a shard group that is not a chainermn group, raises
    a clear ValueError at once.
    """
    op = "torch_chainermn.fsdp.compress_between_nodes"
    try:
        compression, spelling = deprecated_spelling(
            op,
            "compression",
            "gradients",
            compression,
            gradients,
            unset=_UNSET,
            how='{"code": code}, or None for "float32"',
        )
        mine = _settings(op, compression, spelling, weights, block, threshold)
    except ValueError as error:  # raised below on every rank, once the ranks have compared notes
        mine = error
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(f"{op}: the model has no FSDP module (apply torch.distributed.fsdp.fully_shard first)")
    groups = {}  # the distinct shard groups, in order of first sight
    for module in modules:
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            group = param_group.mesh_info.shard_process_group
            backend_of(group, op)  # a chainermn group, or a clear error
            groups.setdefault(id(group), group)

    def describe() -> dict:
        if isinstance(mine, ValueError):
            raise mine
        return mine

    # A rank whose settings differ would code its gradients in a way its peers do not decode as it
    # meant: a wrong result without an error (the codes' wire sizes often agree). Once, here.
    for group in groups.values():
        agreed = agree_on_settings(group, op, describe)
    for module in modules:
        reduce_scatter = TwoHopReduceScatter(agreed["code"], agreed["block"], agreed["threshold"], agreed["keep"])
        for param_group in module._get_fsdp_state()._fsdp_param_groups:
            group = param_group.mesh_info.shard_process_group
            levels = levels_of(group, op)
            if levels.two_hops:
                shard = sum(p.padded_sharded_param_size.numel() for p in param_group.fsdp_params)
                reduce_scatter.reserve(levels.nodes, shard, param_group.device)
        module.set_custom_reduce_scatter(reduce_scatter)
        module.set_custom_all_gather(TwoHopAllGather(agreed["weights"], agreed["weights' block"]))
    return modules


def _settings(op: str, compression, spelling: str, weights: str, block, threshold) -> dict:
    """Every setting of compress_between_nodes, checked: what the ranks compare."""
    if spelling == "gradients":
        if compression not in GRADIENTS:
            raise ValueError(f"{op}: gradients must be one of {GRADIENTS}, got {compression!r}")
        compression = None if compression == "float32" else {"code": compression}
    elif compression is _UNSET:
        compression = {"code": "int8"}
    if weights not in WEIGHTS:
        raise ValueError(f"{op}: weights must be one of {WEIGHTS}, got {weights!r}")
    given = {name: value for name, value in (("block", block), ("threshold", threshold)) if value is not _UNSET}
    coded = compression_settings(compression, op, defaults=given)
    if coded is None:
        coded = {"code": "float32", "threshold": 0.5, "block": 256, "keep": 8}
    elif coded["compress_result"] is not False or coded["result_dtype"] != torch.float32:
        raise ValueError(
            f"{op}: compression's compress_result and result_dtype do not apply to FSDP2 (each rank "
            f"decodes its own shard, no sums travel back), got compress_result="
            f"{coded['compress_result']!r}, result_dtype={coded['result_dtype']}"
        )
    weights_block = given.get("block", coded["block"])
    if weights != "float32":
        codes.check_settings(op, weights, given.get("threshold", 0.5), weights_block)
    return {
        "code": coded["code"],
        "threshold": float(coded["threshold"]),
        "block": coded["block"],
        "keep": coded["keep"],
        "weights": weights,
        "weights' block": weights_block,
    }


def two_hop(model) -> list:
    """compress_between_nodes(model, compression=None, weights="float32"): two hops at full precision."""
    return compress_between_nodes(model, compression=None, weights="float32")


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
                out[name or "."] = DTensor.from_local(
                    local, mesh, [Shard(d) for d in range(mesh.ndim)], run_check=False
                )
    return out


def load_state_dict(model, state: dict) -> None:
    """Put the residuals of a state_dict(model) back (a no-op for entries that torch.distributed.
    checkpoint already loaded in place). A clear ValueError for a module that is missing on either
    side or a residual of another shape."""
    mine = state_dict(model)
    if set(mine) != set(state):
        raise ValueError(
            f"torch_chainermn.fsdp.load_state_dict: the state has residuals for {sorted(state)}, "
            f"the model's coded modules are {sorted(mine)}"
        )
    for name, live in mine.items():
        saved = state[name].to_local() if isinstance(state[name], DTensor) else state[name]
        if saved.shape != live.to_local().shape:
            raise ValueError(
                f"torch_chainermn.fsdp.load_state_dict: {name!r}: the saved residual has shape "
                f"{tuple(saved.shape)}, this rank's is {tuple(live.to_local().shape)}"
            )
        if saved.data_ptr() != live.to_local().data_ptr():
            live.to_local().copy_(saved)
