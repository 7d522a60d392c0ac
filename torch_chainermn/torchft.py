"""torchft on chainermn: reconfigurable process groups for torchft's Manager, DDP, LocalSGD and DiLoCo.

torchft (PyTorch's fault-tolerance library) rebuilds a replica group's process group on every
quorum, through a wrapper class per backend; these are chainermn's, beside its ProcessGroupGloo and
ProcessGroupBabyGloo:

    from torch_chainermn.torchft import ProcessGroupChainerMN
    pg = ProcessGroupChainerMN(timeout=timedelta(seconds=10), options=torch_chainermn.Options(...))
    manager = torchft.Manager(pg=pg, ...)            # as with torchft.ProcessGroupGloo()

A failed replica's group is aborted by torchft (`pg.abort()`): on chainermn the peers' pending ops
then fail at once, naming it (docs/reliability.md). Importing this module needs torchft installed
(`pip install torchft`); `import torch_chainermn` does not import it.
"""

from __future__ import annotations

import types
from datetime import timedelta

import torch
from torch.distributed import ProcessGroup as BaseProcessGroup
from torchft.process_group import ProcessGroupBaby, ProcessGroupWrapper

from ._backend import create_backend
from .options import Options

__all__ = ["ProcessGroupBabyChainerMN", "ProcessGroupChainerMN"]


def _chainermn_process_group(
    store, rank: int, world_size: int, timeout: timedelta, options: Options, name: str
) -> BaseProcessGroup:
    """A torch ProcessGroup whose CPU (and CUDA) backend is a chainermn group on `store`."""
    group = types.SimpleNamespace(
        store=store,
        group_rank=rank,
        group_size=world_size,
        global_ranks_in_group=list(range(world_size)),
        timeout=timeout,
        group_id=name,
    )
    backend = create_backend(group, options)
    pg = BaseProcessGroup(store, rank, world_size)
    pg._set_default_backend(BaseProcessGroup.BackendType.CUSTOM)
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        pg._register_backend(torch.device(device), BaseProcessGroup.BackendType.CUSTOM, backend)
    return pg


def _broken(pg) -> Exception | None:
    """The chainermn group's failure as an exception (torchft's errored()), or None while it works."""
    if pg is None:
        return None
    reason = pg._get_backend(torch.device("cpu")).broken_reason()
    return RuntimeError(f"chainermn: {reason}") if reason else None


class ProcessGroupChainerMN(ProcessGroupWrapper):
    """torchft's reconfigurable process group on chainermn: every `configure()` (each quorum) makes
    a new chainermn group with `options` (torch_chainermn.Options; the environment's by default)."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60), options: Options | None = None) -> None:
        super().__init__(timeout)
        if options is not None and not isinstance(options, Options):
            raise ValueError(
                f"ProcessGroupChainerMN: options must be torch_chainermn.Options, got {type(options).__name__}"
            )
        self._options = options

    def _create_pg(self, store, rank: int, world_size: int) -> BaseProcessGroup:
        return _chainermn_process_group(
            store, rank, world_size, self._timeout, self._options or Options(), f"torchft_quorum_{self._quorum_id}"
        )

    def errored(self) -> Exception | None:
        """The group's failure (a timeout, a dead or aborting peer), which torchft's Manager checks
        before it commits a step, or None."""
        return _broken(self._pg)

    def shutdown(self) -> None:
        """Leaves the group: aborts it, so that the peers' pending and later ops fail within about a
        second naming this rank. torchft 0.2.0's wrapper only drops the group (its comment says it
        would abort it if it could); a chainermn group dropped so tells no one, and its peers would
        wait out the group timeout."""
        self.abort(errored=False)

    def getBackendName(self) -> str:
        return "torchft-chainermn"


class ProcessGroupBabyChainerMN(ProcessGroupBaby):
    """The same in a subprocess of its own (torchft's "baby" groups: a hung or failed group is killed
    with its process), CPU tensors, the environment's options."""

    @classmethod
    def _create_pg(cls, store, rank: int, world_size: int) -> BaseProcessGroup:
        return _chainermn_process_group(store, rank, world_size, timedelta(seconds=60), Options(), "torchft_baby")

    def getBackendName(self) -> str:
        return "torchft-baby-chainermn"
