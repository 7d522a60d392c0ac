"""Launch support: make `dist.init_process_group("chainermn")` work under torchrun, mpiexec and srun
with no extra environment.

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for env:// rendezvous. mpiexec sets none of
them, so when this process was started by mpiexec we take rank and size from MPI and let rank 0 choose
the store's address, which MPI broadcasts to every rank. srun sets none of them either: see _slurm.py.
"""
import atexit
import os
import socket

from . import _C, _slurm


def prepare_environment() -> None:
    """Fill in env://'s variables from the launcher, once, at import.

    What is set wins (torchrun, or a user's own RANK/MASTER_ADDR; torchrun started by srun is torchrun).
    Then MPI: mpiexec, or srun --mpi=pmix, whose ranks are MPI's and meet over MPI. Then Slurm's srun.
    """
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        return
    if mpi_launched():
        prepare_mpiexec_environment()
    elif "RANK" not in os.environ:
        _slurm.prepare_environment()


def mpi_launched() -> bool:
    """True when this process was started by mpiexec/mpirun and the extension was built with MPI."""
    return bool(_C.mpi_built) and _C.mpi_launched()


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


def prepare_mpiexec_environment() -> None:
    """Under mpiexec, fill in the env:// variables from MPI (a collective over all MPI ranks)."""
    if not mpi_launched() or "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        return
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
