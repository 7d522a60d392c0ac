"""FSDP2 between nodes: reduce-scatter and all-gather in two hops (ZeRO++'s layout, FSDP2's hooks).

    model = fully_shard(...)                     # as usual, on a chainermn group or DeviceMesh
    torch_chainermn.fsdp.compress_between_nodes(model, compression={"code": "int8"}, weights="int8")
    torch_chainermn.fsdp.two_hop(model)          # the same at full precision
    fsdp.state_dict(model) / load_state_dict(model, state)   # the residuals, for a checkpoint (DCP)

The residuals live in a torch_chainermn.residuals.ResidualStore, one a model, and their checkpoint
has the DDP side's format (GradientCompression.state_dict, residuals.py): the same keys and kinds.

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
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from .. import codes
from .._backend import backend_of
from .._means import compression_settings, deprecated_spelling
from ..messages.objects import agree_on_settings
from ..residuals import ResidualStore
from .all_gather import TwoHopAllGather
from .levels import levels_of
from .reduce_scatter import TwoHopReduceScatter, settings_of

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
    # One store for the model's residuals, each module's under its name (the checkpoint's holders).
    store = ResidualStore(settings_of(agreed["code"], agreed["block"], agreed["threshold"], agreed["keep"]))
    store.name_parameters(model)
    names = {id(m): name or "." for name, m in model.named_modules()}
    for module in modules:
        reduce_scatter = TwoHopReduceScatter(
            agreed["code"], agreed["block"], agreed["threshold"], agreed["keep"], store=store, holder=names[id(module)]
        )
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


def _holders(model) -> list:
    """(module name, param group, its coded reduce-scatter) of every FSDP param group with a residual."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            for param_group in module._get_fsdp_state()._fsdp_param_groups:
                comm = param_group._reduce_scatter_comm
                if isinstance(comm, TwoHopReduceScatter) and comm.residual is not None:
                    out.append((name or ".", param_group, comm))
    return out


def _by_rank(holders) -> dict:
    """{module name: its live residual as a DTensor over the module's mesh, sharded by rank}."""
    out = {}
    for name, param_group, comm in holders:
        mesh = param_group.mesh_info.mesh
        local = comm.residual.view((1,) * mesh.ndim + tuple(comm.residual.shape))
        out[name] = DTensor.from_local(local, mesh, [Shard(d) for d in range(mesh.ndim)], run_check=False)
    return out


def _pieces(param_group, op: str):
    """(its parameter, the [start, end) of its padded shard in the group's flat shard) of each
    parameter of the param group (FSDP lays the shards out end to end, each padded)."""
    offset = 0
    for fsdp_param in param_group.fsdp_params:
        if fsdp_param.fsdp_placement.dim != 0:
            raise ValueError(f"{op}: the residuals' sums take parameters sharded on dim 0, got {fsdp_param}")
        size = fsdp_param.padded_sharded_param_size
        yield fsdp_param.sharded_param, size, offset
        offset += size.numel()


def state_dict(model, by_rank: bool = True) -> dict:
    """The gradient codes' residuals in the DDP side's format (residuals.py; GradientCompression.
    state_dict): {"settings", "residuals", "by_rank"}; {} where no module is coded.

    "residuals": per parameter, by its name in `model`, what the nodes still owe it summed over the
    nodes: a DTensor placed as the parameter (DCP reshards it: a run resumed on other ranks takes
    it). "by_rank" (by_rank=True): per FSDP module, by its name, a DTensor over the module's mesh,
    sharded by rank, whose local part is the live residual (as a model's state_dict holds its
    parameters): a run resumed on the same ranks continues exactly. Collective over the modules'
    shard groups (every rank calls it, as DCP's save does)."""
    op = "torch_chainermn.fsdp.state_dict"
    holders = _holders(model)
    if not holders:
        return {}
    store = holders[0][2].store
    names = {id(p): name for name, p in model.named_parameters()}
    residuals = {}
    for _, param_group, comm in holders:
        if comm.store.settings != store.settings:
            raise ValueError(f"{op}: the modules' codes differ ({store.settings}, {comm.store.settings})")
        levels = levels_of(param_group.mesh_info.shard_process_group, op)
        owed = torch.empty(comm.residual.shape[1], dtype=torch.float32, device=comm.residual.device)
        # Row m of rank (n, l)'s residual is what node n owes rank (m, l)'s shard: summed over n on it.
        dist.reduce_scatter_tensor(owed, comm.residual.reshape(-1), group=levels.inter)
        for param, size, offset in _pieces(param_group, op):
            local = owed[offset : offset + size.numel()].view(size)[: param.to_local().shape[0]].clone()
            residuals[names[id(param)]] = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
    return store.state(residuals, _by_rank(holders) if by_rank else None)


def load_state_dict(model, state: dict) -> None:
    """Put the residuals of a state_dict(model) back: "by_rank" where the state has it (a no-op for
    what torch.distributed.checkpoint loaded in place), else the sums, every node's debt given to
    the first node, on any ranks (a DDP side's state_dict keyed by names, too). Collective for the
    sums. A clear ValueError for other settings, a module missing on either side or a residual of
    another shape. (A state of before the one format, {module name: DTensor}, loads as "by_rank".)"""
    op = "torch_chainermn.fsdp.load_state_dict"
    holders = _holders(model)
    if not isinstance(state.get("settings"), dict):  # the format of before: by_rank alone
        exact = state
    else:
        if holders:
            holders[0][2].store.check(state, op)
        exact = state.get("by_rank")
    if exact is None:
        _place_sums(model, holders, state["residuals"], op)
        return
    mine = _by_rank(holders)
    if set(mine) != set(exact):
        raise ValueError(
            f"{op}: the state has residuals for {sorted(exact)}, the model's coded modules are {sorted(mine)}"
        )
    for name, live in mine.items():
        saved = exact[name].to_local() if isinstance(exact[name], DTensor) else exact[name]
        if saved.shape != live.to_local().shape:
            raise ValueError(
                f"{op}: {name!r}: the saved residual has shape "
                f"{tuple(saved.shape)}, this rank's is {tuple(live.to_local().shape)}"
            )
        if saved.data_ptr() != live.to_local().data_ptr():
            live.to_local().copy_(saved)


def _place_sums(model, holders, sums: dict, op: str) -> None:
    """The first node's ranks owe every node's debt (the sums, by parameter name), the others nothing."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    names = {id(p): name for name, p in model.named_parameters()}
    for _, param_group, comm in holders:
        levels = levels_of(param_group.mesh_info.shard_process_group, op)
        nodes, shard = comm.residual.shape
        mine = torch.zeros(shard, dtype=torch.float32, device=comm.residual.device)
        for param, size, offset in _pieces(param_group, op):
            name = names[id(param)]
            if name not in sums:
                raise ValueError(f"{op}: the state has no residual for parameter {name!r}")
            value = sums[name]
            if isinstance(value, DTensor):
                local = value.to_local()
            else:  # the same on every rank (the DDP side's): this rank's part, as the parameter's
                shape, start = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                local = value.reshape(param.shape)[tuple(slice(o, o + n) for o, n in zip(start, shape))]
            mine[offset : offset + size.numel()].view(size)[: local.shape[0]].copy_(local)
        gathered = torch.empty(nodes * shard, dtype=torch.float32, device=comm.residual.device)
        dist.all_gather_into_tensor(gathered, mine, group=levels.inter)
        if levels.node == 0:
            comm.residual.copy_(gathered.view(nodes, shard))
        else:
            comm.residual.zero_()
