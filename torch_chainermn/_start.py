"""How low-communication training starts (LocalSGD's and DiLoCo's `start=`): from rank 0's values, or
from values the replicas already hold.

Replicas made from the same seed or loaded from the same checkpoint are equal before any byte crosses
the network; broadcasting rank 0's model then costs the whole model over the slowest link (2.8 MB at
1 Mbit/s is 22 s; a 1B-parameter model at 10 Mbit/s, 55 minutes) for nothing. With start="same" each
rank instead adds a checksum of every trainable parameter and floating buffer to the agreement the
constructor runs anyway (the shapes and settings: one small all-gather), and a replica that differs
is a ValueError on every rank naming the first tensor that differs, not a silent divergence.
"""

from __future__ import annotations

import hashlib

import torch

STARTS = ("broadcast", "same")


def checksums(model, params, buffers) -> list:
    """(name, digest) of each tensor of `params` then `buffers`, in that order: BLAKE2b (8 bytes) of its
    bytes, so equal values give equal digests and any differing bit (a -0.0, a NaN's payload) does not."""
    names = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    return [(names.get(id(t), "?"), _digest(t)) for t in [*params, *buffers]]


def _digest(tensor: torch.Tensor) -> str:
    raw = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return hashlib.blake2b(raw.numpy(), digest_size=8).hexdigest()
