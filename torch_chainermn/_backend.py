"""The `chainermn` backend's creator, called by torch.distributed for every group that uses it."""
import os

import torch.distributed as dist

from . import _C
from ._launch import mpi_launched

TRANSPORTS = ("auto", "mpi", "gloo")


def _requested_transport() -> str:
    requested = os.environ.get("CHAINERMN_TRANSPORT", "auto").lower()
    if requested not in TRANSPORTS:
        raise ValueError(f"CHAINERMN_TRANSPORT must be one of {', '.join(TRANSPORTS)}, got {requested!r}")
    return requested


def _mpi_usable(world_size: int, global_rank: int) -> tuple[bool, str]:
    """Whether this process can use MPI for a group, and why not."""
    if not _C.mpi_built:
        return False, "the extension was built without MPI"
    if not mpi_launched():
        return False, "the process was not started by mpiexec"
    _C.mpi_initialize()
    if not _C.mpi_thread_multiple():
        return False, "MPI does not provide MPI_THREAD_MULTIPLE"
    if (_C.mpi_world_size(), _C.mpi_world_rank()) != (world_size, global_rank):
        return False, "torch's ranks are not MPI's ranks"
    return True, ""


def _agree_on_transport(store, rank: int, size: int, mine: str) -> str:
    """Every rank of a group must use the same transport: MPI only if all ranks can."""
    store.set(f"chainermn/transport/{rank}", mine)
    choices = {store.get(f"chainermn/transport/{r}").decode() for r in range(size)}
    return "mpi" if choices == {"mpi"} else "gloo"


def create_backend(dist_options, pg_options=None):
    """Creator registered with torch.distributed (extended API)."""
    store = dist_options.store
    rank, size = dist_options.group_rank, dist_options.group_size
    global_ranks = list(dist_options.global_ranks_in_group) or list(range(size))
    global_rank = global_ranks[rank]
    world_size = dist.get_world_size() if dist.is_initialized() else size
    timeout = dist_options.timeout
    group_name = dist_options.group_id

    requested = _requested_transport()
    usable, why_not = _mpi_usable(world_size, global_rank) if requested != "gloo" else (False, "")
    if requested == "mpi" and not usable:
        raise RuntimeError(f"CHAINERMN_TRANSPORT=mpi, but MPI cannot be used: {why_not}")
    transport = _agree_on_transport(store, rank, size, "mpi" if usable else "gloo")

    if transport == "mpi":
        return _C.ProcessGroupChainerMN.with_mpi(
            store, rank, size, timeout, global_rank, group_name, global_ranks
        )
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("chainermn/gloo/", store), rank, size, timeout)
    return _C.ProcessGroupChainerMN.with_gloo(store, rank, size, timeout, global_rank, group_name, gloo)


def register() -> None:
    dist.Backend.register_backend("chainermn", create_backend, extended_api=True, devices=["cpu", "cuda"])


def backend_of(group=None, op: str = "chainermn"):
    """The ProcessGroupChainerMN behind `group` (default: the default group), or a clear error."""
    if not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialized; call dist.init_process_group first")
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{op}: this rank is not a member of the given group")
    import torch

    backend = group._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.ProcessGroupChainerMN):
        raise ValueError(f"{op}: the group does not use the chainermn backend (it uses {backend.name()})")
    return backend
