"""Launch support: make `dist.init_process_group("chainermn")` work under mpiexec with no extra environment.

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for env:// rendezvous. mpiexec sets none of
them, so when this process was started by mpiexec we take rank and size from MPI and let rank 0 choose
the store's address, which MPI broadcasts to every rank.
"""
import atexit
import os
import socket

from . import _C


def mpi_launched() -> bool:
    """True when this process was started by mpiexec/mpirun and the extension was built with MPI."""
    return bool(_C.mpi_built) and _C.mpi_launched()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _store_host() -> str:
    # Every rank on this host: loopback always works. Otherwise an address the other hosts can reach.
    local_size = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
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
    address = ""
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or _store_host()
        port = os.environ.get("MASTER_PORT") or str(_free_port())
        address = f"{host}:{port}"
    host, port = _C.mpi_broadcast_string(address, 0).rsplit(":", 1)
    os.environ.setdefault("MASTER_ADDR", host)
    os.environ.setdefault("MASTER_PORT", port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(size)
    os.environ.setdefault("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
