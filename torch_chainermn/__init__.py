"""torch-chainermn: ChainerMN's data-parallel training for PyTorch.

Importing this package registers the torch.distributed backend "chainermn":

    import torch.distributed as dist
    import torch_chainermn
    dist.init_process_group("chainermn")   # under torchrun, or mpiexec with no extra environment
"""

import atexit
import importlib

import torch  # noqa: F401  (loads libtorch before our extension)
import torch.distributed  # noqa: F401

# What the backend's registration needs is imported now; every feature the first time it is used.
from . import _C, _backend, _launch, global_except_hook
from ._C import Topology
from ._backend import get_options
from ._topology import node_group, topology
from ._version import __version__
from .options import Options

# The features, imported on first use (PEP 562's module __getattr__): `torch_chainermn.hooks`,
# `from torch_chainermn import DiLoCo` and `torch_chainermn.DiLoCo` work as if imported here, and a
# process that never trains with DiLoCo never loads torch.distributed.checkpoint (0.5 s of CPU a rank).
_FROM_MODULE = {
    "codes": ("CompressionSpec",),
    "communicator": ("Communicator", "create_communicator"),
    "datasets": ("create_empty_dataset", "scatter_dataset"),
    "extensions": (
        "AllreducePersistent",
        "create_multi_node_checkpoint",
        "create_multi_node_checkpointer",
        "create_multi_node_evaluator",
    ),
    "gradients": ("mean_coalesced",),
    "iterators": ("create_multi_node_iterator", "create_synchronized_iterator"),
    "local_sgd": ("DiLoCo", "LocalSGD"),
    "links": ("MultiNodeChainList", "create_multi_node_n_step_rnn"),
    "monitoring": ("monitored_barrier",),
    "observability": ("counters", "reset_counters", "stragglers"),
    "nn": (
        "MultiNodeBatchNorm1d",
        "MultiNodeBatchNorm2d",
        "MultiNodeBatchNorm3d",
        "convert_mnbn_model",
        "create_mnbn_model",
    ),
    "optimizers": ("create_multi_node_optimizer",),
    "overlap": ("OverlapNextForward",),
}
_MODULE_OF = {name: module for module, names in _FROM_MODULE.items() for name in names}
_SUBMODULES = (
    "communicator",
    "datasets",
    "extensions",
    "functions",
    "global_except_hook",
    "hooks",
    "iterators",
    "links",
    "nn",
)

__all__ = [
    "Options",
    "Topology",
    "__version__",
    "get_options",
    "node_group",
    "topology",
    "transport",
    *_SUBMODULES,
    *_MODULE_OF,
]


def __getattr__(name):
    """A feature's name (DiLoCo) or any submodule (hooks, codes, fsdp), imported the first time it is asked for."""
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
        globals()[name] = value  # found directly from now on
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f".{name}", __name__)  # importing sets it on the package
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise  # the submodule is there but needs what is missing (torchft without torchft)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def transport(group=None) -> str:
    """The library that carries `group`'s traffic on this rank: "mpi" or "gloo"."""
    return _backend.backend_of(group, "transport").transport


_launch.prepare_environment()  # torchrun's variables, else mpiexec's or srun's
_backend.register()
global_except_hook._install_from_environment()  # CHAINERMN_FORCE_ABORT_ON_EXCEPTION
# Finish and stop the groups' worker threads while the interpreter can still serve them (see
# stopWorkersAtExit in csrc/runtime/worker.h). Registered last, so it runs before MPI_Finalize.
atexit.register(_C.stop_workers_at_exit)
