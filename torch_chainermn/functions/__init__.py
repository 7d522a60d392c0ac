"""Model parallelism, the ChainerMN way: communication as differentiable functions.

    from torch_chainermn import functions as F
    phi = F.send(h, comm, rank=1)                       # a delegate variable
    y = F.recv(comm, rank=1, delegate_variable=phi)     # backward goes on to the send
    psi = F.pseudo_connect(phi, y)                      # y's values, backward through phi as well
    ys = F.allgather(comm, h)                           # and bcast, gather, scatter, alltoall

`comm` is a torch_chainermn Communicator, a chainermn ProcessGroup, or None (the default group).
Point to point: point_to_point.py (its wire format: ../messages/tensors.py); collectives:
collective_communication.py; pseudo_connect.py.
"""

from ..messages.tensors import drain
from .collective_communication import allgather, alltoall, bcast, gather, scatter
from .point_to_point import recv, send
from .pseudo_connect import pseudo_connect

__all__ = ["allgather", "alltoall", "bcast", "drain", "gather", "pseudo_connect", "recv", "scatter", "send"]
