"""The mean of many tensors across a group in one packed call: what gradient averaging needs."""

from __future__ import annotations

import torch

from ._backend import backend_of
from .options import wire_dtype


def mean_coalesced(tensors, group=None, dtype=None, async_op: bool = False):
    """Replace every tensor by its mean over `group`, in one packed allreduce.

    The tensors (any floating dtypes, mixed) are packed into one reused buffer of `dtype`, the wire
    dtype, with the cast done in the packing pass. float16/bfloat16 are scaled by 1/world_size before
    the sum so it cannot overflow where the mean fits (ChainerMN's prescaling); wider dtypes are
    scaled in the unpacking pass. `dtype` None means the group's Options.allreduce_grad_dtype, and
    when that is None too the widest dtype among the tensors (the backend resolves it).

    Returns the Work when async_op is True, else None once the tensors hold the mean.
    """
    backend = backend_of(group, "mean_coalesced")
    wire = wire_dtype(dtype)
    tensors = list(tensors)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("mean_coalesced: tensors must be a list of torch.Tensor")
    work = backend.mean_coalesced(tensors, wire)
    if async_op:
        return work
    work.wait()
    return None
