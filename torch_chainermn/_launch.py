"""Launch support: how this process was started, decided once, and `dist.init_process_group("chainermn")`
working under torchrun, mpiexec and srun with no extra environment.

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for env:// rendezvous. mpiexec sets none of
them, so when this process was started by mpiexec we take rank and size from MPI and let rank 0 choose
the store's address, which MPI broadcasts to every rank. srun sets none of them either: see _slurm.py.

`prepare_environment()` runs once, at import, and leaves the answer in one record (`record()`): the
launcher, the rank, the world size and this rank's place on its node. Everything that asks "who
started us?" (the communicator, the global except hook, the backend's choice of MPI, the benchmarks)
asks it; nothing else reads a launcher's variables.
"""

from __future__ import annotations

import atexit
import os
import socket
from typing import NamedTuple

from . import _C, _slurm

# What mpiexec/mpirun leaves in its ranks' environment: Open MPI, PMIx, and PMI (MPICH, Intel MPI).
_MPI_LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")
# Each MPI launcher's own names of (rank, size), for a process that cannot ask MPI (built without it).
_MPI_RANK_VARIABLES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", "PMIX_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
)


class Launch(NamedTuple):
    """How this process was started."""

    launcher: str  # "env" (env:// variables set: torchrun, or by hand), "mpiexec", "srun", "none"
    rendezvous: bool  # env://'s RANK/WORLD_SIZE are set: init_process_group needs nothing more
    rank: int | None  # global rank, where known
    world_size: int | None
    local_rank: int | None  # place on this node, where the launcher says it
    local_world_size: int | None

    def describe(self) -> tuple[str, str]:
        """(rank, size) as text for messages, "?" where unknown."""
        return ("?" if self.rank is None else str(self.rank), "?" if self.world_size is None else str(self.world_size))


_record: Launch | None = None


def _launcher(environ) -> str:
    """Who started this process. env:// variables already set win (torchrun, a user's own, or
    torchrun started by srun); then mpiexec (or srun --mpi=pmix, whose ranks are MPI's) when MPI is
    built in; then srun; then mpiexec without MPI built in (it fills in nothing)."""
    by_mpiexec = any(name in environ for name in _MPI_LAUNCH_VARIABLES)
    if "RANK" in environ and "MASTER_ADDR" in environ:
        return "env"
    if by_mpiexec and _C.mpi_built:
        return "mpiexec"
    if "RANK" not in environ and _slurm.launched(environ):
        return "srun"
    if by_mpiexec:
        return "mpiexec"
    return "env" if "RANK" in environ or "WORLD_SIZE" in environ else "none"


def _int(text) -> int | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


def _read(launcher: str, environ) -> Launch:
    rank, size = environ.get("RANK"), environ.get("WORLD_SIZE")
    if rank is None and launcher == "mpiexec":  # MPI not built in: the launcher's own names still say
        for rank_name, size_name in _MPI_RANK_VARIABLES:
            if rank_name in environ:
                rank, size = environ[rank_name], environ.get(size_name)
                break
    return Launch(
        launcher,
        "RANK" in environ or "WORLD_SIZE" in environ,
        _int(rank),
        _int(size),
        _int(environ.get("LOCAL_RANK")),
        _int(environ.get("LOCAL_WORLD_SIZE")),
    )


def prepare_environment() -> Launch:
    """Decide who started this process and fill in env://'s variables from that launcher (once, at
    import; what is set already wins). Returns the record that `record()` then answers with."""
    global _record
    launcher = _launcher(os.environ)
    if launcher == "mpiexec" and _C.mpi_built:
        _prepare_mpiexec_environment()
    elif launcher == "srun":
        _slurm.prepare_environment()
    _record = _read(launcher, os.environ)
    return _record


def record() -> Launch:
    """How this process was started (decided at import). torch reads env://'s variables only at
    init_process_group, so a program may still set them after importing us: that is seen here too."""
    if _record is None or (_record.launcher == "none" and ("RANK" in os.environ or "WORLD_SIZE" in os.environ)):
        return prepare_environment()
    return _record


def mpi_launched() -> bool:
    """True when this process was started by mpiexec/mpirun and the extension was built with MPI."""
    return bool(_C.mpi_built) and record().launcher == "mpiexec"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _local_rank_and_size() -> tuple:
    """This rank's place on its node under MPI: mpiexec says it; srun --mpi=pmix leaves it to Slurm."""
    if "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:
        return os.environ["OMPI_COMM_WORLD_LOCAL_RANK"], os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if _slurm.launched():
        return _slurm.local_rank_and_size()
    return "0", None


def _store_host(local_size) -> str:
    # Every rank on this host: loopback always works. Otherwise an address the other hosts can reach.
    if local_size is not None and int(local_size) == _C.mpi_world_size():
        return "127.0.0.1"
    return socket.getfqdn()


def _prepare_mpiexec_environment() -> None:
    """Under mpiexec, fill in the env:// variables from MPI (a collective over all MPI ranks)."""
    _C.mpi_initialize()
    atexit.register(_C.mpi_finalize)
    rank, size = _C.mpi_world_rank(), _C.mpi_world_size()
    local_rank, local_size = _local_rank_and_size()
    address = ""
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or _store_host(local_size)
        port = os.environ.get("MASTER_PORT") or str(_free_port())
        address = f"{host}:{port}"
    host, port = _C.mpi_broadcast_string(address, 0).rsplit(":", 1)
    os.environ.setdefault("MASTER_ADDR", host)
    os.environ.setdefault("MASTER_PORT", port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(size)
    os.environ.setdefault("LOCAL_RANK", local_rank)
    os.environ.setdefault("LOCAL_WORLD_SIZE", local_size or "1")
