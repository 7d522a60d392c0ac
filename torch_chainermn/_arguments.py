"""Argument checks shared by the model-parallel functions and links: communicators, ranks, tensors."""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.distributed as dist

from .messages.framing import RESERVED_TAG
from .communicator import Communicator

_wrapped: "weakref.WeakKeyDictionary[dist.ProcessGroup, Communicator]" = weakref.WeakKeyDictionary()


def as_communicator(op: str, comm, usage: str) -> Communicator:
    """A Communicator for `comm`: a Communicator, a chainermn ProcessGroup, or None (the default group).
    `usage` shows the call the way ChainerMN spells it, for the error when arguments are swapped."""
    if isinstance(comm, Communicator):
        return comm
    if comm is None or isinstance(comm, dist.ProcessGroup):
        group = comm if comm is not None else dist.distributed_c10d._get_default_group()
        if group not in _wrapped:
            _wrapped[group] = Communicator(group)
        return _wrapped[group]
    swapped = ": the arguments are swapped" if isinstance(comm, torch.Tensor) else ""
    raise ValueError(
        f"{op}: communicator must be a torch_chainermn Communicator, a chainermn ProcessGroup or "
        f"None, got {type(comm).__name__}{swapped} (ChainerMN's order is {usage})"
    )


def is_communicator(x) -> bool:
    return isinstance(x, (Communicator, dist.ProcessGroup))


def check_tensor(op: str, name: str, x, usage: str, rank: int | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    where = f" on rank {rank}" if rank is not None else ""
    if is_communicator(x):
        raise ValueError(
            f"{op}: {name} must be a torch.Tensor{where}, got a communicator: the arguments "
            f"are swapped (ChainerMN's order is {usage})"
        )
    raise ValueError(f"{op}: {name} must be a torch.Tensor{where}, got {type(x).__name__}")


def check_peer(op: str, name: str, peer, comm: Communicator) -> int:
    if (
        isinstance(peer, bool)
        or not isinstance(peer, (int, np.integer))
        or not 0 <= peer < comm.size
        or peer == comm.rank
    ):
        raise ValueError(
            f"{op}: {name} must be a rank in [0, {comm.size}) other than this one, got {peer!r} (on rank {comm.rank})"
        )
    return int(peer)


def check_tag(op: str, tag, comm: Communicator) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag < RESERVED_TAG:
        raise ValueError(f"{op}: tag must be an int in [0, {RESERVED_TAG}), got {tag!r} (on rank {comm.rank})")
    return int(tag)


def grad_needed(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def anchor(delegate: torch.Tensor | None = None) -> torch.Tensor:
    """What a function with nothing to differentiate hangs its outputs on: the delegate variable it
    was given, else a fresh empty leaf, so that backward still reaches the function."""
    if delegate is not None and delegate.requires_grad:
        return delegate
    return torch.empty(0, requires_grad=True)
