"""The `chainermn` backend's creator, called by torch.distributed for every group that uses it."""

import functools
import types

import torch
import torch.distributed as dist

from . import _C, settings
from ._instance import instance_store
from ._launch import mpi_launched
from .options import Options


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
    """Creator registered with torch.distributed (extended API); pg_options is a torch_chainermn.Options."""
    if pg_options is None:
        pg_options = Options()
    elif not isinstance(pg_options, Options):
        raise ValueError(f"chainermn: pg_options must be torch_chainermn.Options, got {type(pg_options).__name__}")
    rank, size = dist_options.group_rank, dist_options.group_size
    global_ranks = list(dist_options.global_ranks_in_group) or list(range(size))
    global_rank = global_ranks[rank]
    world_size = dist.get_world_size() if dist.is_initialized() else size
    timeout = dist_options.timeout
    # Every key below, and those C++ writes (host names, segment names, NCCL ids), and the inner Gloo
    # groups' keys, live under this instance of the group only: see _instance.py.
    store, _ = instance_store(dist_options.store, rank, size, timeout)

    requested = pg_options.transport
    usable, why_not = _mpi_usable(world_size, global_rank) if requested != "gloo" else (False, "")
    if requested == "mpi" and not usable:
        raise RuntimeError(f"CHAINERMN_TRANSPORT=mpi, but MPI cannot be used: {why_not}")
    transport = _agree_on_transport(store, rank, size, "mpi" if usable else "gloo")
    topology = _C.discover_topology(store, rank, size, settings.node_name(global_rank))

    setup = _C.GroupSetup(store, rank, size, timeout, dist_options.group_id, topology)
    setup.shm_chunk_bytes = settings.shm_chunk_bytes()
    window, margin_ms, warn = settings.stragglers()
    setup.set_stragglers(window, margin_ms, warn)
    setup.global_ranks = global_ranks
    if transport == "mpi":
        setup.use_mpi(global_ranks)
    else:
        # Called by the backend for each level it needs (world, this node, this intra rank across nodes).
        setup.use_gloo(
            lambda key, level_rank, level_size: dist.ProcessGroupGloo(
                dist.PrefixStore(f"chainermn/gloo/{key}/", store), level_rank, level_size, timeout
            )
        )
    backend = _C.ProcessGroupChainerMN(setup, pg_options.to_cpp())
    backend._set_splitter(_splitter(global_ranks))
    return backend


def _splitter(global_ranks: list[int]):
    """What the backend calls for torch's split_group: a child group over some of this group's ranks,
    created as torch creates any group (a new key space in `store`, the host library agreed on)."""

    def split(store, rank, ranks, timeout, name, options):
        child = types.SimpleNamespace(
            store=store,
            group_rank=rank,
            group_size=len(ranks),
            global_ranks_in_group=[global_ranks[r] for r in ranks],
            timeout=timeout,
            group_id=name,
        )
        return create_backend(child, Options.from_cpp(options))

    return split


def get_options(group=None) -> Options:
    """The Options a chainermn group was created with."""
    return Options.from_cpp(backend_of(group, "get_options").group_options)


def wire_dtype_of(group=None, op: str = "chainermn"):
    """The group's allreduce_grad_dtype as a torch.dtype, or None (each gradient's own dtype)."""
    return backend_of(group, op).group_options.allreduce_grad_dtype


_DEVICES = ["cpu", "cuda"]  # the device types a chainermn group serves


def _serving_every_device(create_shrunk):
    """torch's shrink_group puts the new backend in a ProcessGroup for one device type only (the
    group's bound device, else the CPU: an NCCL group serves one); a chainermn group serves CPU and
    CUDA tensors alike, as the group it was shrunk from did. Wraps torch's `_create_shrunk_process_group`
    so that a chainermn backend is registered for both; other backends' groups are left as torch made
    them."""

    @functools.wraps(create_shrunk)
    def create(new_backend, *args, **kwargs):
        group = create_shrunk(new_backend, *args, **kwargs)
        if isinstance(new_backend, _C.ProcessGroupChainerMN):
            for device in map(torch.device, _DEVICES):
                try:
                    group._get_backend(device)
                except RuntimeError:  # not registered for this device type
                    group._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, new_backend)
        return group

    create.serves_every_device = True
    return create


def register() -> None:
    dist.Backend.register_backend("chainermn", create_backend, extended_api=True, devices=_DEVICES)
    c10d = dist.distributed_c10d
    create_shrunk = getattr(c10d, "_create_shrunk_process_group", None)
    if create_shrunk is not None and not getattr(create_shrunk, "serves_every_device", False):
        c10d._create_shrunk_process_group = _serving_every_device(create_shrunk)


def backend_of(group=None, op: str = "chainermn"):
    """The ProcessGroupChainerMN behind `group` (None, a ProcessGroup or a communicator), or a clear error."""
    group = group_of(group, op)
    backend = _unwrapped(group._get_backend(torch.device("cpu")))
    if not isinstance(backend, _C.ProcessGroupChainerMN):
        raise ValueError(f"{op}: the group does not use the chainermn backend (it uses {backend.name()})")
    return backend


def _unwrapped(backend):
    """The backend inside the wrappers torch may put around it: TORCH_DISTRIBUTED_DEBUG=DETAIL wraps
    every backend in a _ProcessGroupWrapper that checks collectives before passing them on."""
    for _ in range(8):  # wrappers do not nest deeper than this; a cycle must not hang
        inner = getattr(backend, "wrapped_pg", None)
        if isinstance(backend, _C.ProcessGroupChainerMN) or inner is None:
            break
        backend = inner
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
    raise ValueError(
        f"{op}: comm must be None, a ProcessGroup or a torch_chainermn communicator, got {type(comm).__name__}"
    )
