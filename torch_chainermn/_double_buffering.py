"""Double buffering's one mechanism, shared by the DDP hook and the multi-node optimizer.

At step k the gradients g_k are copied into a flat buffer kept aside and their mean over the group
starts in the background; at step k+1, after the gradients have been overwritten, mean(g_k) is read
back out of that buffer. The buffer of a mean that has been read serves a later step's copy.

The mean is whatever the caller's `compression=` resolved to (_means.py): the backend's
`mean_coalesced` in a wire dtype (the cast and the 1/world_size scale in its packing pass, the bits a
synchronous mean_coalesced of the same gradients gives), or a compressed mean with its residuals.
"""

from __future__ import annotations

import torch

__all__ = ["BackgroundMean", "start_mean"]


class BackgroundMean:
    """The mean over a group of one step's gradients, computed in the background (see start_mean).

    `buffer` holds the gradients one after another, flat, in the widest of their dtypes; once wait()
    has returned it holds their mean.
    """

    __slots__ = ("buffer", "_work")

    def __init__(self, buffer: torch.Tensor, work):
        self.buffer = buffer
        self._work = work

    def wait(self) -> torch.Tensor:
        """Wait until the mean has arrived (at once if it has) and return `buffer`."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self.buffer

    def read(self, offset: int, out: torch.Tensor) -> None:
        """Write the mean of the buffer's elements from `offset` on into `out`, in out's shape and dtype."""
        mean = self.wait()[offset : offset + out.numel()]
        out.copy_(mean.view(out.shape))

    def unpack(self, tensors) -> None:
        """Write the mean into `tensors`, laid out one after another from the start of the buffer
        (the tensors given to start_mean, or tensors of the same sizes)."""
        offset = 0
        for tensor in tensors:
            self.read(offset, tensor)
            offset += tensor.numel()


@torch.no_grad()
def start_mean(tensors, mean, reuse: torch.Tensor | None = None, params=(), last: bool = True) -> BackgroundMean:
    """Copy `tensors` (one step's gradients, at least one) into a flat buffer and start their mean.

    mean: how it travels (_means.resolve: a WireMean or a GradientCompression), which takes
        `params` ((id, offset, numel) of each parameter in the buffer) and `last` (the step's last mean).
    reuse: the buffer of a mean already read; it is taken again when its size, dtype and device fit.
    The tensors may be changed as soon as this returns: the mean is computed from the copy.
    """
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    total = sum(tensor.numel() for tensor in tensors)
    device = tensors[0].device
    if reuse is not None and (reuse.numel(), reuse.dtype, reuse.device) == (total, dtype, device):
        buffer = reuse
    else:
        buffer = torch.empty(total, dtype=dtype, device=device)
    offset = 0
    for tensor in tensors:
        buffer[offset : offset + tensor.numel()].view(tensor.shape).copy_(tensor)
        offset += tensor.numel()
    return BackgroundMean(buffer, mean.start([buffer], params, last))
