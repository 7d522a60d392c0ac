"""torch-chainermn: ChainerMN's data-parallel training for PyTorch.

Importing this package registers the torch.distributed backend "chainermn":

    import torch.distributed as dist
    import torch_chainermn
    dist.init_process_group("chainermn")   # under torchrun, or mpiexec with no extra environment
"""
import atexit

import torch  # noqa: F401  (loads libtorch before our extension)
import torch.distributed  # noqa: F401

from . import _C, _backend, _launch, communicator, datasets, extensions, functions, global_except_hook, hooks, iterators, links, nn
from ._C import Topology
from ._backend import get_options
from ._version import __version__
from .communicator import Communicator, create_communicator
from .datasets import create_empty_dataset, scatter_dataset
from .extensions import (AllreducePersistent, create_multi_node_checkpoint, create_multi_node_checkpointer,
                         create_multi_node_evaluator)
from .gradients import mean_coalesced
from .iterators import create_multi_node_iterator, create_synchronized_iterator
from .local_sgd import DiLoCo, LocalSGD
from .links import MultiNodeChainList, create_multi_node_n_step_rnn
from .monitoring import monitored_barrier
from .nn import (MultiNodeBatchNorm1d, MultiNodeBatchNorm2d, MultiNodeBatchNorm3d, convert_mnbn_model,
                 create_mnbn_model)
from .optimizers import create_multi_node_optimizer
from .options import Options
from .overlap import OverlapNextForward
from ._topology import node_group, topology

__all__ = [
    "OverlapNextForward",
    "AllreducePersistent", "Communicator", "DiLoCo", "LocalSGD", "MultiNodeBatchNorm1d", "MultiNodeBatchNorm2d", "MultiNodeBatchNorm3d",
    "Options", "Topology", "communicator", "convert_mnbn_model", "create_communicator", "create_empty_dataset",
    "create_mnbn_model", "create_multi_node_checkpoint", "create_multi_node_checkpointer",
    "create_multi_node_evaluator", "create_multi_node_iterator", "create_multi_node_n_step_rnn",
    "create_multi_node_optimizer", "create_synchronized_iterator", "datasets", "extensions", "functions",
    "get_options", "global_except_hook", "hooks", "iterators", "links", "mean_coalesced", "monitored_barrier",
    "MultiNodeChainList", "nn", "node_group", "scatter_dataset", "topology", "transport",
]


def transport(group=None) -> str:
    """The library that carries `group`'s traffic on this rank: "mpi" or "gloo"."""
    return _backend.backend_of(group, "transport").transport


_launch.prepare_environment()  # torchrun's variables, else mpiexec's or srun's
_backend.register()
global_except_hook._install_from_environment()  # CHAINERMN_FORCE_ABORT_ON_EXCEPTION
# Finish and stop the groups' worker threads while the interpreter can still serve them (see
# stopWorkersAtExit in csrc/runtime/worker.h). Registered last, so it runs before MPI_Finalize.
atexit.register(_C.stop_workers_at_exit)
