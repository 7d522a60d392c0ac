"""The `chainermn` backend's creator, called by torch.distributed for every group that uses it."""
import os

import torch
import torch.distributed as dist

from . import _C
from ._launch import mpi_launched
from .options import Options, _dtype_name, _wire_dtype

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


def _shared_memory_enabled() -> bool:
    """CHAINERMN_SHM=0 turns the intra-node shared-memory path off (it is on by default)."""
    value = os.environ.get("CHAINERMN_SHM", "1")
    if value not in ("0", "1"):
        raise ValueError(f"CHAINERMN_SHM must be 0 or 1, got {value!r}")
    return value == "1"


def _cuda_transport() -> str:
    """CHAINERMN_CUDA_TRANSPORT: how CUDA tensors travel (nccl, nccl_intra or staged; default nccl)."""
    value = os.environ.get("CHAINERMN_CUDA_TRANSPORT", "nccl").lower()
    if value not in _C.cuda_transports:
        raise ValueError(f"CHAINERMN_CUDA_TRANSPORT must be one of {', '.join(_C.cuda_transports)}, got {value!r}")
    return value


def _agree_on_transport(store, rank: int, size: int, mine: str) -> str:
    """Every rank of a group must use the same transport: MPI only if all ranks can."""
    store.set(f"chainermn/transport/{rank}", mine)
    choices = {store.get(f"chainermn/transport/{r}").decode() for r in range(size)}
    return "mpi" if choices == {"mpi"} else "gloo"


def _gloo(store, prefix: str, rank: int, size: int, timeout):
    return dist.ProcessGroupGloo(dist.PrefixStore(f"chainermn/gloo/{prefix}/", store), rank, size, timeout)


def _gloo_levels(store, topology, timeout):
    """Gloo groups for the world, this node (intra) and this intra rank across nodes (inter)."""
    world = _gloo(store, "world", topology.rank, topology.size, timeout)
    intra = world
    if topology.inter_size > 1:
        intra = _gloo(store, f"intra/{topology.inter_rank}", topology.intra_rank, topology.intra_size, timeout)
    inter = world
    if topology.inter_size < topology.size:  # not one rank per node
        peers = [node[topology.intra_rank] for node in topology.ranks_of_node if len(node) > topology.intra_rank]
        inter = _gloo(store, f"inter/{topology.intra_rank}", peers.index(topology.rank), len(peers), timeout)
    return world, intra, inter


def create_backend(dist_options, pg_options=None):
    """Creator registered with torch.distributed (extended API); pg_options is a torch_chainermn.Options."""
    if pg_options is None:
        pg_options = Options()
    elif not isinstance(pg_options, Options):
        raise ValueError(f"chainermn: pg_options must be torch_chainermn.Options, got {type(pg_options).__name__}")
    store = dist_options.store
    rank, size = dist_options.group_rank, dist_options.group_size
    global_ranks = list(dist_options.global_ranks_in_group) or list(range(size))
    global_rank = global_ranks[rank]
    world_size = dist.get_world_size() if dist.is_initialized() else size
    timeout = dist_options.timeout
    group_name = dist_options.group_id
    communicator = pg_options.communicator
    wire_dtype = _dtype_name(pg_options.allreduce_grad_dtype)
    shared_memory = _shared_memory_enabled()
    cuda_transport = _cuda_transport()

    requested = _requested_transport()
    usable, why_not = _mpi_usable(world_size, global_rank) if requested != "gloo" else (False, "")
    if requested == "mpi" and not usable:
        raise RuntimeError(f"CHAINERMN_TRANSPORT=mpi, but MPI cannot be used: {why_not}")
    transport = _agree_on_transport(store, rank, size, "mpi" if usable else "gloo")
    topology = _C.discover_topology(store, rank, size, global_rank)

    if transport == "mpi":
        return _C.ProcessGroupChainerMN.with_mpi(
            store, rank, size, timeout, group_name, topology, global_ranks, communicator, wire_dtype, shared_memory,
            cuda_transport)
    world, intra, inter = _gloo_levels(store, topology, timeout)
    return _C.ProcessGroupChainerMN.with_gloo(
        store, rank, size, timeout, group_name, topology, world, intra, inter, communicator, wire_dtype,
        shared_memory, cuda_transport)


def get_options(group=None) -> Options:
    """The Options a chainermn group was created with."""
    backend = backend_of(group, "get_options")
    options = Options(backend.communicator)
    # Set directly: Options() would read CHAINERMN_ALLREDUCE_GRAD_DTYPE for a group created without one.
    options._allreduce_grad_dtype = _wire_dtype(backend.allreduce_grad_dtype)
    return options


def wire_dtype_of(group=None, op: str = "chainermn"):
    """The group's allreduce_grad_dtype as a torch.dtype, or None (each gradient's own dtype)."""
    return _wire_dtype(backend_of(group, op).allreduce_grad_dtype)


def register() -> None:
    dist.Backend.register_backend("chainermn", create_backend, extended_api=True, devices=["cpu", "cuda"])


def backend_of(group=None, op: str = "chainermn"):
    """The ProcessGroupChainerMN behind `group` (None, a ProcessGroup or a communicator), or a clear error."""
    group = group_of(group, op)
    backend = group._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.ProcessGroupChainerMN):
        raise ValueError(f"{op}: the group does not use the chainermn backend (it uses {backend.name()})")
    return backend


def group_of(comm=None, op: str = "chainermn"):
    """The process group a toolkit call works on.

    `comm` may be None (the default group), a ProcessGroup, or a torch_chainermn communicator
    (anything with a `group` attribute holding its ProcessGroup), as ChainerMN's functions take
    a communicator where torch's take a group.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialized; call dist.init_process_group first")
    if comm is None:
        return dist.distributed_c10d._get_default_group()
    if comm is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{op}: this rank is not a member of the given group")
    if isinstance(comm, dist.ProcessGroup):
        return comm
    group = getattr(comm, "group", None)
    if isinstance(group, dist.ProcessGroup):
        return group
    raise ValueError(f"{op}: comm must be None, a ProcessGroup or a torch_chainermn communicator, "
                     f"got {type(comm).__name__}")
