"""Double buffering's one mechanism, shared by the DDP hook and the multi-node optimizer.

At step k the gradients g_k are copied into a flat buffer kept aside and their mean over the group
starts in the background; at step k+1, after the gradients have been overwritten, mean(g_k) is read
back out of that buffer. The buffer of a mean that has been read serves a later step's copy.

The mean is the backend's `mean_coalesced`, as for every other gradient mean of the toolkit: the cast
to the wire dtype and the 1/world_size scale happen in its packing pass, before the sum for 16-bit
wire dtypes (so the sum cannot overflow where the mean fits) and after it otherwise. Going through it
keeps that rule in one place, and gives the bits a synchronous mean_coalesced of the same gradients in
the same wire dtype gives.
"""
from __future__ import annotations

import torch

from .gradients import mean_coalesced

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
        mean = self.wait()[offset:offset + out.numel()]
        out.copy_(mean.view(out.shape))

    def unpack(self, tensors) -> None:
        """Write the mean into `tensors`, laid out one after another from the start of the buffer
        (the tensors given to start_mean, or tensors of the same sizes)."""
        offset = 0
        for tensor in tensors:
            self.read(offset, tensor)
            offset += tensor.numel()


@torch.no_grad()
def start_mean(tensors, group, wire_dtype: torch.dtype | None = None,
               reuse: torch.Tensor | None = None, compression=None, params=(), last: bool = True) -> BackgroundMean:
    """Copy `tensors` (one step's gradients, at least one) into a flat buffer and start their mean.

    group: the chainermn process group to average over.
    wire_dtype: the dtype the sum travels in; None: the group's allreduce_grad_dtype, else the
        buffer's (the widest of the tensors' dtypes).
    reuse: the buffer of a mean already read; it is taken again when its size, dtype and device fit.
    compression: a compression.GradientCompression to average with instead (wire_dtype is then
        unused), with `params` ((id, offset, numel) of each parameter in the buffer) and `last`
        (the step's last mean) as GradientCompression.start takes them.
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
        buffer[offset:offset + tensor.numel()].view(tensor.shape).copy_(tensor)
        offset += tensor.numel()
    if compression is not None:
        work = compression.start([buffer], params, last)
    else:
        work = mean_coalesced([buffer], group=group, dtype=wire_dtype, async_op=True)
    return BackgroundMean(buffer, work)
