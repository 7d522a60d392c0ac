"""torch-chainermn: ChainerMN's data-parallel training for PyTorch.

Importing this package registers the torch.distributed backend "chainermn":

    import torch.distributed as dist
    import torch_chainermn
    dist.init_process_group("chainermn")   # under torchrun, or mpiexec with no extra environment
"""
import torch  # noqa: F401  (loads libtorch before our extension)
import torch.distributed  # noqa: F401

from . import _C, _backend, _launch
from ._C import Topology
from ._backend import get_options
from .gradients import mean_coalesced
from .options import Options
from .topology import topology

__version__ = "0.1.0"
__all__ = ["Options", "Topology", "get_options", "mean_coalesced", "topology", "transport"]


def transport(group=None) -> str:
    """The library that carries `group`'s traffic on this rank: "mpi" or "gloo"."""
    return _backend.backend_of(group, "transport").transport


_launch.prepare_mpiexec_environment()
_backend.register()
